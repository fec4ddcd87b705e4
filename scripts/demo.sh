#!/usr/bin/env bash
# Fresh machine -> install specdec (CPU torch pinned), pull the default Qwen2.5-Coder pair, and
# generate the same code edit without and with the 0.5B draft model to show the speedup.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --disable-pip-version-check torch==2.13.0
python -m pip install -q --disable-pip-version-check -c constraints.txt -e .
specdec models pull qwen2.5-coder-1.5b qwen2.5-coder-0.5b
prompt=specdec/bench/prompts/code-edit.txt
echo "== plain decoding (--spec-type none) =="
specdec generate -f "$prompt" --chat -n 256 --spec-type none
echo "== speculative decoding, the default: suffix tree, then the 0.5B draft (--spec-type suffix-tree,draft) =="
specdec generate -f "$prompt" --chat -n 256
