"""MTP blocks: the DeepSeek-V3 `nextn` and MiMo layouts load from tiny random checkpoints; lossless with any
blocks (greedy identical in fp32, sampling distributed as plain through the engine), alone and chained with
suffix; the head directory (speculators `mtp` layout) round-trips and is found for its target; the packed
(training) forward equals the cached one; same draft logits as `speculators==0.9.0`'s `MTPDraftModel`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import specdec
from conftest import make_tiny
from specdec.models.config import ModelConfig
from specdec.models.loader import load_checkpoint
from specdec.models.mtp import MtpConfig, MtpHead, layout_state, load_head, load_native, save_head
from test_eagle3 import PROMPTS, engine_fit
from test_eagle3_conformance import needs_speculators


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


def _lossless_greedy(target: Path, prompts: list[str], max_tokens: int = 40, **kw) -> None:
    llm = specdec.LLM(str(target), dtype="fp32", context=96, adaptive=False, draft_max=4, progress=False, **kw)
    llm.engine.stop_ids = set()
    for prompt in prompts:
        plain = llm.generate(prompt, max_tokens=max_tokens, spec_type="none")
        r = llm.generate(prompt, max_tokens=max_tokens)
        assert r.token_ids == plain.token_ids and r.stats.drafted > 0, prompt


@pytest.mark.parametrize("layout,blocks", [("nextn", 2), ("mimo", 1)])
def test_native_blocks_are_lossless_greedy(tmp_path, layout, blocks):
    """--spec-mtp-head auto finds the checkpoint's own blocks."""
    target, _ = native_checkpoint(tmp_path / "t", layout, blocks)
    _lossless_greedy(target, PROMPTS, spec_type="mtp")


def test_chain_with_suffix_is_lossless(tmp_path):
    target, _ = native_checkpoint(tmp_path / "t", "mimo")
    _lossless_greedy(target, PROMPTS[:2], spec_type="mtp,suffix", chain_mode="gain")


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
    t = ModelConfig.from_hf_dict({"model_type": "qwen2", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 48,
                                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})
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
    llm = specdec.LLM(str(smollm_dir), spec_type="mtp", mtp_head=str(tmp_path / "head"), dtype="fp32", context=256,
                      adaptive=False, draft_max=3, progress=False)
    prompt = "def fib(n):\n    if n < 2:\n        return n\n"
    plain = llm.generate(prompt, max_tokens=24, spec_type="none")
    r = llm.generate(prompt, max_tokens=24)
    assert r.token_ids == plain.token_ids and r.stats.drafted > 0
