"""MTP blocks: the DeepSeek-V3 `nextn` and MiMo layouts load from tiny random checkpoints; lossless with any
blocks (greedy identical in fp32, sampling distributed as plain through the engine), alone and chained with
suffix; the head directory (speculators `mtp` layout) round-trips and is found for its target; the packed
(training) forward equals the cached one; same draft logits as `speculators==0.9.0`'s `MTPDraftModel`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_tiny
from safetensors.torch import save_file
from test_eagle3 import PROMPTS, engine_fit
from test_eagle3_conformance import needs_speculators

import specdec
from specdec.models.config import ModelConfig
from specdec.models.loader import load_checkpoint
from specdec.models.mtp import MtpConfig, MtpHead, layout_state, load_head, load_native, save_head


def random_head(c: MtpConfig, seed: int = 0, scale: float = 0.3) -> MtpHead:
    """Every weight random (norms around 1)."""
    head = MtpHead(c)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if p.dim() == 1 else 0.0))
    return head.eval()


def native_checkpoint(directory: Path, layout: str, blocks: int = 1, seed: int = 0, **tiny) -> tuple[Path, MtpHead]:
    """A tiny random target (llama for nextn, qwen2 for MiMo) with random MTP blocks in `layout`."""
    family = "qwen2" if layout == "mimo" else "llama"
    make_tiny(directory, family, seed=seed, layers=tiny.pop("layers", 2), **tiny)
    cfg_file = directory / "config.json"
    d = json.loads(cfg_file.read_text())
    mimo = layout == "mimo"
    d["num_nextn_predict_layers"] = blocks
    if mimo:
        d.update(model_type="mimo", architectures=["MiMoForCausalLM"])
    cfg_file.write_text(json.dumps(d))
    t = ModelConfig.from_hf_dict(d)
    head = random_head(MtpConfig(t, blocks, hidden_first=mimo, recycle_normed=mimo, own_head=not mimo), seed + 1)
    save_file(layout_state(head, layout, 0 if mimo else t.num_layers), str(directory / "mtp.safetensors"))
    return directory, head


def assert_same_head(a: MtpHead, b: MtpHead) -> None:
    assert a.config == b.config
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k, v in sa.items():
        torch.testing.assert_close(sb[k], v, rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("layout,blocks", [("nextn", 2), ("mimo", 1)])
def test_native_layouts_load(tmp_path, layout, blocks):
    target, head = native_checkpoint(tmp_path / "t", layout, blocks)
    model, _ = load_checkpoint(target, torch.float32)  # the target loader skips the MTP tensors
    assert model.config.num_layers == 2
    assert_same_head(load_native(target), head)
    assert_same_head(load_head(target), head)


def _lossless_greedy(target: Path, prompts: list[str], max_tokens: int = 40, **kw) -> int:
    """Greedy output equals plain decoding's, with drafts -> tokens accepted (random blocks: by chance alone; a
    block that is accepted: test_a_copy_of_the_target_layer_is_accepted)."""
    llm = specdec.LLM(str(target), dtype="fp32", context=96, adaptive=False, draft_max=4, progress=False, **kw)
    llm.engine.stop_ids = set()
    accepted = 0
    for prompt in prompts:
        plain = llm.generate(prompt, max_tokens=max_tokens, spec_type="none")
        r = llm.generate(prompt, max_tokens=max_tokens)
        assert r.token_ids == plain.token_ids and r.stats.drafted > 0, prompt
        accepted += r.stats.accepted
    return accepted


@pytest.mark.parametrize("layout,blocks", [("nextn", 2), ("mimo", 1)])
def test_native_blocks_are_lossless_greedy(tmp_path, layout, blocks):
    """--spec-mtp-head auto finds the checkpoint's own blocks."""
    target, _ = native_checkpoint(tmp_path / "t", layout, blocks)
    _lossless_greedy(target, PROMPTS, spec_type="mtp")


def test_chain_with_suffix_is_lossless(tmp_path):
    target, _ = native_checkpoint(tmp_path / "t", "mimo")
    assert _lossless_greedy(target, PROMPTS[:2], spec_type="mtp,suffix", chain_mode="gain") > 0  # suffix's drafts


def test_head_directory_round_trip_and_auto(tiny_dir, tmp_path, monkeypatch):
    """A post-hoc block saved as a head directory loads back and is what `auto` finds for its target."""
    target = tiny_dir("qwen3", layers=2)
    t = ModelConfig.from_file(target / "config.json")
    head = random_head(MtpConfig.for_target(t, intermediate=96), seed=4)
    home = tmp_path / "home"
    out = save_head(head, home / "heads" / "mtp-tiny", str(target), {"kind": "mtp", "target": str(target)})
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "mtp" and cfg["num_nextn_predict_layers"] == 1
    assert not any(k.startswith("mtp_") for k in cfg)  # speculators' own convention: no flags of ours
    assert_same_head(load_head(out), head)
    monkeypatch.setenv("SPECDEC_HOME", str(home))
    _lossless_greedy(target, PROMPTS[:1], spec_type="mtp")


def test_packed_forward_equals_the_cached_one():
    """What a trainer runs (`MtpHead.packed`, no persistent cache, gradients) gives the drafter's logits."""
    t = ModelConfig.from_hf_dict(
        {
            "model_type": "qwen2",
            "vocab_size": 50,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        }
    )
    head = random_head(MtpConfig(t, 2), seed=2).share(torch.nn.Linear(32, 50, bias=False))
    emb, g = torch.randn(1, 10, 32), torch.randn(1, 10, 32)
    logits, h = head.packed(emb, g)
    cache = head.allocate_cache(1, 12)
    from specdec.models.transformer import Batch
    from specdec.runtime.kv_cache import KVCache

    positions = torch.arange(10)[None]
    cos, sin = head.rotary.tables(positions, torch.float32)
    mask = (torch.arange(10)[None, None, :] <= positions[:, :, None]).unsqueeze(1)
    batch = Batch(torch.tensor([0]), positions, cos, sin, mask, 10, KVCache.span(torch.tensor([0]), positions))
    with torch.no_grad():
        want, want_h = head.feed(emb, g, batch, cache, last_only=False)
    torch.testing.assert_close(logits.detach(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.detach(), want_h, rtol=1e-5, atol=1e-5)
    logits.sum().backward()
    assert head.blocks[0].eh_proj.weight.grad.abs().sum() > 0 and head.lm_head.weight.grad is not None


def test_sampling_through_the_engine_matches_plain(tmp_path):
    """Rejection sampling with MTP blocks samples the target's distribution (the EAGLE-3 test's runs and bounds)."""
    target, _ = native_checkpoint(tmp_path / "t", "mimo", seed=3, layers=3, vocab=8)
    drafted, p_value, tv, bound = engine_fit(target, spec_type="mtp")
    assert drafted > 0 and p_value > 1e-3 and tv < bound, (drafted, p_value, tv)


@pytest.mark.real
def test_smollm_post_hoc_block_is_lossless(smollm_dir, tmp_path):
    t = ModelConfig.from_file(smollm_dir / "config.json")
    head = random_head(MtpConfig.for_target(t, intermediate=256), scale=0.02)
    save_head(head, tmp_path / "head", str(smollm_dir), {"kind": "mtp", "target": "x"})
    llm = specdec.LLM(
        str(smollm_dir),
        spec_type="mtp",
        mtp_head=str(tmp_path / "head"),
        dtype="fp32",
        context=256,
        adaptive=False,
        draft_max=3,
        progress=False,
    )
    prompt = "def fib(n):\n    if n < 2:\n        return n\n"
    plain = llm.generate(prompt, max_tokens=24, spec_type="none")
    r = llm.generate(prompt, max_tokens=24)
    assert r.token_ids == plain.token_ids and r.stats.drafted > 0  # drafted only: a random block


# --- conformance with speculators 0.9.0 (test-only install: scripts/test.sh) ---
# Inputs map one to one: their `hidden_states` [1, N, H] = our g (the drafter feeds the target's post-norm final
# state, HF hidden_states[N] = their `verifier_last_hidden_states`); their step k at row t pairs input_ids[t+k+1]
# with step k-1's output at t (step 0: the target state), position t, keys of step k's own rows 0..t: our
# `MtpHead.packed` over the same pairs (step 0 is also the drafter's catch-up feed: test_packed_forward_equals_...).
N, STEPS = 40, 3
QWEN3 = {
    "model_type": "qwen3",
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 256,
    "rope_theta": 20000.0,
    "tie_word_embeddings": False,
}


def speculators_model(steps: int = STEPS):
    """speculators' MTPDraftModel over a tiny Qwen3 layer (its supported MTP family), embeddings and LM head random."""
    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.models.mtp import MTPDraftModel, MTPSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    spec = SpeculatorsConfig(
        algorithm="mtp",
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=steps)],
        default_proposal_method="greedy",
        verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]),
    )
    layer = Qwen3Config(**{k: v for k, v in QWEN3.items() if k != "model_type"})
    model = MTPDraftModel(MTPSpeculatorConfig(transformer_layer_config=layer, speculators_config=spec)).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in (model.embed_tokens.weight, model.lm_head.weight):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def our_logits(head: MtpHead, embed: torch.Tensor, hidden: torch.Tensor, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per step k, [1, N - STEPS - 1, V] teacher-forced as speculators' forward."""
    valid = N - STEPS - 1
    g, out = hidden[None], []
    with torch.no_grad():
        for k in range(STEPS):
            logits, g = head.packed(embed[ids[k + 1 : k + 1 + valid]][None], g[:, :valid])
            out.append(logits)
    return out


def _inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, QWEN3["hidden_size"], generator=g), torch.randint(0, QWEN3["vocab_size"], (N,), generator=g)


def _their_logits(model, hidden: torch.Tensor, ids: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        logits, _, _ = model(input_ids=ids[None], hidden_states=hidden[None])
    return logits


@needs_speculators
def test_speculators_gives_the_same_logits_as_our_head():
    """Our random head, exported under speculators' names (`layout_state`), loaded into MTPDraftModel."""
    model = speculators_model()
    head = random_head(MtpConfig(ModelConfig.from_hf_dict({**QWEN3, "num_hidden_layers": 2})), seed=5)
    head.share(model.lm_head)
    missing, unexpected = model.load_state_dict(layout_state(head, "speculators"), strict=False)
    assert not unexpected and set(missing) <= {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight"}
    hidden, ids = _inputs()
    ours, theirs = our_logits(head, model.embed_tokens.weight, hidden, ids), _their_logits(model, hidden, ids)
    assert len(theirs) == STEPS
    for k in range(STEPS):
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-4, atol=1e-4, msg=f"step {k}")


@needs_speculators
def test_speculators_checkpoint_loads_as_our_head(tmp_path):
    """A checkpoint MTPDraftModel.save_pretrained writes (transformers 5 config, no embeddings / LM head)."""
    model = speculators_model()
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("mtp_layers."):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    model.save_pretrained(str(tmp_path / "spec"))
    head = load_head(tmp_path / "spec").share(model.lm_head)
    c = head.config
    assert (c.num_blocks, c.hidden_first, c.recycle_normed, c.layer.rope_theta, c.layer.qk_norm) == (
        1,
        False,
        True,
        20000.0,
        "head",
    )
    hidden, ids = _inputs(2)
    ours, theirs = our_logits(head, model.embed_tokens.weight, hidden, ids), _their_logits(model, hidden, ids)
    for k in range(STEPS):
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-4, atol=1e-4, msg=f"step {k}")


def copy_of_layer0(directory: Path) -> Path:
    """A 1-layer llama target whose nextn block is its own layer: token embeddings rescaled to RMS 1 (so enorm is
    the identity), eh_proj passes the embedding through and drops h, shared_head.norm = the final norm. The block at
    position P then runs the target's computation for token[P+1] over tokens 1..P+1 (RoPE is relative): it guesses
    the target's next token but for the missing token 0, if pairs and positions line up."""
    from safetensors.torch import load_file

    make_tiny(directory, "llama", seed=5, layers=1)
    state = load_file(str(directory / "model.safetensors"))
    emb = state["model.embed_tokens.weight"]
    state["model.embed_tokens.weight"] = emb * emb.pow(2).mean(-1, keepdim=True).rsqrt()
    save_file(state, str(directory / "model.safetensors"), {"format": "pt"})
    H = emb.shape[1]
    block = {k.replace("model.layers.0.", "model.layers.1."): v for k, v in state.items() if ".layers.0." in k}
    block.update(
        {
            "model.layers.1.enorm.weight": torch.ones(H),
            "model.layers.1.hnorm.weight": torch.ones(H),
            "model.layers.1.eh_proj.weight": torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1),
            "model.layers.1.shared_head.norm.weight": state["model.norm.weight"],
        }
    )
    save_file(block, str(directory / "mtp.safetensors"))
    d = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**d, "num_nextn_predict_layers": 1}))
    return directory


def test_a_copy_of_the_target_layer_is_accepted(tmp_path):
    """Most drafts of the copy are accepted (a wrong pairing of tokens, states or positions would not be), and the
    output is still the plain one."""
    llm = specdec.LLM(
        str(copy_of_layer0(tmp_path / "t")),
        spec_type="mtp",
        dtype="fp32",
        context=96,
        adaptive=False,
        draft_max=4,
        progress=False,
    )
    llm.engine.stop_ids = set()
    drafted = accepted = 0
    for prompt in PROMPTS:
        plain = llm.generate(prompt, max_tokens=40, spec_type="none")
        r = llm.generate(prompt, max_tokens=40)
        assert r.token_ids == plain.token_ids, prompt
        drafted, accepted = drafted + r.stats.drafted, accepted + r.stats.accepted
    assert accepted > 0.4 * drafted, (drafted, accepted)  # 79 of 144 here
