"""EAGLE-3 heads: lossless with any head, as chains and as EAGLE-2 dynamic trees (greedy and seeded identical in fp32,
sampling distributed as plain through the engine), the tree forward equal to the head run as a chain along each
node's path, the head's cache in step with the committed tokens, and the HF / SpecForge and speculators layouts
load to the same head."""

from __future__ import annotations

import itertools
import json
from functools import partial

import pytest
import torch
from conftest import head_llm, make_tiny, randomize
from safetensors.torch import load_file, save_file
from test_lossless_sampling import fit, tv_bound

import specdec
from specdec.drafters.eagle3 import Eagle3Drafter
from specdec.drafters.tree import ROOT, DynamicTree
from specdec.models.eagle3 import Eagle3Config, Eagle3Head, load_head, save_head
from specdec.models.loader import load_checkpoint
from specdec.sampling import SamplingParams, probs_from_logits

PROMPTS = ["t5 t9 t12 t5 t9 t12 t5 t9", "t33 t2 t71", "t8 " * 20 + "t4"]


def random_head(target_dir, seed: int = 0, scale: float = 0.3, skip: int = 5) -> Eagle3Head:
    """A random head for the checkpoint in `target_dir`, its draft vocabulary all but the first `skip` ids."""
    model, _ = load_checkpoint(target_dir, torch.float32)
    c = model.config
    head = Eagle3Head(Eagle3Config.for_target(c, c.vocab_size - skip, aux_layers=(0, 1, c.num_layers - 1)))
    randomize(head, seed, scale, matrices_only=True)
    head.set_vocab(torch.arange(skip, c.vocab_size))
    return head


_llm = partial(head_llm, "eagle3")


def _trees(stats) -> bool:
    """Some step drafted more nodes than its depth: a tree."""
    return stats.drafted > sum(stats.drafted_at)


@pytest.mark.parametrize("family,topk", [("llama", 1), ("qwen2", 1), ("qwen3", 1), ("llama", 3), ("qwen3", 2)])
def test_any_head_is_lossless_greedy(tiny_dir, tmp_path, family, topk):
    target = tiny_dir(family, layers=3)
    save_head(random_head(target), tmp_path / "head", {"kind": "eagle3", "target": "tiny"})
    llm = _llm(target, tmp_path / "head", context=96, draft_max=4 if topk == 1 else 6, eagle3_topk=topk)
    for prompt in PROMPTS:
        plain = llm.generate(prompt, max_tokens=40, spec_type="none")
        r = llm.generate(prompt, max_tokens=40)
        # drafted only: a random head is right by chance alone (the next test gets its trees accepted)
        assert r.token_ids == plain.token_ids and r.stats.drafted > 0, prompt
        assert _trees(r.stats) == (topk > 1), prompt


def _small(tmp_path, family: str = "qwen3", **kw) -> specdec.LLM:
    """A target with a vocabulary of 12 and a random head over 10 of it, drafting 3-wide trees of up to 7 nodes:
    the tree often holds the target's token."""
    target = make_tiny(tmp_path / "t", family, seed=2, layers=3, vocab=12)
    save_head(random_head(target, seed=4, scale=1.0, skip=2), tmp_path / "head", {"kind": "eagle3", "target": "t"})
    return _llm(target, tmp_path / "head", context=96, draft_max=8, eagle3_topk=3, eagle3_nodes=7, **kw)


def test_trees_accept_and_stay_lossless_greedy_and_seeded(tmp_path):
    """Accepted paths several nodes deep, token-identical to plain decoding, greedy and seeded."""
    llm, prompt, deep = _small(tmp_path), [3, 5, 7, 3, 5, 7, 3], 0
    for kw in (dict(), dict(temperature=0.9, top_p=0.95, seed=0), dict(temperature=1.0, seed=5)):
        plain = llm.generate(prompt, max_tokens=48, spec_type="none", **kw)
        r = llm.generate(prompt, max_tokens=48, **kw)
        assert r.token_ids == plain.token_ids and _trees(r.stats), kw
        assert len(r.stats.drafted_at) <= 7 and r.stats.accepted > 0, kw
        deep += sum(r.stats.accepted_at[1:])
    assert deep > 0  # accepted below the first level


def test_dynamic_tree_keeps_the_best_paths():
    """Candidates by path probability: width and the budget bound the expansions, the draft is the budget best."""
    tree = DynamicTree(budget=4)
    top = tree.add_children(ROOT, [10, 11, 12], [0.6, 0.3, 0.1])  # paths 0.6 0.3 0.1
    assert tree.to_expand(top, width=2) == [0, 1] and tree.rows == {0: 0, 1: 1}
    layer = tree.add_children(0, [20, 21], [0.9, 0.1]) + tree.add_children(1, [22], [0.5])  # 0.54 0.06 0.15
    assert tree.to_expand(layer, width=2) == [3]  # 0.15 ties the 4th best path; one expansion left of budget - 1
    assert tree.lineage(3) == [0, 3] and tree.to_expand([], width=2) == []
    assert tree.draft() == ([10, 11, 20, 22], [ROOT, ROOT, 0, 1])
    cut = DynamicTree(budget=4, min_path_prob=0.2)  # the first candidate always, the rest by min_path_prob
    assert cut.add_children(ROOT, [10, 11, 12], [0.1, 0.05, 0.3]) == [0, 1] and cut.tokens == [10, 12]
    assert cut.to_expand([0, 1], width=3) == [1]
    one = DynamicTree(budget=3)
    one.add_children(one.add_children(ROOT, [4], [0.5])[0], [6, 7], [0.9, 0.05])
    assert one.draft() == ([4, 6, 7], [ROOT, 0, 0]) and DynamicTree(budget=2).draft() == ([], None)
    one.budget = 2
    assert one.draft() == ([4, 6], None)  # a single path is a chain


def test_tree_forward_equals_the_head_as_a_chain(tiny_dir, tmp_path, monkeypatch):
    """Each tree node's logits (one forward per depth, tree mask over the head's own cache) equal running the head
    one token at a time along that node's path from the same committed state (fp32)."""
    target = tiny_dir("llama", layers=3)
    save_head(random_head(target), tmp_path / "head", {"kind": "eagle3", "target": "tiny"})
    llm = _llm(target, tmp_path / "head", context=96, draft_max=12, eagle3_topk=3)
    d, eng = llm.drafter, llm.engine
    seq = eng.new_sequence(llm.encode(PROMPTS[0]), SamplingParams(max_tokens=8), drafter=d)
    eng.prefill(seq)
    roots, feeds = [], []
    tree_of, feed = d._tree, d._feed
    monkeypatch.setattr(d, "_tree", lambda seq, logits, h, *a: roots.append((logits, h)) or tree_of(seq, logits, h, *a))
    monkeypatch.setattr(
        d,
        "_feed",
        lambda seq, tree, chosen, g: feeds.append((tree, chosen, feed(seq, tree, chosen, g))) or feeds[-1][2],
    )
    draft = d.propose(seq, 12)
    tree = feeds[0][0]
    assert len(draft.tokens) == 12 and draft.parents is not None and len(feeds) >= 3  # depths 1, 2, 3, ...
    assert max(len(chosen) for _, chosen, _ in feeds) == 3
    (root_logits, root_h), base = roots[0], d.fed[seq.slot]
    best = root_logits.topk(3).indices
    assert tree.tokens[:3] == (best + d.head.d2t[best]).tolist()
    for _, chosen, (logits, _) in feeds:
        for c, row in zip(chosen, logits):
            h = root_h[None]
            for depth, node in enumerate(tree.lineage(c)):
                chain_logits, h = d._step(seq, [tree.tokens[node]], h, base + depth, depth + 1)
            torch.testing.assert_close(row, chain_logits, rtol=1e-5, atol=1e-5, msg=f"node {c}")


def test_head_cache_follows_the_committed_tokens(tmp_path):
    """After every tree step the head has fed exactly the pairs of the tokens committed before it; its cache rows
    then equal those of a drafter fed the whole committed sequence at once (no tree node left in them)."""
    llm = _small(tmp_path, "llama", parallel=2)
    d, eng = llm.drafter, llm.engine
    seq = eng.new_sequence([3, 5, 7, 3, 5, 7, 3], SamplingParams(max_tokens=40), slot=0, drafter=d)
    eng.prefill(seq)
    accepted = 0
    while seq.finish_reason is None:
        before = len(seq.tokens)
        if eng.step([seq]).drafted:  # (no draft once max_tokens leaves no room)
            assert d.fed[0] == before - 1
        assert d.seen[0] == len(seq.tokens) - 1
        accepted += len(seq.tokens) - before - 1
    assert accepted > 0 and _trees(seq.stats)
    d.propose(seq, 1)
    n = d.fed[0]
    assert n == len(seq.tokens) - 1
    fresh = Eagle3Drafter(d.head, llm.runner)
    other = eng.new_sequence(list(seq.tokens), SamplingParams(max_tokens=2), slot=1, drafter=fresh)
    eng.prefill(other)
    fresh.propose(other, 1)
    for mine, want in ((d.cache.k[0], fresh.cache.k[0]), (d.cache.v[0], fresh.cache.v[0])):
        torch.testing.assert_close(mine[0, :, :n], want[1, :, :n], rtol=1e-4, atol=1e-4)


def test_layouts_load_to_the_same_head(tiny_dir, tmp_path):
    target = tiny_dir("llama", layers=3)
    head = random_head(target)
    save_head(head, tmp_path / "hf")
    state = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert {
        "fc.weight",
        "midlayer.self_attn.q_proj.weight",
        "midlayer.mlp.gate_proj.weight",
        "midlayer.hidden_norm.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
    } <= set(state)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == head.config.draft_vocab_size and cfg["num_hidden_layers"] == 1
    spec_dir = tmp_path / "speculators"  # speculators: layers.0.*, draft_id_to_target_id, no t2d
    spec_dir.mkdir()
    renamed = {
        k.replace("midlayer.", "layers.0.").replace("d2t", "draft_id_to_target_id"): v
        for k, v in state.items()
        if k != "t2d"
    }
    save_file(renamed, str(spec_dir / "model.safetensors"))
    (spec_dir / "config.json").write_text(
        json.dumps(
            {
                "speculators_model_type": "eagle3",
                "transformer_layer_config": {k: v for k, v in cfg.items() if k != "draft_vocab_size"},
                "draft_vocab_size": cfg["draft_vocab_size"],
            }
        )
    )
    for path in (tmp_path / "hf", spec_dir):
        loaded = load_head(path)
        for k, v in head.state_dict().items():
            torch.testing.assert_close(loaded.state_dict()[k], v, rtol=0, atol=0, msg=f"{path.name}: {k}")


V, BATCH, MAX_TOKENS = 8, 500, 4
HEAD_RUNS = 8_000  # runs per head family: the engine's rules are tested at 20,000 in tests/test_lossless_sampling.py


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


def engine_fit(target, runs: int = HEAD_RUNS, **spec) -> tuple[int, float, float, float]:
    """`runs` sampled runs (T 1) of the first three tokens through the engine with the drafter `spec` (LLM keywords)
    against the exact joint of plain sampling -> (tokens drafted, chi-square p-value, total variation, its bound
    `tv_bound`)."""
    llm = specdec.LLM(
        str(target), dtype="fp32", context=32, parallel=BATCH, adaptive=False, draft_max=3, progress=False, **spec
    )
    llm.engine.stop_ids = set()
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    want = _exact_joint(llm, prompt, SamplingParams(temperature=1.0))
    eng, samples, drafted = llm.engine, [], 0
    for b0 in range(0, runs, BATCH):
        seqs = []
        for j in range(BATCH):
            seq = eng.new_sequence(
                prompt, SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS), slot=j, drafter=llm.drafter
            )
            seq.generator = torch.Generator().manual_seed(b0 + j)
            seqs.append(seq)
        eng.prefill_together(seqs)
        while live := [s for s in seqs if s.finish_reason is None]:
            eng.step(live)
        for s in seqs:
            eng.finish(s)
            samples.append(tuple(s.output_ids[:3]))
            drafted += s.stats.drafted
    return drafted, *fit(samples, want), tv_bound(want, len(samples))


@pytest.mark.parametrize("topk", [1, 2])
def test_sampling_through_the_engine_matches_plain(tmp_path, topk):
    """Rejection sampling with an EAGLE-3 head samples the target's distribution: chains drawn from q (zero outside
    its draft vocabulary), trees of the head's best tokens verified one-hot. Runs through the engine (8,000 for
    chains; 4,000 for trees, which verify one forward per sequence), chi-square and total variation against the
    exact joint."""
    target = make_tiny(tmp_path / "t", "llama", seed=3, layers=3, vocab=V)
    head = random_head(target, seed=1, scale=1.0, skip=2)
    save_head(head, tmp_path / "head", {"kind": "eagle3", "target": "tiny"})
    one = _llm(target, tmp_path / "head", context=32, draft_max=3, eagle3_topk=topk)
    assert _trees(one.generate([1, 2, 3], max_tokens=16, temperature=1.0).stats) == (topk > 1)
    runs = HEAD_RUNS if topk == 1 else 4000
    drafted, p_value, tv, bound = engine_fit(
        target, runs, spec_type="eagle3", eagle3_head=str(tmp_path / "head"), eagle3_topk=topk
    )
    assert drafted > runs and p_value > 1e-3 and tv < bound, (drafted, p_value, tv)


@pytest.mark.real
@pytest.mark.parametrize("topk", [1, 4])
def test_smollm_any_head_is_lossless(smollm_dir, tmp_path, topk):
    save_head(random_head(smollm_dir, scale=0.02, skip=0), tmp_path / "head", {"kind": "eagle3", "target": "x"})
    llm = _llm(smollm_dir, tmp_path / "head", context=256, draft_max=3 if topk == 1 else 8, eagle3_topk=topk)
    prompt = "def fib(n):\n    if n < 2:\n        return n\n"
    plain = llm.generate(prompt, max_tokens=24, spec_type="none")
    r = llm.generate(prompt, max_tokens=24)
    # drafted only: a random head gets none accepted (the shipped head: tests/test_heads.py)
    assert r.token_ids == plain.token_ids and r.stats.drafted > 0 and _trees(r.stats) == (topk > 1)


def test_draft_vocab_must_be_distinct(tiny_dir):
    head = random_head(tiny_dir("llama", layers=3))
    with pytest.raises(specdec.SpecdecError, match="distinct"):
        head.set_vocab(torch.tensor(list(itertools.repeat(7, head.config.draft_vocab_size))))
