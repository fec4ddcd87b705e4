"""Drafters that read target features get, through the engine, exactly the rows of committed tokens: each token
once, in order, rejected draft rows never, for chains, trees and ragged batches (fp32, tiny model)."""

import pytest
import torch

import specdec
from specdec.drafters import Draft, Drafter
from specdec.runtime.runner import Features, FeatureSpec
from specdec.sampling import SamplingParams

PROMPT = "t5 t9 t12 t5 t9 t12 t5 t9 t3 t7"
N = 24


class Oracle(Drafter):
    """Knows the plain output `full`; proposes two right tokens around one wrong one (a chain rejected after two,
    or a tree whose first child is wrong) and records the target features it is handed."""

    name = "oracle"

    def __init__(self, full: list[int], tree: bool, layers: tuple[int, ...]):
        self.full, self.tree, self.features = full, tree, FeatureSpec(layers)
        self.got: list[Features] = []

    def propose(self, seq, max_tokens, min_path_prob=0.0):
        n = len(seq.tokens)
        right = self.full[n : n + 2]
        wrong = (self.full[n] + 1) % 50 if n < len(self.full) else 1
        if len(right) < 2 or max_tokens < 3:
            return Draft([])
        if self.tree:
            return Draft([wrong, *right], parents=[-1, -1, 1])
        return Draft([*right, wrong])

    def observe_features(self, seq, feats):
        self.got.append(feats)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    llm = specdec.LLM(
        str(tiny_dir("llama")), spec_type="none", dtype="fp32", context=128, parallel=3, adaptive=False, progress=False
    )
    llm.engine.stop_ids = set()
    return llm


def _expected(llm, tokens: list[int], layers: tuple[int, ...]) -> Features:
    """Features of `tokens` from one plain prefill in a spare slot."""
    llm.runner.prefill(tokens, slot=2)
    return llm.runner.features[0].columns(layers, llm.runner.capture.layers)


def _check(llm, d: Oracle, tokens: list[int]) -> None:
    got = Features.cat(d.got)
    m = len(tokens) - 1  # every token but the newest was processed
    assert len(got) >= m
    want = _expected(llm, tokens[:m], d.features.layers)
    # fp32: the decode and prefill kernels round apart
    torch.testing.assert_close(got.layers[:m], want.layers, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.final[:m], want.final, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tree", [False, True])
def test_one_sequence_gets_committed_rows(llm, tree):
    ids = llm.encode(PROMPT)
    full = ids + llm.generate(ids, max_tokens=N, spec_type="none").token_ids
    d = Oracle(full, tree, (0, 1))
    seq = llm.engine.generate(ids, SamplingParams(max_tokens=N), drafter=d)
    assert seq.tokens == full and seq.stats.accepted > 0 and seq.stats.drafted > seq.stats.accepted
    _check(llm, d, seq.tokens)


def test_ragged_batch_and_two_layer_sets(llm):
    """Two sequences stepped together (ragged chains and a tree in one step), drafters asking different layers."""
    eng = llm.engine
    prompts = [llm.encode(PROMPT), llm.encode("t1 t2 t3 t1 t2")]
    fulls = [p + llm.generate(p, max_tokens=N, spec_type="none").token_ids for p in prompts]
    drafters = [Oracle(fulls[0], False, (1,)), Oracle(fulls[1], True, (0,))]
    seqs = [
        eng.new_sequence(p, SamplingParams(max_tokens=N), slot=i, drafter=d)
        for i, (p, d) in enumerate(zip(prompts, drafters))
    ]
    for s in seqs:
        eng.prefill(s)
    while any(s.finish_reason is None for s in seqs):
        eng.step([s for s in seqs if s.finish_reason is None])
    for s, d, full in zip(seqs, drafters, fulls):
        assert s.tokens == full
        _check(llm, d, s.tokens)


def test_no_capture_without_a_drafter_that_reads_features(tiny_dir):
    llm = specdec.LLM(str(tiny_dir("llama")), spec_type="ngram-simple", dtype="fp32", context=64, progress=False)
    llm.generate(PROMPT, max_tokens=8)
    assert llm.runner.capture is None and llm.runner.features is None


def test_mean_accept_len_is_never_below_one():
    """No drafts: 1.0, also when the last forward's token was the end-of-text (11 forwards for 10 tokens); drafts:
    1 + accepted per verify step."""
    from specdec.stats import Stats

    plain = Stats(new_tokens=10, target_forwards=11)
    assert plain.mean_accept_len == 1.0 and Stats().mean_accept_len == 1.0
    s = Stats(new_tokens=1, target_forwards=1)
    for accepted in (3, 0, 1):
        s.record_step(4, 4, accepted, 4)
    assert s.mean_accept_len == 1 + 4 / 3
