"""EAGLE-3 heads: lossless with any head (greedy identical in fp32, sampling distributed as plain through the engine),
and the HF / SpecForge and speculators layouts load to the same head."""
from __future__ import annotations

import itertools
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import specdec
from conftest import make_tiny
from specdec.models.eagle3 import Eagle3Config, Eagle3Head, load_head, save_head
from specdec.models.loader import load_checkpoint
from specdec.sampling import SamplingParams, probs_from_logits
from test_lossless_sampling import TV_BOUND, fit

PROMPTS = ["t5 t9 t12 t5 t9 t12 t5 t9", "t33 t2 t71", "t8 " * 20 + "t4"]


def random_head(target_dir, seed: int = 0, scale: float = 0.3, skip: int = 5) -> Eagle3Head:
    """A random head for the checkpoint in `target_dir`, its draft vocabulary all but the first `skip` ids."""
    model, _ = load_checkpoint(target_dir, torch.float32)
    c = model.config
    head = Eagle3Head(Eagle3Config.for_target(c, c.vocab_size - skip, aux_layers=(0, 1, c.num_layers - 1)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    head.set_vocab(torch.arange(skip, c.vocab_size))
    return head


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_any_head_is_lossless_greedy(tiny_dir, tmp_path, family):
    target = tiny_dir(family, layers=3)
    save_head(random_head(target), tmp_path / "head", {"kind": "eagle3", "target": "tiny"})
    llm = specdec.LLM(str(target), spec_type="eagle3", eagle3_head=str(tmp_path / "head"), dtype="fp32", context=96,
                      adaptive=False, draft_max=4, progress=False)
    llm.engine.stop_ids = set()
    for prompt in PROMPTS:
        plain = llm.generate(prompt, max_tokens=40, spec_type="none")
        r = llm.generate(prompt, max_tokens=40)
        assert r.token_ids == plain.token_ids and r.stats.drafted > 0, prompt


def test_layouts_load_to_the_same_head(tiny_dir, tmp_path):
    target = tiny_dir("llama", layers=3)
    head = random_head(target)
    save_head(head, tmp_path / "hf")
    state = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.hidden_norm.weight",
            "norm.weight", "lm_head.weight", "d2t", "t2d"} <= set(state)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == head.config.draft_vocab_size and cfg["num_hidden_layers"] == 1
    spec_dir = tmp_path / "speculators"  # speculators: layers.0.*, draft_id_to_target_id, no t2d
    spec_dir.mkdir()
    renamed = {k.replace("midlayer.", "layers.0.").replace("d2t", "draft_id_to_target_id"): v
               for k, v in state.items() if k != "t2d"}
    save_file(renamed, str(spec_dir / "model.safetensors"))
    (spec_dir / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3", "transformer_layer_config":
                                                       {k: v for k, v in cfg.items() if k != "draft_vocab_size"},
                                                       "draft_vocab_size": cfg["draft_vocab_size"]}))
    for path in (tmp_path / "hf", spec_dir):
        loaded = load_head(path)
        for k, v in head.state_dict().items():
            torch.testing.assert_close(loaded.state_dict()[k], v, rtol=0, atol=0, msg=f"{path.name}: {k}")


V, RUNS, BATCH, MAX_TOKENS = 8, 20_000, 500, 4


def _exact_joint(llm, prompt: list[int], params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(first three output tokens) under plain sampling, by enumerating every prefix."""
    def dist(prefix: list[int]) -> torch.Tensor:
        return probs_from_logits(llm.runner.prefill(prompt + prefix, slot=0)[None], params)[0]
    out = {}
    for x in range(V):
        for y in range(V):
            p_xy = float(dist([])[x] * dist([x])[y])
            pz = dist([x, y])
            for z in range(V):
                out[(x, y, z)] = p_xy * float(pz[z])
    return out


def engine_fit(target, **spec) -> tuple[int, float, float, float]:
    """RUNS sampled runs (T 1) of the first three tokens through the engine with the drafter `spec` (LLM keywords)
    against the exact joint of plain sampling -> (tokens drafted, chi-square p-value, total variation, its bound)."""
    llm = specdec.LLM(str(target), dtype="fp32", context=32, parallel=BATCH, adaptive=False, draft_max=3,
                      progress=False, **spec)
    llm.engine.stop_ids = set()
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    want = _exact_joint(llm, prompt, SamplingParams(temperature=1.0))
    eng, samples, drafted = llm.engine, [], 0
    for b0 in range(0, RUNS, BATCH):
        seqs = []
        for j in range(BATCH):
            seq = eng.new_sequence(prompt, SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS), slot=j,
                                   drafter=llm.drafter)
            seq.generator = torch.Generator().manual_seed(b0 + j)
            eng.prefill(seq)
            seqs.append(seq)
        while live := [s for s in seqs if s.finish_reason is None]:
            eng.step(live)
        for s in seqs:
            eng.finish(s)
            samples.append(tuple(s.output_ids[:3]))
            drafted += s.stats.drafted
    return drafted, *fit(samples, want), TV_BOUND


def test_sampling_through_the_engine_matches_plain(tmp_path):
    """Rejection sampling with an EAGLE-3 head (q zero outside its draft vocabulary) samples the target's
    distribution: 20,000 runs through the engine, chi-square and total variation against the exact joint."""
    target = make_tiny(tmp_path / "t", "llama", seed=3, layers=3, vocab=V)
    head = random_head(target, seed=1, scale=1.0, skip=2)
    save_head(head, tmp_path / "head", {"kind": "eagle3", "target": "tiny"})
    drafted, p_value, tv, bound = engine_fit(target, spec_type="eagle3", eagle3_head=str(tmp_path / "head"))
    assert drafted > RUNS and p_value > 1e-3 and tv < bound, (drafted, p_value, tv)


@pytest.mark.real
def test_smollm_any_head_is_lossless(smollm_dir, tmp_path):
    save_head(random_head(smollm_dir, scale=0.02, skip=0), tmp_path / "head", {"kind": "eagle3", "target": "x"})
    llm = specdec.LLM(str(smollm_dir), spec_type="eagle3", eagle3_head=str(tmp_path / "head"), dtype="fp32",
                      context=256, adaptive=False, draft_max=3, progress=False)
    prompt = "def fib(n):\n    if n < 2:\n        return n\n"
    plain = llm.generate(prompt, max_tokens=24, spec_type="none")
    r = llm.generate(prompt, max_tokens=24)
    assert r.token_ids == plain.token_ids and r.stats.drafted > 0


def test_draft_vocab_must_be_distinct(tiny_dir):
    head = random_head(tiny_dir("llama", layers=3))
    with pytest.raises(specdec.SpecdecError, match="distinct"):
        head.set_vocab(torch.tensor(list(itertools.repeat(7, head.config.draft_vocab_size))))
