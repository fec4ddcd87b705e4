"""A Gemma 4 assistant as the drafter (`--spec-type mtp -md ASSISTANT_DIR`, models/gemma4_assistant.py) on tiny
random checkpoints made by `transformers`:

1. each draft step's logits and state equal transformers' `Gemma4AssistantForCausalLM` fed as its
   `MTPCandidateGenerator` feeds it (the target's embedding and final state, its shared K/V, one position), with and
   without ordered embeddings; the engine's first draft after the prompt is the same tokens;
2. an assistant that copies a bigram target (the target's layers add nothing; the assistant passes the embedding
   through) gets its drafts accepted, and the output equals plain decoding;
3. from llama.cpp's GGUFs of both (its converter's `gemma4-assistant`), the same drafted and accepted counts
   (`timings.draft_n` / `draft_n_accepted`) and tokens as llama-server's `--spec-type draft-mtp -md ASSISTANT.gguf`:
   on the copying pair, and on one whose attention adds a little in both, so that part of the drafts fail, its
   context within the sliding window (where llama.cpp's window, window - 1 keys before the position, and
   transformers', window + 1, see the same keys);
4. sampling through the engine with a random assistant samples the target's distribution.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from families import make_checkpoint, need_converter, prompt_ids, randomize

import specdec

STEPS = 4
DRAFT_MAX = 3
ATTENTION = 2.0  # 90 drafted, 7 accepted


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

    llm = specdec.LLM(str(target), draft=str(assistant), spec_type="mtp", dtype="fp32", context=64, progress=False)
    llm.engine.spec.adaptive, llm.engine.spec.draft_max = False, STEPS
    drafts = []
    propose = llm.drafter.propose
    llm.drafter.propose = lambda seq, k, p=0.0: drafts.append(propose(seq, k, p)) or drafts[-1]
    llm.engine.stop_ids = set()
    llm.generate(ids, max_tokens=2 * STEPS)
    want = [int(logits.argmax()) for logits, _ in outputs]
    assert drafts[0].tokens == want


def _bigram_pair(directory: Path, attention: float = 0.0, **overrides) -> tuple[Path, Path]:
    """A Gemma 4 target whose layers add nothing (o_proj, down_proj and the per-layer projection zero: its logits are
    a function of the last token, W_j . norm(E_t)) and an assistant that computes the same function at half the width
    (llama.cpp wants the two widths apart): the target's embeddings E = B U^T and its LM head W = C U^T lie in the span
    of U [64, 32] (orthonormal columns); the assistant's pre_projection U^T passes the embedding through and drops the
    state, its layers add nothing, its LM head is C; both final norms scale by 1. `attention`: the attention is kept in
    both, its output normed to that RMS (the assistant's drafts then depend on what it reads of the target's K/V)."""
    from safetensors.torch import load_file, save_file

    target = make_checkpoint(directory / "target", "gemma4", tie_word_embeddings=False, **overrides)
    path = target / "model.safetensors"
    state = load_file(str(path))
    _quiet(state, ("down_proj.weight", "per_layer_projection.weight"), attention)
    g = torch.Generator().manual_seed(5)
    u = torch.linalg.qr(torch.randn(64, 64, generator=g))[0][:, :32]  # [64, 32]
    b, c = torch.randn(2, state["model.embed_tokens.weight"].shape[0], 32, generator=g)
    state["model.embed_tokens.weight"], state["lm_head.weight"] = b @ u.T, c @ u.T
    state["model.norm.weight"] = torch.ones(64)
    save_file(state, str(path), {"format": "pt"})
    assistant = make_assistant(target, directory / "assistant")
    a_path = assistant / "model.safetensors"
    a = load_file(str(a_path))
    _quiet(a, ("down_proj.weight",), attention)
    a["pre_projection.weight"] = torch.cat([u.T, torch.zeros(32, 64)], dim=1)
    a["model.embed_tokens.weight"], a["model.norm.weight"] = c, torch.ones(32)
    save_file({k: v.contiguous() for k, v in a.items()}, str(a_path), {"format": "pt"})
    return target, assistant


def _quiet(state: dict[str, torch.Tensor], zeroed: tuple[str, ...], attention: float) -> None:
    """Zero the `zeroed` matrices; the attention's output too, or with `attention` its post-norm weight to that."""
    for k in [k for k in state if k.endswith(zeroed) or k.endswith("o_proj.weight") and not attention]:
        state[k] = torch.zeros_like(state[k])
    for k in [k for k in state if attention and k.endswith("post_attention_layernorm.weight")]:
        state[k] = torch.full_like(state[k], attention)


def test_a_copying_assistant_is_accepted_and_lossless(tmp_path):
    target, assistant = _bigram_pair(tmp_path)
    llm = specdec.LLM(str(target), draft=str(assistant), spec_type="mtp", dtype="fp32", context=128, progress=False)
    llm.engine.stop_ids = set()
    llm.engine.spec.adaptive, llm.engine.spec.draft_max = False, 3
    ids = prompt_ids(target, 8)
    plain = llm.generate(ids, max_tokens=30, spec_type="none").token_ids
    r = llm.generate(ids, max_tokens=30)
    assert r.token_ids == plain
    assert r.stats.accepted == r.stats.drafted > 0  # the softcap (no argmax change) aside, the same computation


def _with_tokenizer(assistant: Path, target: Path) -> Path:
    """The target's tokenizer files beside the assistant (llama.cpp's converter writes the vocabulary into its GGUF)."""
    for f in target.glob("tokenizer*"):
        shutil.copy(f, assistant / f.name)
    return assistant


def _ours(target: Path, assistant: Path, ids: list[int], tokens: int) -> tuple[list[int], int, int]:
    """(tokens, drafted, accepted) of greedy decoding with the assistant at DRAFT_MAX tokens a step (up to EOS, as
    llama-server stops), checked against plain decoding."""
    llm = specdec.LLM(str(target), draft=str(assistant), spec_type="mtp", dtype="fp32", context=128, progress=False)
    llm.engine.spec.adaptive, llm.engine.spec.draft_max = False, DRAFT_MAX
    plain = llm.generate(ids, max_tokens=tokens, spec_type="none").token_ids
    r = llm.generate(ids, max_tokens=tokens)
    assert r.token_ids == plain
    return plain, r.stats.drafted, r.stats.accepted


@pytest.mark.parametrize("pair", ["copying", "attending"])
def test_drafted_and_accepted_as_llama_cpp_draft_mtp(tmp_path, pair):
    from families import convert
    from test_families_llama_cpp import llama_server

    need_converter()
    if pair == "copying":
        target, assistant = _bigram_pair(tmp_path)
    else:  # 8 + 40 positions: inside the window
        target, assistant = _bigram_pair(tmp_path, attention=ATTENTION, sliding_window=64)
    gguf = convert(target, "f32", tmp_path / "target.gguf")
    helper = convert(_with_tokenizer(assistant, target), "f32", tmp_path / "assistant.gguf")
    ids = prompt_ids(target, 8)
    tokens = 40
    tokens_out, drafted, accepted = _ours(gguf, helper, ids, tokens)
    with llama_server(gguf, "llama-mtp", DRAFT_MAX, helper) as server:
        body = {"prompt": ids, "n_predict": tokens, "temperature": 0.0, "cache_prompt": False}
        resp = server.complete({**body, "return_tokens": True})
    timings = resp["timings"]
    assert resp["tokens"] == tokens_out
    assert (timings["draft_n"], timings["draft_n_accepted"]) == (drafted, accepted), timings
    assert 0 < accepted == drafted if pair == "copying" else 0 < accepted < drafted, timings


def test_sampling_through_the_engine_matches_plain(tmp_path):
    """Rejection sampling with the assistant's drafts samples the target's distribution (the EAGLE-3 test's runs and
    bounds)."""
    from conftest import make_tiny
    from test_eagle3 import engine_fit

    target = make_tiny(tmp_path / "t", "gemma4", seed=3, vocab=8)
    assistant = make_assistant(target, tmp_path / "assistant", seed=2)
    drafted, p_value, tv, bound = engine_fit(target, spec_type="mtp", draft=str(assistant))
    assert drafted > 0 and p_value > 1e-3 and tv < bound, (drafted, p_value, tv)


def test_plan_counts_the_assistant(family_files, tmp_path):
    """`specdec plan -md ASSISTANT --spec-type mtp`: the assistant's weights in the runtime dtype, no KV of its own."""
    from specdec.drafters.heads import safetensors_params
    from specdec.plan import PlanInputs, make_plan

    target = family_files("gemma4").hf
    assistant = make_assistant(target, tmp_path / "assistant")
    plan = make_plan(PlanInputs(model=str(target), draft=str(assistant), spec_type="mtp", context=256, dtype="fp32"))
    assert plan.heads == {"mtp assistant weights": 4 * safetensors_params(assistant)}
    assert any(n.startswith("mtp: the Gemma 4 assistant") for n in plan.notes)
