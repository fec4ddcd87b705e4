"""Medusa heads: lossless with any head (greedy identical in fp32 for chains and trees, sampling distributed as
plain through the engine), vLLM and TGI layouts load to the same heads, the head for a target is found, best-first
trees, and training lowers the loss."""

from __future__ import annotations

import dataclasses
import json
from functools import partial

import pytest
import torch
from conftest import head_llm, make_tiny, randomize
from safetensors.torch import load_file, save_file
from test_eagle3 import HEAD_RUNS, PROMPTS, V, engine_fit
from test_train_data import _build, chat_dir, rules  # noqa: F401 (fixtures)

import specdec
from specdec.drafters.medusa import best_first_tree, chain, find_head
from specdec.models.loader import load_checkpoint
from specdec.models.medusa import MedusaConfig, MedusaHeads, load_heads, save_heads
from specdec.train.medusa import MedusaTrainer, TrainConfig, gather, head_losses


def random_heads(
    target_dir, seed: int = 0, scale: float = 0.3, skip: int = 5, num_heads: int = 3, num_layers: int = 1
) -> MedusaHeads:
    """Random heads for the checkpoint in `target_dir`, the draft vocabulary all but the first `skip` ids."""
    model, _ = load_checkpoint(target_dir, torch.float32)
    c = model.config
    heads = MedusaHeads(MedusaConfig(num_heads, num_layers, c.hidden_size, c.vocab_size, c.vocab_size - skip))
    randomize(heads, seed, scale)
    heads.set_vocab(torch.arange(skip, c.vocab_size))
    return heads


_llm = partial(head_llm, "medusa")


@pytest.mark.parametrize("family,topk", [("llama", 1), ("qwen2", 1), ("qwen3", 1), ("llama", 3), ("qwen2", 2)])
def test_any_head_is_lossless_greedy(tiny_dir, tmp_path, family, topk):
    target = tiny_dir(family, layers=3)
    save_heads(random_heads(target), tmp_path / "head", {"kind": "medusa", "target": "tiny"})
    llm = _llm(target, tmp_path / "head", context=96, draft_max=5, medusa_topk=topk)
    for prompt in PROMPTS:
        plain = llm.generate(prompt, max_tokens=40, spec_type="none")
        r = llm.generate(prompt, max_tokens=40)
        assert r.token_ids == plain.token_ids and r.stats.drafted > 0, prompt  # drafted only: random heads


def test_sampling_through_the_engine_matches_plain(tmp_path):
    """Rejection sampling of Medusa's drafts samples the target's distribution: 8,000 runs through the engine,
    chi-square and total variation against the exact joint. Chains (batched in one target forward); the one-hot
    tree verification Medusa's trees use is covered by the EAGLE-3 and n-gram tree tests, one forward per tree."""
    target = make_tiny(tmp_path / "t", "llama", seed=3, layers=3, vocab=V)
    save_heads(random_heads(target, seed=1, scale=1.0, skip=2), tmp_path / "head", {"kind": "medusa", "target": "t"})
    drafted, p_value, tv, bound = engine_fit(
        target, spec_type="medusa", medusa_head=str(tmp_path / "head"), medusa_topk=1
    )
    assert drafted > HEAD_RUNS and p_value > 1e-3 and tv < bound, (drafted, p_value, tv)


@pytest.mark.real
@pytest.mark.parametrize("topk", [1, 4])
def test_smollm_any_head_is_lossless(smollm_dir, tmp_path, topk):
    save_heads(random_heads(smollm_dir, scale=0.02, skip=0), tmp_path / "head", {"kind": "medusa", "target": "x"})
    llm = _llm(smollm_dir, tmp_path / "head", context=256, draft_max=6, medusa_topk=topk)
    prompt = "def fib(n):\n    if n < 2:\n        return n\n"
    plain = llm.generate(prompt, max_tokens=24, spec_type="none")
    r = llm.generate(prompt, max_tokens=24)
    assert r.token_ids == plain.token_ids and r.stats.drafted > 0  # drafted only: random heads


def _same(a: MedusaHeads, b: MedusaHeads) -> None:
    assert a.config == b.config
    for k, v in a.state_dict().items():
        torch.testing.assert_close(b.state_dict()[k], v, rtol=0, atol=0, msg=k)


def test_layouts_load_to_the_same_heads(tiny_dir, tmp_path):
    heads = random_heads(tiny_dir("llama", layers=3), num_layers=2)
    save_heads(heads, tmp_path / "vllm")
    state = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    assert {"blocks.2.layers.1.weight", "blocks.0.layers.0.bias", "lm_heads.2.weight", "token_map"} <= set(state)
    cfg = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert (cfg["num_heads"], cfg["num_hidden_layers"], cfg["truncated_vocab_size"]) == (3, 2, 91)
    _same(heads, load_heads(tmp_path / "vllm"))

    full = tmp_path / "vllm-full"  # full-vocabulary LM heads (vLLM cuts them to token_map), a prefix
    full.mkdir()
    wide = {f"medusa_heads.{k}": v for k, v in state.items()}
    for i in range(3):
        w = torch.zeros(96, heads.config.hidden_size)
        w[heads.token_map] = state[f"lm_heads.{i}.weight"]
        wide[f"medusa_heads.lm_heads.{i}.weight"] = w
    save_file(wide, str(full / "model.safetensors"))
    (full / "config.json").write_text(json.dumps(cfg))
    _same(heads, load_heads(full))


def test_tgi_layout_loads(tiny_dir, tmp_path):
    heads = random_heads(tiny_dir("llama", layers=3), num_layers=2, skip=0)
    tgi = tmp_path / "tgi"
    tgi.mkdir()
    state = {}
    for i in range(3):
        for j in range(2):
            state[f"{i}.{j}.linear.weight"] = heads.blocks[i].layers[j].weight.detach().clone()
            state[f"{i}.{j}.linear.bias"] = heads.blocks[i].layers[j].bias.detach().clone()
        state[f"{i}.2.weight"] = heads.lm_heads[i].weight.detach().clone()
    save_file(state, str(tgi / "medusa_lm_head.safetensors"))
    (tgi / "config.json").write_text(
        json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 2, "base_model_name_or_path": "tiny"})
    )
    _same(heads, load_heads(tgi))


def test_vllm_shared_lm_head_and_no_bias(tiny_dir, tmp_path):
    heads = random_heads(tiny_dir("llama", layers=3), skip=0)
    with torch.no_grad():
        for i in range(3):
            heads.blocks[i].layers[0].bias.zero_()
            heads.lm_heads[i].weight.copy_(heads.lm_heads[0].weight)
    state = {
        k: v
        for k, v in heads.state_dict().items()
        if "bias" not in k and k != "token_map" and not k.startswith(("lm_heads.1", "lm_heads.2"))
    }
    d = tmp_path / "shared"
    d.mkdir()
    save_file(state, str(d / "model.safetensors"))
    (d / "config.json").write_text(
        json.dumps(
            {"num_heads": 3, "num_hidden_layers": 1, "original_lm_head": True, "hidden_size": 64, "vocab_size": 96}
        )
    )
    _same(heads, load_heads(d))


def test_auto_finds_the_targets_heads(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    target = tiny_dir("llama", layers=3)
    save_heads(random_heads(target), tmp_path / "heads" / "medusa-tiny", {"kind": "medusa", "target": str(target)})
    (tmp_path / "heads" / "eagle").mkdir()
    (tmp_path / "heads" / "eagle" / "manifest.json").write_text(json.dumps({"kind": "eagle3", "target": str(target)}))
    assert find_head(str(target), "medusa", "--spec-medusa-head") == tmp_path / "heads" / "medusa-tiny"
    with pytest.raises(specdec.SpecdecError, match="no medusa head"):
        find_head("other", "medusa", "--spec-medusa-head")
    llm = specdec.LLM(
        str(target), spec_type="medusa", dtype="fp32", context=64, progress=False, adaptive=False
    )  # fixed draft lengths: an adaptive one may draft nothing
    r = llm.generate(PROMPTS[0], max_tokens=8)
    assert r.token_ids == llm.generate(PROMPTS[0], max_tokens=8, spec_type="none").token_ids
    assert r.stats.drafted > 0, r.stats  # drafted only: random heads


def test_heads_for_another_target_are_refused(tiny_dir, tmp_path):
    save_heads(random_heads(tiny_dir("qwen3", layers=3)), tmp_path / "head")
    (tmp_path / "head" / "config.json").write_text(
        json.dumps({**json.loads((tmp_path / "head" / "config.json").read_text()), "vocab_size": 200})
    )
    with pytest.raises(specdec.SpecdecError, match="another target"):
        _llm(tiny_dir("llama", layers=3), tmp_path / "head", context=64)


def test_chain_and_best_first_tree():
    assert chain([0.9, 0.5, 0.5], [7, 8, 9], 5, 0.3).tokens == [7, 8]  # 0.9, 0.45, then 0.225 < 0.3
    assert chain([0.1, 0.9], [7, 8], 5, 0.5).tokens == [7]  # the first token always
    probs, ids = [[0.6, 0.25], [0.5, 0.4], [0.9, 0.1]], [[1, 2], [3, 4], [5, 6]]
    d = best_first_tree(probs, ids, 5, 0.0)
    # 1 (.6), 1>3 (.3), 1>3>5 (.27), 2 (.25), 1>4 (.24)
    assert (d.tokens, d.parents) == ([1, 3, 5, 2, 4], [-1, 0, 1, -1, 0])
    cut = best_first_tree(probs, ids, 5, 0.245)
    assert (cut.tokens, cut.parents) == ([1, 3, 5, 2], [-1, 0, 1, -1])
    solo = best_first_tree(probs, ids, 3, 0.5)
    assert (solo.tokens, solo.parents) == ([1], None)


def _train_loss(trainer: MedusaTrainer) -> float:
    """The heads' mean soft loss over the training split."""
    losses = []
    for batch in trainer.plan[0]:
        r = gather(trainer.train_view, batch, trainer.cfg.num_heads, trainer.index, trainer.device)
        with torch.no_grad():
            losses += [float(x) for x in head_losses(trainer.head, trainer.teacher, r, "soft") if x is not None]
    return sum(losses) / len(losses)


@pytest.mark.parametrize("labels", ["soft", "hard"])
def test_training_lowers_the_loss_and_resumes(chat_dir, rules, tmp_path, labels):
    cache = _build(chat_dir, rules, tmp_path / "cache", n=12, max_new_tokens=24)
    cfg = TrainConfig(
        num_heads=2,
        draft_vocab=64,
        labels=labels,
        epochs=3,
        lr=1e-2,
        max_len=32,
        batch_tokens=64,
        autocast="fp32",
        val_share=0.25,
        progress=False,
    )
    trainer = MedusaTrainer(str(chat_dir), cache, tmp_path / "heads", cfg, command="test")
    before = _train_loss(trainer)
    m = trainer.run()
    assert _train_loss(trainer) < 0.8 * before
    assert m["kind"] == "medusa" and m["finished"] and m["training"]["epochs"] == 3
    assert len(m["validation"]["top1"]) == 2 and 1 <= m["validation"]["tau"] <= 3
    heads = load_heads(tmp_path / "heads")
    assert heads.config.draft_vocab_size == 64 and heads.token_map.tolist() == sorted(heads.token_map.tolist())
    with pytest.raises(specdec.SpecdecError, match="--resume"):
        MedusaTrainer(str(chat_dir), cache, tmp_path / "heads", cfg)
    steps = m["training"]["steps"]
    more = MedusaTrainer(str(chat_dir), cache, tmp_path / "heads", dataclasses.replace(cfg, epochs=4), resume=True)
    m2 = more.run()
    assert m2["training"]["steps"] == steps + len(more.plan[3]) and m2["training"]["epochs"] == 4
    llm = _llm(chat_dir, tmp_path / "heads", context=96, draft_max=3)
    r = llm.generate(PROMPTS[0], max_tokens=16)
    assert r.token_ids == llm.generate(PROMPTS[0], max_tokens=16, spec_type="none").token_ids
    assert r.stats.drafted > 0  # drafted only: 3 epochs on 12 conversations seldom get a draft of it accepted
