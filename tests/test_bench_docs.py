"""docs/benchmarks.md is what `python scripts/bench_docs.py` writes from docs/bench/ (no models: it reads JSON)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_benchmarks_doc_is_current():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run(
        [sys.executable, "scripts/bench_docs.py", "--check"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr + "\nregenerate: python scripts/bench_docs.py"
