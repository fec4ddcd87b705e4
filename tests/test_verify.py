"""Verification: greedy prefix rule and a statistical test that rejection sampling is lossless."""

import pytest
import torch

from specdec.sampling import SamplingParams, probs_from_logits, sample
from specdec.verify import verify_greedy, verify_sampling


def test_greedy_accepts_longest_matching_prefix():
    logits = torch.full((4, 10), -5.0)
    for i, t in enumerate([3, 7, 1, 9]):
        logits[i, t] = 5.0
    assert verify_greedy([3, 7, 1], logits) == [3, 7, 1, 9]  # all accepted + bonus
    assert verify_greedy([3, 2, 1], logits) == [3, 7]  # first mismatch replaced
    assert verify_greedy([0, 7, 1], logits) == [3]
    assert verify_greedy([], logits[:1]) == [3]


V, L = 5, 2  # vocab, tokens per sampled sequence


def _spec_sample(target_logits, draft_probs, params, gen, k, one_hot):
    """Generate L tokens by speculative steps; position i always has target logits target_logits[i]."""
    out = []
    while len(out) < L:
        n = len(out)
        rows = list(range(n, min(n + k, L)))
        if one_hot:  # deterministic drafter: always proposes token (position) % V
            draft, q = [(r * 2) % V for r in rows], None
        else:
            q = draft_probs[rows]
            draft = sample(q, gen).tolist()
        out += verify_sampling(draft, q, target_logits[n : n + len(rows) + 1], params, gen)
    return tuple(out[:L])


@pytest.mark.parametrize(
    "params,one_hot",
    [
        (SamplingParams(temperature=1.0), False),
        (SamplingParams(temperature=0.7, top_k=4, top_p=0.9), False),
        (SamplingParams(temperature=1.3, min_p=0.05), True),
    ],
)
def test_rejection_sampling_converges_to_target(params, one_hot):
    g = torch.Generator().manual_seed(0)
    target_logits = torch.randn(L + 1, V, generator=g) * 1.5  # [L+1, V]
    draft_probs = torch.softmax(torch.randn(L, V, generator=g), -1)  # [L, V], deliberately different
    p = probs_from_logits(target_logits[:L], params)  # [L, V]
    want = (p[0][:, None] * p[1][None, :]).flatten()  # joint over (x0, x1)

    def tv(n):
        counts = torch.zeros(V * V)
        for _ in range(n):
            x0, x1 = _spec_sample(target_logits, draft_probs, params, g, k=2, one_hot=one_hot)
            counts[x0 * V + x1] += 1
        return 0.5 * (counts / n - want).abs().sum().item()

    small, large = tv(300), tv(6000)
    assert large < 0.04
    assert large < small


def test_seeded_sampling_is_reproducible():
    logits = torch.randn(3, 20)
    p = SamplingParams(temperature=1.0, seed=7)
    a = verify_sampling([1, 2], None, logits, p, p.generator())
    b = verify_sampling([1, 2], None, logits, p, p.generator())
    assert a == b


def test_a_top_p_below_float32s_range_keeps_the_likeliest_token():
    """top_p = 5e-324 passes validation (> 0) but is 0 in float32: the filter still keeps the best token, so the
    distribution is one-hot on it instead of all -inf (NaN after softmax; the server's fuzz found it)."""
    from specdec.sampling import probs_from_logits

    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0]])
    for top_p in (5e-324, 1e-30):
        probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=top_p))
        assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0]])), top_p
