"""`dspark`: a DSpark block drafter - DFlash's parallel block (drafters/dflash.py) plus a Markov head that biases each
draft by the token before it and a confidence head that ends the block early (`--spec-dspark-threshold`).

The network and its heads are specdec/models/dflash.py; the drafting loop is `DFlashDrafter`'s, which reads both
heads from the checkpoint. The threshold is compared with the confidence head's P(accepted) of each draft slot
before its token is drawn, so a truncated block is still verified losslessly.
"""

from __future__ import annotations

from specdec.drafters.dflash import DFlashDrafter, build, estimate, head_path, shape
from specdec.drafters.draft_model import P_MIN
from specdec.drafters.heads import planned_memory
from specdec.drafters.registry import BuildContext, DrafterType, HeadMemory, MemoryQuery, Option
from specdec.models.dflash import default_features


class DSparkDrafter(DFlashDrafter):
    name = "dspark"


def _build(ctx: BuildContext) -> DSparkDrafter:
    return build(ctx, "dspark", HEAD.flag, ctx.options["dspark_threshold"], DSparkDrafter)


def _memory(q: MemoryQuery) -> HeadMemory:
    return planned_memory(
        q,
        "dspark",
        lambda: head_path(q.options, q.model, "dspark", HEAD.flag),
        shape,
        lambda m: estimate(m, len(default_features(m.num_layers, 5)), markov_rank=256),
    )


HEAD = Option(
    "dspark_head",
    "--spec-dspark-head",
    "auto",
    "dspark: the drafter's directory (speculators dspark "
    "layout); auto = the one trained for the target (SPECDEC_HOME/heads, then shipped ones)",
    str,
)
THRESHOLD = Option(
    "dspark_threshold",
    "--spec-dspark-threshold",
    0.0,
    "dspark: end a block before the first draft "
    "whose confidence-head acceptance probability is below this (0 = never; default 0)",
    float,
    "in [0, 1]",
)
TYPES = (
    DrafterType(
        "dspark",
        _build,
        "a DSpark block drafter (DFlash block + Markov and confidence heads) on the target's hidden states",
        (HEAD, P_MIN, THRESHOLD),
        target_features=True,
        per_scope=False,
        memory=_memory,
    ),
)
