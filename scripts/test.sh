#!/usr/bin/env bash
# Install specdec with its test tools (CPU torch pinned) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --disable-pip-version-check torch==2.13.0
python -m pip install -q --disable-pip-version-check -e '.[dev]'
python -m pytest -q "$@"
