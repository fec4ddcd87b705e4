"""A Gemma 4 assistant as the drafter (`--spec-type mtp -md ASSISTANT_DIR`, models/gemma4_assistant.py) on tiny
random checkpoints made by `transformers`:

1. each draft step's logits and state equal transformers' `Gemma4AssistantForCausalLM` fed as its
   `MTPCandidateGenerator` feeds it (the target's embedding and final state, its shared K/V, one position), with and
   without ordered embeddings; the engine's first draft after the prompt is the same tokens;
2. an assistant that copies a bigram target (the target's layers add nothing; the assistant passes the embedding
   through) gets its drafts accepted, and the output equals plain decoding;
3. sampling through the engine with a random assistant samples the target's distribution.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from families import make_checkpoint, prompt_ids, randomize

import specdec

STEPS = 4


@pytest.fixture(autouse=True)
def _home(family_home):
    pass


def make_assistant(target: Path, out: Path, ordered: bool = False, seed: int = 1, hidden: int = 32) -> Path:
    """A random Gemma 4 assistant for `target` (2 layers: sliding, full, with the target's K/V shapes)."""
    from transformers import AutoConfig
    from transformers.models.gemma4_assistant import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    t = json.loads((target / "config.json").read_text())
    full = t["layer_types"].index("full_attention")
    text = AutoConfig.for_model(
        "gemma4_text",
        vocab_size=t["vocab_size"],
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=t["num_key_value_heads"],
        head_dim=t["head_dim"],
        global_head_dim=t["per_layer_config"][str(full)]["head_dim"],
        num_global_key_value_heads=t["per_layer_config"][str(full)].get("num_key_value_heads"),
        attention_k_eq_v=t["attention_k_eq_v"],
        sliding_window=t["sliding_window"],
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        layer_types=["sliding_attention", "full_attention"],
    )
    cfg = Gemma4AssistantConfig(
        text_config=text,
        backbone_hidden_size=t["hidden_size"],
        use_ordered_embeddings=ordered,
        num_centroids=8,
        centroid_intermediate_top_k=2,
    )
    torch.manual_seed(seed)
    model = Gemma4AssistantForCausalLM(cfg)
    randomize(model, seed)
    if ordered:
        order = torch.randperm(t["vocab_size"], generator=torch.Generator().manual_seed(seed))
        model.masked_embedding.token_ordering.copy_(order)
    model.save_pretrained(str(out))
    return out


def _reference_steps(target: Path, assistant: Path, ids: list[int]) -> tuple[list[int], list, list]:
    """transformers' target on `ids`, its greedy next token, then STEPS assistant steps as `MTPCandidateGenerator`
    takes them -> (that token, per step (embedding, state in), per step (logits, state out))."""
    from transformers import AutoModelForCausalLM
    from transformers.models.gemma4_assistant import Gemma4AssistantForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    helper = Gemma4AssistantForCausalLM.from_pretrained(str(assistant), dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True, return_shared_kv_states=True, use_cache=True)
        token, h = out.logits[0, -1].argmax()[None, None], out.hidden_states[-1][:, -1:]
        inputs, outputs = [], []
        for _ in range(STEPS):
            e = hf.get_input_embeddings()(token)
            o = helper(
                inputs_embeds=torch.cat([e, h], dim=-1),
                position_ids=torch.tensor([[len(ids)]]),
                shared_kv_states=out.shared_kv_states,
                attention_mask=torch.ones(1, len(ids) + 1, dtype=torch.long),
            )
            inputs.append((e[0], h[0]))
            outputs.append((o.logits[0, -1], o.last_hidden_state[0]))
            token, h = o.logits.argmax(-1), o.last_hidden_state
    return [int(out.logits[0, -1].argmax())], inputs, outputs


@pytest.mark.parametrize("ordered", [False, True])
def test_draft_steps_equal_transformers(family_files, tmp_path, ordered):
    from specdec.models.gemma4_assistant import load_assistant
    from specdec.models.loader import load_checkpoint
    from specdec.runtime.runner import ModelRunner

    target = family_files("gemma4").hf  # 6 layers, the last two reading the K/V of the two before
    assistant = make_assistant(target, tmp_path / "assistant", ordered)
    ids = prompt_ids(target, 12)  # past the sliding window (8)
    first, inputs, outputs = _reference_steps(target, assistant, ids)

    model, _ = load_checkpoint(target, torch.float32)
    runner = ModelRunner(model, num_slots=1, context=64)
    runner.forward([ids], [0], [0])
    ours = load_assistant(assistant)
    ours.attach(model.config)
    for (e, h), (logits, state) in zip(inputs, outputs):
        got, got_state = ours(e, h, len(ids), 0, runner.cache)
        assert (got - logits).abs().max() < 1e-4 and (got_state - state).abs().max() < 1e-4

    llm = specdec.LLM(str(target), draft=str(assistant), spec_type="mtp", context=64, progress=False)
    llm.engine.spec.adaptive, llm.engine.spec.draft_max = False, STEPS
    drafts = []
    propose = llm.drafter.propose
    llm.drafter.propose = lambda seq, k, p=0.0: drafts.append(propose(seq, k, p)) or drafts[-1]
    llm.engine.stop_ids = set()
    llm.generate(ids, max_tokens=2 * STEPS)
    want = [int(logits.argmax()) for logits, _ in outputs]
    assert drafts[0].tokens == want


def _bigram_pair(directory: Path) -> tuple[Path, Path]:
    """A Gemma 4 target whose layers add nothing (o_proj, down_proj and the per-layer projection zero: logits are a
    function of the last token) and an assistant that computes the same function: hidden as wide as the target's,
    pre_projection passing the embedding through, its layers adding nothing, the target's embeddings and final norm."""
    from safetensors.torch import load_file, save_file

    target = make_checkpoint(directory / "target", "gemma4")
    path = target / "model.safetensors"
    state = load_file(str(path))
    for k in [k for k in state if k.endswith(("o_proj.weight", "down_proj.weight", "per_layer_projection.weight"))]:
        state[k] = torch.zeros_like(state[k])
    save_file(state, str(path), {"format": "pt"})
    assistant = make_assistant(target, directory / "assistant", hidden=64)
    a_path = assistant / "model.safetensors"
    a = load_file(str(a_path))
    for k in [k for k in a if k.endswith(("o_proj.weight", "down_proj.weight"))]:
        a[k] = torch.zeros_like(a[k])
    a["pre_projection.weight"] = torch.cat([torch.eye(64), torch.zeros(64, 64)], dim=1)
    a["model.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    a["model.norm.weight"] = state["model.norm.weight"].clone()
    save_file({k: v.contiguous() for k, v in a.items()}, str(a_path), {"format": "pt"})
    return target, assistant


def test_a_copying_assistant_is_accepted_and_lossless(tmp_path):
    target, assistant = _bigram_pair(tmp_path)
    llm = specdec.LLM(str(target), draft=str(assistant), spec_type="mtp", context=128, progress=False)
    llm.engine.stop_ids = set()
    llm.engine.spec.adaptive, llm.engine.spec.draft_max = False, 3
    ids = prompt_ids(target, 8)
    plain = llm.generate(ids, max_tokens=30, spec_type="none").token_ids
    r = llm.generate(ids, max_tokens=30)
    assert r.token_ids == plain
    assert r.stats.accepted == r.stats.drafted > 0  # the softcap (no argmax change) aside, the same computation


def test_sampling_through_the_engine_matches_plain(tmp_path):
    """Rejection sampling with the assistant's drafts samples the target's distribution (the EAGLE-3 test's runs and
    bounds)."""
    from conftest import make_tiny
    from test_eagle3 import engine_fit

    target = make_tiny(tmp_path / "t", "gemma4", seed=3, vocab=8)
    assistant = make_assistant(target, tmp_path / "assistant", seed=2)
    drafted, p_value, tv, bound = engine_fit(target, spec_type="mtp", draft=str(assistant))
    assert drafted > 0 and p_value > 1e-3 and tv < bound, (drafted, p_value, tv)
