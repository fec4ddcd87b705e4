"""`mtp`: MTP blocks (specdec/models/mtp.py) draft from the target's post-norm final state.

The blocks are the target checkpoint's own next-n layers (DeepSeek-V3 `nextn`, MiMo `mtp_layers`) or a block
trained after the fact (a head directory, manifest kind `mtp`). Feeding and chaining are `PairedHeadDrafter`'s:
the committed pairs (token[P+1], norm(final[P])) go into every block's KV cache, block 0 gives the first draft
token, and draft step s runs block min(s, n - 1) on (its token, the state the step before returned), one position
on. Logits are over the full vocabulary (the target's LM head unless a block has its own).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from specdec.drafters.draft_model import P_MIN
from specdec.drafters.gemma4_assistant import AssistantDrafter
from specdec.drafters.heads import HeadShape, find_head, layer_params, planned_memory, safetensors_params
from specdec.drafters.paired_head import PairedHeadDrafter
from specdec.drafters.registry import BuildContext, DrafterType, HeadMemory, MemoryQuery, Option
from specdec.errors import SpecdecError
from specdec.models.gemma4_assistant import is_assistant, load_assistant
from specdec.models.mtp import MtpHead, checkpoint_config, load_head, native_blocks
from specdec.models.state import is_mtp_tensor
from specdec.models.transformer import Batch
from specdec.runtime.runner import HEADROOM, Features, FeatureSpec, ModelRunner


class MtpDrafter(PairedHeadDrafter):
    name = "mtp"
    features = FeatureSpec(())  # only the final state

    def __init__(self, head: MtpHead, target: ModelRunner, p_min: float = 0.0):
        self.head = head.share(target.model.lm_head)
        self.target_norm = target.model.model.norm
        cache = head.allocate_cache(target.cache.num_slots, target.context + HEADROOM)
        super().__init__(target.model.model.embed_tokens, head.rotary, cache, target.vocab_size, p_min)

    def state(self, feats: Features) -> torch.Tensor:
        return self.target_norm(feats.final).to(self.head.dtype)  # [n, H] post-norm (HF hidden_states[N])

    def run(self, emb: torch.Tensor, g: torch.Tensor, batch: Batch, depth: int | None):
        if depth is None:
            return self.head.feed(emb, g, batch, self.cache)
        return self.head(emb, g, batch, self.cache, depth, last_only=True)


def head_path(options: Mapping[str, Any], model: str | None) -> Path:
    """--spec-mtp-head: a directory, or auto = the target checkpoint itself when it ships MTP layers, else the
    block trained for the target."""
    choice = options["mtp_head"]
    if choice != "auto":
        return Path(choice)
    own = Path(model) if model else None
    if own is not None and (own.is_dir() or own.suffix == ".gguf") and native_blocks(own):
        return own
    return find_head(model, "mtp", HEAD.flag)


def _shape(path: Path) -> HeadShape:
    """A head directory's or a checkpoint's MTP blocks: parameters (the target's shared parts aside) and KV."""
    d = checkpoint_config(path)
    n = native_blocks(path)
    layer = d if n else d["transformer_layer_config"]
    heads, kv_heads = layer["num_attention_heads"], layer.get("num_key_value_heads", layer["num_attention_heads"])
    params = safetensors_params(
        path, (lambda name: not is_mtp_tensor(name, d["num_hidden_layers"])) if n else (lambda name: False)
    )
    return HeadShape(
        params,
        n or int(d.get("num_nextn_predict_layers", 1)),
        kv_heads,
        layer.get("head_dim") or layer["hidden_size"] // heads,
    )


def _estimate(q: MemoryQuery) -> HeadShape:
    """One post-hoc block shaped like the target's layers (`specdec train mtp`'s default)."""
    return HeadShape(2 * q.hidden * q.hidden + layer_params(q, q.hidden) + 3 * q.hidden, 1, q.num_kv_heads, q.head_dim)


def _memory(q: MemoryQuery) -> HeadMemory:
    if is_assistant(q.draft):  # its weights only: it reads the target's K/V
        path = Path(q.draft)
        gguf = path.suffix == ".gguf"
        size = path.stat().st_size if gguf else safetensors_params(path) * q.dtype_bytes
        what = "its blocks as the file holds them" if gguf else f"{safetensors_params(path) / 1e6:.1f} M parameters"
        return HeadMemory({"mtp assistant weights": size}, f"mtp: the Gemma 4 assistant in {path} ({what}), no KV")
    return planned_memory(q, "mtp", lambda: head_path(q.options, q.model), _shape, _estimate)


def _build(ctx: BuildContext) -> MtpDrafter | AssistantDrafter:
    target = ctx.target
    if is_assistant(ctx.draft):  # -md: a Gemma 4 assistant, which drafts from the target's K/V
        assistant = load_assistant(ctx.draft, target.model.model.norm.weight.dtype)
        return AssistantDrafter(assistant.to(target.head_device), target, ctx.options["draft_p_min"])
    path = head_path(ctx.options, ctx.model)
    head = load_head(path, target.model.model.norm.weight.dtype)
    c, t = head.config.layer, target.model.config
    if c.vocab_size != target.vocab_size or c.hidden_size != t.hidden_size:
        raise SpecdecError(
            f"MTP head {path} was made for another target (vocabulary {c.vocab_size}, hidden "
            f"{c.hidden_size}; this target: {target.vocab_size}, {t.hidden_size})"
        )
    return MtpDrafter(head.to(target.head_device), target, ctx.options["draft_p_min"])


HEAD = Option(
    "mtp_head",
    "--spec-mtp-head",
    "auto",
    "mtp: the MTP blocks' directory (a checkpoint with native "
    "nextn / MiMo layers, or a head in the speculators mtp layout); auto = the target's own MTP layers, "
    "else the block trained for the target (SPECDEC_HOME/heads, then shipped ones)",
    str,
)
TYPES = (
    DrafterType(
        "mtp",
        _build,
        "MTP blocks (the checkpoint's own next-n layers or a trained one) on the target's last hidden state; "
        "with -md, a Gemma 4 assistant",
        (HEAD, P_MIN),
        target_features=True,
        per_scope=False,
        memory=_memory,
    ),
)
