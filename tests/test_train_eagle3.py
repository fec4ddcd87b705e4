"""EAGLE-3 training: the trainer's unrolled steps equal what the drafter computes, the TTT attention reads exactly
the keys it should, packing, and a whole pipeline on SmolLM2-135M (cache, training, lossless decoding)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import VOCAB

from specdec.api import LLM, load_model
from specdec.drafters.eagle3 import Eagle3Drafter
from specdec.runtime.runner import FeatureSpec, ModelRunner
from specdec.sampling import SamplingParams
from specdec.sequence import Sequence
from specdec.train.eagle3 import Packed, dense_ttt_attention, init_head, ttt_attention, unroll
from specdec.train.loop import Teacher, choose_vocab, coverage, cut, learning_rate, pack, segment_mask

AUX = (1, 2, 3)  # a 4-layer tiny target


def _random_head(model, draft_vocab: int):
    ids = torch.randperm(model.config.vocab_size)[:draft_vocab]
    teacher = Teacher(model, ids)
    head = init_head(model, ids, teacher, None, AUX)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    return head.eval(), teacher


def _one_row(tokens: list[int], aux: torch.Tensor, final: torch.Tensor, steps: int) -> Packed:
    T = len(tokens)
    return Packed(
        torch.tensor(tokens + [0] * steps)[None],
        aux[None],
        final[None],
        torch.zeros(1, T, dtype=torch.long),
        torch.arange(T)[None],
        torch.ones(1, T, dtype=torch.bool),
        torch.ones(1, T, dtype=torch.bool),
    )


@torch.no_grad()
def test_unrolled_steps_equal_the_drafters_logits(tiny_dir):
    """Step 0 row t = the drafter feeding the pair (token[t+1], g[t]) at position t; steps 1 and 2 = the drafter
    drafting on from there with the data tokens as its drafts (fp32)."""
    model = load_model(str(tiny_dir("llama", layers=4)), "none", "fp32", progress=False)[0]
    torch.manual_seed(0)
    head, teacher = _random_head(model, 48)
    runner = ModelRunner(model, 1, 64)
    runner.capture = FeatureSpec(AUX)
    tokens = torch.randint(1, VOCAB, (24,)).tolist()
    runner.prefill(tokens, 0)
    feats = runner.features[0]
    hs = unroll(head, teacher.embed, _one_row(tokens, feats.layers, feats.final, 3), 3)
    trained = [head.lm_head(head.norm(h[0])).float() for h in hs]  # [T, Vd] per step

    drafter = Eagle3Drafter(head, runner)
    seq = Sequence(list(tokens), len(tokens), 0, SamplingParams())
    g = head.fuse(feats.layers)  # [T, H]
    for t in range(len(tokens) - 4):
        logits, h = drafter._step(seq, [tokens[t + 1]], g[t : t + 1], t, None)
        torch.testing.assert_close(logits, trained[0][t], rtol=1e-4, atol=1e-4)
        for j in (1, 2):  # draft step j: (token[t+1+j], h of step j-1) at position t + j
            logits, h = drafter._step(seq, [tokens[t + 1 + j]], h, t + j, j - 1)
            torch.testing.assert_close(logits, trained[j][t], rtol=1e-4, atol=1e-4)


def _dense_reference(q, k0, v0, mask0, kd, vd):
    """The same attention as one SDPA over [step-0 keys | step-1 keys | ...] with a [R, (j+1)R] mask."""
    R = q.shape[2]
    eye = torch.eye(R, dtype=torch.bool).expand(*mask0.shape[:2], R, R)
    mask = torch.cat([mask0, *[eye] * len(kd)], dim=-1)
    out = F.scaled_dot_product_attention(
        q, torch.cat([k0, *kd], 2), torch.cat([v0, *vd], 2), attn_mask=mask, enable_gqa=True
    )
    return out.transpose(1, 2).flatten(2)


@pytest.mark.parametrize("j", [0, 1, 3])
def test_ttt_attention_reads_step0_causal_and_its_own_diagonal(j):
    """Row t at step j reads exactly the step-0 values <= t of its segment and its own values of steps 1..j; the
    fused CPU path and the dense one equal one SDPA over the concatenated keys, outputs and gradients."""
    torch.manual_seed(j)
    B, heads, kv, R, hd = 2, 4, 2, 7, 8
    segment = torch.tensor([[0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, -1, -1]])
    mask0 = segment_mask(segment)
    q, k0, v0 = torch.randn(B, heads, R, hd), torch.randn(B, kv, R, hd), torch.randn(B, kv, R, hd)
    kd, vd = [torch.randn(B, kv, R, hd) for _ in range(j)], [torch.randn(B, kv, R, hd) for _ in range(j)]
    leaves = [t.requires_grad_() for t in (q, k0, v0, *kd, *vd)]
    w = torch.randn(B, R, heads * hd)
    ref = _dense_reference(q, k0, v0, mask0, kd, vd)
    ref_grads = torch.autograd.grad((ref * w).sum(), leaves)
    rep = lambda t: t.repeat_interleave(heads // kv, 1)  # noqa: E731
    for out in (
        ttt_attention(q, k0, v0, mask0, kd, vd),
        dense_ttt_attention(q, rep(k0), rep(v0), mask0, [rep(k) for k in kd], [rep(v) for v in vd]),
    ):
        torch.testing.assert_close(out, ref)
        for got, want in zip(torch.autograd.grad((out * w).sum(), leaves), ref_grads):
            torch.testing.assert_close(got, want)
    out = ttt_attention(q, k0, v0, mask0, kd, vd)  # [B, R, heads * hd]
    for b in range(B):  # which values row t reads (every attended key has a weight > 0)
        for t in range(R):
            grads = torch.autograd.grad(out[b, t].sum(), [v0, *vd], retain_graph=True)
            read0 = grads[0][b].abs().sum((0, 2)) > 0  # [R] step-0 positions row t reads
            want = [s <= t and bool(segment[b, s] == segment[b, t]) for s in range(R)]
            assert read0.tolist() == want, (b, t)
            for g in grads[1:]:
                assert (g[b].abs().sum((0, 2)) > 0).tolist() == [s == t for s in range(R)]
                assert g[1 - b].abs().sum() == 0


def test_vocab_packing_and_schedule():
    counts = torch.tensor([5, 0, 9, 1, 7, 0])
    ids = choose_vocab(counts, 3)
    assert ids.tolist() == [0, 2, 4] and coverage(counts, ids) == pytest.approx(21 / 22)
    assert [(s.start, s.end) for s in cut(0, 10, 4)] == [(0, 4), (4, 8), (8, 10)]
    segs = [s for i, n in enumerate([5, 3, 6, 2]) for s in cut(i, n, 8)]
    batches = pack(segs, 8, 2, None)
    assert [[[s.conv for s in row] for row in b] for b in batches] == [[[0, 1], [2, 3]]]
    shuffled = pack(segs, 8, 2, 1)
    assert sorted(s.conv for b in shuffled for row in b for s in row) == [0, 1, 2, 3]
    assert all(sum(map(len, row)) <= 8 for b in shuffled for row in b)
    assert learning_rate(0.0, 1.0, 0.1) == 0 and learning_rate(0.1, 1.0, 0.1) == pytest.approx(1.0)
    assert learning_rate(0.55, 1.0, 0.1) == pytest.approx(0.5) and learning_rate(1.0, 1.0, 0.1) == pytest.approx(0)


def test_bad_settings_are_one_line_errors(tmp_path, capsys, monkeypatch):
    from specdec.cli import main

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))

    assert main(["train", "eagle3", "-m", "smollm2-135m", "--cache", str(tmp_path), "--ttt", "0"]) == 1
    assert "must be >= 1" in capsys.readouterr().err
    assert main(["train", "eagle3", "-m", "smollm2-135m", "--cache", str(tmp_path)]) == 1
    assert "no manifest.json" in capsys.readouterr().err
    assert main(["train", "medusa", "-m", "smollm2-135m", "--cache", str(tmp_path), "--ttt", "3"]) == 1
    assert "--ttt: not a setting of specdec train medusa" in capsys.readouterr().err
    assert main(["train", "dspark", "-m", "smollm2-135m", "--cache", str(tmp_path), "--ttt", "3"]) == 1
    assert "--ttt: not a setting of specdec train dspark" in capsys.readouterr().err
    assert main(["train", "eagle3", "-m", "smollm2-135m", "--cache", str(tmp_path), "--markov-rank", "8"]) == 1
    assert "--markov-rank: not a setting of specdec train eagle3" in capsys.readouterr().err
    assert main(["train", "dflash", "-m", "smollm2-135m", "--cache", str(tmp_path), "--block-size", "4"]) == 1
    assert "no manifest.json" in capsys.readouterr().err  # dispatched to the block trainer, which reads the cache


@pytest.fixture(scope="module")
def smollm_cache(smollm_dir, tmp_path_factory):
    """A 64-conversation SmolLM2 feature cache (64 new tokens each)."""
    from specdec.train.data import build_cache

    return build_cache(
        "smollm2-135m",
        tmp_path_factory.mktemp("smollm") / "cache",
        64,
        max_new_tokens=64,
        max_prompt_tokens=256,
        batch=8,
        progress=False,
        command="test",
    )


CHAT_PROMPT = "Write a short story about a cat who learns to play the piano."  # a chat turn, like the training data


@pytest.mark.real
def test_pipeline_on_smollm(smollm_cache, tmp_path):
    """Cache -> `specdec train eagle3` -> the head beats an untrained one on validation, and decoding with it is
    plain greedy decoding's text, with drafts accepted."""
    from specdec.cli import main

    cache = smollm_cache
    out = tmp_path / "head"
    args = [
        "train",
        "eagle3",
        "-m",
        "smollm2-135m",
        "--cache",
        str(cache),
        "--out",
        str(out),
        "--draft-vocab",
        "4096",
        "--intermediate",
        "768",
        "--ttt",
        "3",
        "--lr",
        "1e-3",
        "--max-len",
        "512",
        "--batch-tokens",
        "512",
        "--val-share",
        "0.2",
        "--save-dtype",
        "bf16",
        "--no-progress",
    ]
    assert main([*args, "--epochs", "3"]) == 0
    assert main([*args, "--epochs", "6", "--resume"]) == 0  # continues the checkpoint for three more epochs
    m = json.loads((out / "manifest.json").read_text())
    untrained, trained = m["learning_curve"][0][1], m["validation"]["tau"]
    assert m["finished"] and m["kind"] == "eagle3" and m["target"] == "smollm2-135m"
    assert m["training"]["epochs"] == 6 and len(m["learning_curve"]) == 3
    assert m["validation"]["accept"][0] > 0.12 and trained > untrained + 0.1, m["learning_curve"]
    assert m["data"]["rules"]["deny_list_sha256"] and m["draft_vocab"]["coverage"]["validation"] > 0.5
    assert m["data"]["cache_command"] == "test" and m["data"]["cache_hours"] > 0

    llm = LLM(
        "smollm2-135m",
        spec_type="eagle3",
        eagle3_head=str(out),
        dtype="fp32",
        adaptive=False,
        draft_max=3,
        progress=False,
    )
    plain = llm.generate(CHAT_PROMPT, max_tokens=64, chat=True, spec_type="none")
    spec = llm.generate(CHAT_PROMPT, max_tokens=64, chat=True)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.accepted > 0


@pytest.mark.real
@pytest.mark.parametrize(
    "kind,extra",
    [
        ("medusa", ["--num-heads", "2", "--draft-vocab", "4096"]),
        ("mtp", ["--intermediate", "768", "--save-dtype", "int8"]),
    ],
)
def test_medusa_and_mtp_pipelines_on_smollm(smollm_cache, tmp_path, kind, extra):
    """`specdec train medusa|mtp` on the same cache: validation beats the untrained head, and greedy decoding with
    the trained head is plain decoding's text (the MTP block stored in int8)."""
    from specdec.cli import main

    out = tmp_path / kind
    assert (
        main(
            [
                "train",
                kind,
                "-m",
                "smollm2-135m",
                "--cache",
                str(smollm_cache),
                "--out",
                str(out),
                *extra,
                "--epochs",
                "2",
                "--max-len",
                "512",
                "--batch-tokens",
                "512",
                "--val-share",
                "0.2",
                "--no-progress",
            ]
        )
        == 0
    )
    m = json.loads((out / "manifest.json").read_text())
    assert m["finished"] and m["kind"] == kind and m["validation"]["tau"] > m["learning_curve"][0][1] + 0.05
    assert m["head"]["storage"] == ("int8" if "int8" in extra else "fp32")
    llm = LLM(
        "smollm2-135m",
        spec_type=kind,
        **{f"{kind}_head": str(out)},
        dtype="fp32",
        adaptive=False,
        draft_max=2,
        progress=False,
    )
    plain = llm.generate(CHAT_PROMPT, max_tokens=48, chat=True, spec_type="none")
    spec = llm.generate(CHAT_PROMPT, max_tokens=48, chat=True)
    # accepted: Medusa's heads; the MTP block of two short epochs gets none of this answer accepted
    assert spec.token_ids == plain.token_ids and spec.stats.drafted > 0, spec.stats
    assert spec.stats.accepted > 0 or kind == "mtp", spec.stats
