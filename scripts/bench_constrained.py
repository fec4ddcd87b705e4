"""Constrained output with and without speculation (specdec/bench/constrained.py); --help for the options."""

from specdec.bench.constrained import main

if __name__ == "__main__":
    main()
