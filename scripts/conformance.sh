#!/usr/bin/env bash
# Model-family conformance, all of it: build llama.cpp's llama-server and llama-quantize from the pinned source once
# (cached per CPU under SPECDEC_HOME; ~20-30 minutes on 2 cores the first time), then every family against
# transformers and llama.cpp, and the gemma3-270m pack against llama.cpp (tests/test_families.py; in
# `bash scripts/test.sh` the llama.cpp half skips where nothing is built).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m specdec.bench.llama_build
OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python -m pytest -q -n auto tests/test_families.py tests/test_families_llama_cpp.py "$@"
