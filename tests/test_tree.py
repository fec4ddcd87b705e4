"""Token trees: tree-masked verify equals per-path chains, KV compaction, losslessness."""

import pytest
import torch

import specdec
from specdec.models.loader import load_checkpoint
from specdec.runtime.runner import ModelRunner
from specdec.sampling import SamplingParams, probs_from_logits, sample
from specdec.verify import verify_tree_greedy, verify_tree_sampling

PREFIX = [5, 9, 12, 5, 9, 12, 7]
TREE = [40, 41, 42, 43, 44, 45]  # node tokens
PARENTS = [-1, -1, 0, 0, 2, 1]  # two roots (40, 41); 40 -> 42, 43; 42 -> 44; 41 -> 45


def _runner(tiny_dir):
    model, _ = load_checkpoint(tiny_dir("qwen3"), torch.float32)
    return ModelRunner(model, num_slots=1, context=64)


def _path(i):
    out = []
    while i >= 0:
        out.append(TREE[i])
        i = PARENTS[i]
    return out[::-1]


def test_tree_logits_equal_each_path_as_a_chain(tiny_dir):
    r = _runner(tiny_dir)
    r.prefill(PREFIX[:-1], 0)
    tree_logits = r.verify_tree(0, len(PREFIX) - 1, [PREFIX[-1]] + TREE, PARENTS)  # [N+1, V]
    for i in range(len(TREE)):
        chain = _runner(tiny_dir).forward([PREFIX + _path(i)], [0], [0])[0]
        assert torch.allclose(tree_logits[i + 1], chain[-1], atol=1e-5), i
    assert torch.allclose(tree_logits[0], _runner(tiny_dir).forward([PREFIX], [0], [0])[0][-1], atol=1e-5)


def test_keep_path_compacts_the_cache(tiny_dir):
    r = _runner(tiny_dir)
    r.prefill(PREFIX[:-1], 0)
    start = len(PREFIX) - 1
    r.verify_tree(0, start, [PREFIX[-1]] + TREE, PARENTS)
    path = [0, 2, 4]  # 40 -> 42 -> 44
    r.keep_path(0, start, path)
    nxt = r.forward([[3]], [start + 1 + len(path)], [0])[0][-1]
    fresh = _runner(tiny_dir).forward([PREFIX + [40, 42, 44, 3]], [0], [0])[0][-1]
    assert torch.allclose(nxt, fresh, atol=1e-5)


def test_tree_greedy_follows_target_argmax():
    V = 50
    logits = torch.zeros(len(TREE) + 1, V)
    want = {0: 40, 1: 43, 4: 7}  # row -> argmax: root picks 40, node0 picks 43 (sibling of 42), node 3 -> 7
    for row, tok in want.items():
        logits[row, tok] = 1.0
    out, path = verify_tree_greedy(TREE, PARENTS, logits)
    assert path == [0, 3] and out[:2] == [40, 43]


def test_tiny_greedy_equality_with_trees(tiny_dir):
    target, draft = tiny_dir("llama"), tiny_dir("llama", seed=1, layers=1)
    llm = specdec.LLM(
        str(target),
        draft=str(draft),
        dtype="fp32",
        context=64,
        draft_branch_p=0.9,
        progress=False,
        adaptive=False,
        draft_max=4,
    )  # fixed draft lengths: an adaptive one may draft nothing
    llm.engine.stop_ids = set()
    branched = drafted = 0
    for prompt in ("t5 t9 t12 t5 t9", "t33 t2 t71", "t60"):
        base = llm.generate(prompt, max_tokens=40, spec_type="none")
        r = llm.generate(prompt, max_tokens=40, spec_type="draft")
        assert r.token_ids == base.token_ids
        branched += r.stats.drafted - sum(r.stats.drafted_at)  # nodes beyond one per depth = siblings
        drafted += r.stats.drafted
    assert branched > 0 and drafted > 0  # drafted only: the random draft (seed 1) is right by chance alone


V, L = 4, 2


@pytest.mark.parametrize("iid", [True, False])
def test_tree_rejection_sampling_converges(iid):
    """Two candidates per position (iid draft samples, or the two most likely one-hot candidates)."""
    g = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=1.0)
    target_logits = torch.randn(L + 1, V, generator=g) * 1.5
    q = torch.softmax(torch.randn(L, V, generator=g), -1)
    p = probs_from_logits(target_logits[:L], params)
    want = (p[0][:, None] * p[1][None, :]).flatten()

    def gen_seq():
        out = []
        while len(out) < L:
            n = len(out)
            if iid:
                tokens = sample(q[n : n + 1].expand(2, V), g).tolist()
                probs = q[n : n + 1].expand(2, V)
            else:
                tokens = q[n].topk(2).indices.tolist()
                probs = None
            rows = target_logits[[n, n + 1, n + 1]]  # the target is context-free: both children share row n+1
            toks, _ = verify_tree_sampling(tokens, [-1, -1], probs, rows, params, g)
            out += toks
        return out[:L]

    def tv(n):
        counts = torch.zeros(V * V)
        for _ in range(n):
            x0, x1 = gen_seq()
            counts[x0 * V + x1] += 1
        return 0.5 * (counts / n - want).abs().sum().item()

    small, large = tv(300), tv(6000)
    assert large < 0.04 and large < small
