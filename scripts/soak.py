"""Soak `specdec serve` with mixed traffic and check it (see docs/server.md, "Tests"); --help for the options."""

import sys

from specdec.bench.soak import main

if __name__ == "__main__":
    sys.exit(main())
