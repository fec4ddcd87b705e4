#!/usr/bin/env bash
# The checks that need a CUDA device (tests/test_cuda.py: -ngl/-ngld placement, lossless decoding on the GPU for
# every spec type, head and block drafter, the head trainers with device cuda), run with the machine's own Python
# and torch (nothing installed). Usage: bash scripts/gpu_check.sh [LOG_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
log=${1:-/tmp}/gpu_check.log
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 SPECDEC_HOME=${SPECDEC_HOME:-/tmp/specdec-home}
nvidia-smi -L
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0))"
python3 -m pytest tests/test_cuda.py -q -n 8 --durations=8 -p no:cacheprovider 2>&1 | tee "$log"
