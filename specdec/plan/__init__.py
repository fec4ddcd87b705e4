"""`specdec plan`: memory, context, layer offload, speed and drafter choice before anything runs,
and the same setup exported to llama.cpp, Ollama, vLLM, TGI and transformers.

Modules: `units` (sizes), `formats` (bytes per quant type), `specs` (model specs from packs, GGUF,
checkpoints, config.json), `memory`, `devices`, `speed` (bandwidth bounds, speculative formula),
`recommend`, `planner` (`make_plan`), `report` (table / JSON), `export`. Layer placement itself is
`specdec.runtime.placement`.
"""

from specdec.plan.planner import Plan, PlanInputs, make_plan

__all__ = ["Plan", "PlanInputs", "make_plan"]
