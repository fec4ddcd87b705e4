#!/usr/bin/env bash
# Install specdec with its test tools (CPU torch pinned) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --disable-pip-version-check torch==2.13.0
python -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev]'
# test-only: speculators' EAGLE-3 model for tests/test_eagle3_conformance.py, without its declared dependencies (they
# would move torch and transformers); just the modules its import needs
python -m pip install -q --disable-pip-version-check --no-deps speculators==0.9.0 loguru==0.7.3 datasets==5.1.0 \
    hs-connectors==0.9.0 pyarrow==26.0.1 pandas==3.1.1 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0
# test-only: z-lab's DFlash model definition for tests/test_dflash.py (its declared dependencies are not needed there)
python -m pip install -q --disable-pip-version-check --no-deps dflash==0.1.0
# test-only: headless Chromium from Debian's packages and Selenium for tests/test_playground.py (skipped without
# them); apt as root or through passwordless sudo, and never fatal where apt is missing or fails
if ! command -v chromedriver >/dev/null && command -v apt-get >/dev/null; then
    apt=(apt-get); [ "$(id -u)" = 0 ] || apt=(sudo -n apt-get)
    { DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y -q chromium chromium-driver \
        || { "${apt[@]}" update -q && DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y -q chromium chromium-driver; }
    } >/dev/null 2>&1 || echo "scripts/test.sh: could not install chromium; tests/test_playground.py will skip" >&2
fi
python -m pip install -q --disable-pip-version-check selenium==4.51.0
# test-only: the official Ollama client for tests/test_server_compat.py (skipped without it; needs only httpx, pydantic)
python -m pip install -q --disable-pip-version-check ollama==0.6.3
# lint and format first (configured in pyproject.toml)
python -m ruff check .
python -m ruff format --check .
# one worker per core, one thread each (most tests are small and single-threaded; tests/test_gguf_kernels.py and
# tests/test_attention.py run the threaded kernels), each test file on one worker (its fixtures built once)
OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python -m pytest -q -n auto --dist loadfile "$@"
