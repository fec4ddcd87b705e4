"""On a CUDA device (skipped without one): `-ngl`/`-ngld` place layers on the GPU, and decoding stays lossless
there for every spec type, head and block drafter; the head trainers run with `device="cuda"`.
Where a GPU is lent: `python -m pytest tests/test_cuda.py` (scripts/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch
from conftest import untrained_spec_types
from test_bf16 import NEAR_TIE
from test_greedy_equality import PROMPTS_TINY, _assert_drafted_and_accepted, _count
from test_quant_target import tiny_gguf  # noqa: F401 (fixture)
from test_train_data import _build, chat_dir, rules  # noqa: F401 (fixtures)

import specdec
from specdec.models.loader import load_checkpoint
from specdec.runtime.placement import place_layers
from specdec.runtime.runner import ModelRunner
from specdec.stats import first_divergence

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ALL = 999
SPECS = [s for s in untrained_spec_types() if s != "none"] + ["ngram-mod,draft", "suffix-tree,draft"]


@pytest.fixture(autouse=True)
def _exact_fp32():
    """fp32 matmuls in fp32 (no TF32), as on the CPU."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False


@pytest.mark.parametrize("n", [1, 2, 3, ALL])
def test_placed_model_matches_the_cpu(tiny_dir, n):
    d = tiny_dir("qwen2", layers=3)
    cpu, _ = load_checkpoint(d, torch.float32)
    gpu, _ = load_checkpoint(d, torch.float32)
    place = place_layers(3, n)
    gpu.place(place.module_devices())
    assert [t.type for t in gpu.layer_devices] == ["cuda" if x == "gpu" else "cpu" for x in place.layers]
    assert gpu.device.type == "cuda" and gpu.split == (n < 3)
    ra, rb = ModelRunner(cpu, 2, 32), ModelRunner(gpu, 2, 32)
    chunks, starts, slots = [[5, 9, 12, 5], [33, 2]], [0, 0], [0, 1]
    for a, b in zip(ra.forward(chunks, starts, slots), rb.forward(chunks, starts, slots)):
        torch.testing.assert_close(a, b.cpu(), rtol=1e-4, atol=1e-4)
    tree_a = ra.verify_tree(0, 4, [7, 8, 9, 10], [-1, 0, -1])
    tree_b = rb.verify_tree(0, 4, [7, 8, 9, 10], [-1, 0, -1])
    torch.testing.assert_close(tree_a, tree_b.cpu(), rtol=1e-4, atol=1e-4)


def _llm(target, draft, ngl: int, ngld: int, **kw) -> specdec.LLM:
    llm = specdec.LLM(
        str(target),
        draft=str(draft),
        spec_type="none",
        context=64,
        progress=False,
        adaptive=False,
        draft_max=4,
        n_gpu_layers=ngl,
        n_gpu_layers_draft=ngld,
        **({"dtype": "fp32"} | kw),
    )
    llm.engine.stop_ids = set()
    return llm


@pytest.mark.parametrize("ngl,ngld,own_draft", [(ALL, ALL, False), (ALL, ALL, True), (1, 0, False), (0, ALL, False)])
def test_every_spec_type_is_lossless_on_the_gpu(tiny_dir, ngl, ngld, own_draft):
    """Greedy fp32: every spec type gives plain decoding's tokens, with the target and the draft model wholly on
    the GPU, split across GPU and CPU, or only the draft on the GPU; seeded sampling too (the same text for every
    drafter)."""
    target = tiny_dir("llama")
    llm = _llm(target, target if own_draft else tiny_dir("llama", seed=1, layers=1), ngl, ngld)
    assert (llm.runner.model.device.type == "cuda") == bool(ngl)
    stats = {}  # spec (greedy) or "spec seeded" -> [drafted, accepted]
    for prompt in PROMPTS_TINY:
        base = llm.generate(prompt, max_tokens=40, spec_type="none")
        seeded = llm.generate(prompt, max_tokens=24, temperature=0.8, seed=3, spec_type="none")
        for spec in SPECS:
            r = llm.generate(prompt, max_tokens=40, spec_type=spec)
            assert r.token_ids == base.token_ids, (prompt, spec)
            _count(stats, spec, r)
            if spec in ("draft", "suffix-tree", "suffix-tree,draft"):
                s = llm.generate(prompt, max_tokens=24, temperature=0.8, seed=3, spec_type=spec)
                assert s.token_ids == seeded.token_ids, (prompt, spec)
                _count(stats, f"{spec} seeded", s)
        assert not own_draft or llm.generate(prompt, max_tokens=40, spec_type="draft").stats.accepted > 0
    # drafted only for the random draft model (seed 1): right by chance alone
    _assert_drafted_and_accepted(stats, () if own_draft else ("draft", "draft seeded"))


def test_bf16_on_the_gpu_diverges_only_at_near_ties(tiny_dir):
    target = tiny_dir("qwen3", layers=3)
    llm = _llm(target, target, ALL, ALL, dtype="bf16")
    assert llm.runner.model.model.embed_tokens.weight.dtype == torch.bfloat16
    for prompt in PROMPTS_TINY:
        base = llm.generate(prompt, max_tokens=32, spec_type="none")
        for spec in ("draft", "suffix-tree,draft", "ngram-simple"):
            div = first_divergence(
                base.token_ids, base.top2_gaps, llm.generate(prompt, max_tokens=32, spec_type=spec).token_ids
            )
            assert div is None or div["top2_gap"] < NEAR_TIE, (prompt, spec, div)


def _heads(target, tmp_path) -> dict[str, dict]:
    """Random heads and block drafters for `target`, saved in their layouts: spec type -> LLM keywords."""
    from test_dflash import drafter_dir
    from test_eagle3 import random_head as eagle3_head
    from test_medusa import random_heads
    from test_mtp import random_head as mtp_head

    from specdec.models.config import ModelConfig
    from specdec.models.eagle3 import save_head as save_eagle3
    from specdec.models.medusa import save_heads
    from specdec.models.mtp import MtpConfig
    from specdec.models.mtp import save_head as save_mtp

    save_eagle3(eagle3_head(target), tmp_path / "eagle3", {"kind": "eagle3", "target": "t"})
    save_heads(random_heads(target), tmp_path / "medusa", {"kind": "medusa", "target": "t"})
    cfg = MtpConfig.for_target(ModelConfig.from_file(target / "config.json"))
    save_mtp(mtp_head(cfg, scale=0.05), tmp_path / "mtp", str(target), {"kind": "mtp", "target": "t"})
    return {
        "eagle3": {"eagle3_head": str(tmp_path / "eagle3")},
        "eagle3-tree": {"eagle3_head": str(tmp_path / "eagle3"), "eagle3_topk": 3},
        "medusa": {"medusa_head": str(tmp_path / "medusa")},
        "mtp": {"mtp_head": str(tmp_path / "mtp")},
        "dflash": {"dflash_head": str(drafter_dir(tmp_path, target, False))},
        "dspark": {"dspark_head": str(drafter_dir(tmp_path, target, True)), "dspark_threshold": 0.5},
    }


@pytest.mark.parametrize("ngl", [ALL, 2])
def test_heads_and_block_drafters_are_lossless_on_the_gpu(tiny_dir, tmp_path, ngl):
    target = tiny_dir("qwen3", seed=2, layers=4)
    for name, kw in _heads(target, tmp_path).items():
        kind = name.removesuffix("-tree")
        llm = specdec.LLM(
            str(target),
            spec_type=kind,
            dtype="fp32",
            adaptive=False,
            progress=False,
            context=96,
            draft_max=4,
            n_gpu_layers=ngl,
            **kw,
        )
        llm.engine.stop_ids = set()
        for prompt in PROMPTS_TINY[:3]:
            r = llm.generate(prompt, max_tokens=24)
            assert r.token_ids == llm.generate(prompt, max_tokens=24, spec_type="none").token_ids, (name, prompt)
            assert r.stats.drafted > 0, name  # drafted only: random heads and block drafters


def _trainers() -> dict:
    from specdec.train import dflash, eagle3, medusa, mtp

    small = dict(epochs=3, lr=1e-2, max_len=32, batch_tokens=64, val_share=0.25, progress=False, device="cuda")
    return {
        "eagle3": (eagle3.Eagle3Trainer, eagle3.TrainConfig(draft_vocab=64, ttt=3, **small)),
        "medusa": (medusa.MedusaTrainer, medusa.TrainConfig(num_heads=2, draft_vocab=64, **small)),
        "mtp": (mtp.MtpTrainer, mtp.TrainConfig(**small)),
        "dflash": (dflash.DFlashTrainer, dflash.TrainConfig(anchors=8, block_size=4, **small)),
        "dspark": (dflash.DSparkTrainer, dflash.TrainConfig(anchors=8, block_size=4, markov_rank=8, **small)),
    }


@pytest.mark.parametrize("kind", ["eagle3", "medusa", "mtp", "dflash", "dspark"])
@pytest.mark.parametrize("autocast", ["fp32", "auto"])
def test_trainers_learn_on_the_gpu(chat_dir, rules, tmp_path, kind, autocast):
    """`specdec train ... --device cuda` (auto: bf16 there): the loss falls, the manifest says where it ran, and the
    head drafts losslessly for the target on the GPU."""
    import dataclasses

    cache = _build(chat_dir, rules, tmp_path / "cache", n=12, max_new_tokens=24)
    trainer_type, cfg = _trainers()[kind]
    trainer = trainer_type(
        str(chat_dir), cache, tmp_path / kind, dataclasses.replace(cfg, autocast=autocast), command="test"
    )
    assert next(trainer.head.parameters()).device.type == "cuda"

    def train_loss() -> float:
        with torch.no_grad(), trainer.autocast():
            return sum(trainer.loss(b).value.item() for b in trainer.plan[0]) / len(trainer.plan[0])

    before = train_loss()
    m = trainer.run()
    assert train_loss() < 0.8 * before and m["finished"] and m["training"]["device"] == "cuda"
    llm = specdec.LLM(
        str(chat_dir),
        spec_type=kind,
        dtype="fp32",
        adaptive=False,
        progress=False,
        context=96,
        draft_max=3,
        n_gpu_layers=ALL,
        **{f"{kind}_head": str(tmp_path / kind)},
    )
    llm.engine.stop_ids = set()
    r = llm.generate(PROMPTS_TINY[0], max_tokens=16)
    assert r.token_ids == llm.generate(PROMPTS_TINY[0], max_tokens=16, spec_type="none").token_ids
    assert r.stats.drafted > 0, kind  # drafted only: three epochs on 12 conversations seldom get one accepted


@pytest.mark.parametrize("ngl", [ALL, 1])
def test_gguf_target_on_the_gpu(tiny_gguf, ngl):
    """A GGUF target's GPU layers run dense (dequantized once), its CPU layers keep the file's blocks; speculation
    stays lossless across the split."""
    from test_quant_target import PROMPT
    from torch import nn

    from specdec.runtime.gguf_linear import GGUFConcatLinear

    llm = specdec.LLM(
        str(tiny_gguf), quant="gguf", dtype="fp32", draft_max=4, adaptive=False, progress=False, n_gpu_layers=ngl
    )
    layers = llm.runner.model.model.layers
    assert isinstance(layers[0].self_attn.qkv_proj, nn.Linear) and layers[0].self_attn.qkv_proj.weight.is_cuda
    assert isinstance(layers[1].self_attn.qkv_proj, nn.Linear if ngl == ALL else GGUFConcatLinear)
    plain = llm.generate(PROMPT, max_tokens=24, spec_type="none")
    for spec in ("ngram-simple", "suffix"):
        r = llm.generate(PROMPT, max_tokens=24, spec_type=spec)
        assert r.token_ids == plain.token_ids and r.stats.drafted > 0 and r.stats.accepted > 0, spec


def test_ngl_notice_names_the_gpu():
    from specdec.runtime.placement import offload_notice

    assert "on the GPU" in offload_notice(ALL, 0)
