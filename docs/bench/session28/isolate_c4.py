"""scripts/profile_serve.py with mode `on` standing for an auto server whose load controller is forced to cap 0
(requests carry the drafter, nothing drafts): tells auto's bookkeeping from its arms. Same arguments as
profile_serve.py; run from the repository root."""
import runpy
import sys

import specdec.bench.serve_bench as sb
from specdec.engine.load_control import LoadController

forced = [False]
choose, level = LoadController.choose, sb._level


def forced_choose(self, batch):
    return 0 if forced[0] else choose(self, batch)


def forced_level(llm, convs, conc, mode, n):
    forced[0] = mode == "on"
    return level(llm, convs, conc, "auto" if forced[0] else mode, n)


LoadController.choose, sb._level = forced_choose, forced_level
sys.argv = ["profile_serve.py"] + sys.argv[1:]
runpy.run_path("scripts/profile_serve.py", run_name="__main__")
