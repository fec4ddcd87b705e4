"""Model-free drafters on hand-made token sequences: map-k counts, the shared ngram-mod pool, suffix memory, chains."""

import random

import numpy as np
import pytest

from specdec.drafters import parse_spec_type
from specdec.drafters.base import Draft, Drafter
from specdec.drafters.chain import ChainDrafter
from specdec.drafters.ngram_index import (
    MATCH_PRIOR,
    ContinuationCounts,
    MatchAcceptance,
    ranked,
    suffix_hashes,
    tree_lookups,
    window_hashes,
)
from specdec.drafters.ngram_map_k import NgramMapK4VDrafter, NgramMapKDrafter, NgramMapKTreeDrafter
from specdec.drafters.ngram_mod import NgramModDrafter
from specdec.drafters.suffix import MAX_ORDER, SuffixDrafter, SuffixTreeDrafter
from specdec.errors import SpecdecError
from specdec.sampling import SamplingParams
from specdec.sequence import Sequence


def seq(tokens, slot=0, prompt_len=None):
    tokens = list(tokens)
    return Sequence(tokens, len(tokens) if prompt_len is None else prompt_len, slot, SamplingParams())


def test_hash_paths_agree():
    rng = random.Random(0)
    tokens = [rng.randrange(200_000) for _ in range(50)]
    table = window_hashes(tokens, 10, 50, 6)  # [40, 6]
    for p in range(10, 50):
        assert table[p - 10].tolist() == suffix_hashes(tokens[:p], 6)
    assert len(set(table[:, 2].tolist())) == 40  # distinct 3-grams, distinct hashes


def test_continuation_counts_bounded_and_removable():
    c = ContinuationCounts(k=2)
    for tok in (5, 5, 6, 7):  # 7 replaces 6: fewer hits than 5
        c.add(1, tok)
    assert c.get(1) == {5: 2, 7: 1}
    u = ContinuationCounts()
    for tok in (5, 6, 5):
        u.add(1, tok)
    for tok in (5, 6, 5):
        u.remove(1, tok)
    assert 1 not in u and len(u) == 0


# ---- ngram-map-k / k4v

PATTERN = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 9, 1, 2, 3]  # (1,2,3) -> 4 twice, 5 once


def test_map_k_most_frequent_chain():
    d = NgramMapKDrafter(n=3, m=5)
    draft = d.propose(seq(PATTERN), 16)
    # (1,2,3)->4 (2 hits), (2,3,4)->1 and 9 tie at one hit: the most recent (9), then (3,4,9)->1, (4,9,1)->2, ...
    assert draft.tokens == [4, 9, 1, 2, 3]
    assert d.propose(seq(PATTERN), 2).tokens == [4, 9]


def test_map_k_min_hits():
    assert NgramMapKDrafter(min_hits=2).propose(seq(PATTERN), 8).tokens == [4]  # (2,3,4) has 1-hit continuations
    assert NgramMapKDrafter(min_hits=3).propose(seq(PATTERN), 8).tokens == []


def test_map_k_k_bound():
    toks = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 6, 1, 2, 3]
    assert NgramMapKDrafter(k=2).propose(seq(toks), 1).tokens == [6]
    state = NgramMapKDrafter(k=2)
    state.propose(seq(toks), 1)
    counts = next(iter(state._seqs.values())).table.get(suffix_hashes([1, 2, 3], 3)[-1])
    assert counts == {5: 1, 6: 1}  # 4 (least recent of the 1-hit ones) was replaced


def test_k4v_needs_dominance():
    k4v = NgramMapK4VDrafter()
    assert k4v.propose(seq(PATTERN), 1).tokens == [4]  # 2 hits vs 1
    tie = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]
    assert k4v.propose(seq(tie), 4).tokens == []
    assert NgramMapKDrafter().propose(seq(tie), 1).tokens == [5]  # map-k takes the most recent of a tie


def test_map_k_incremental_state():
    d = NgramMapKDrafter()
    s = seq([7, 8, 9, 1])
    assert d.propose(s, 4).tokens == []
    assert d._seqs[0].indexed == 4
    s.tokens += [7, 8, 9]  # committed output: (7,8,9) was followed by 1
    assert d.propose(s, 1).tokens == [1]
    assert d._seqs[0].indexed == 7
    other = seq([7, 8, 9])  # a new sequence in the same slot (no release): fresh state
    assert d.propose(other, 1).tokens == []
    d.release(other)
    assert d._seqs == {}


# ---- token trees from n-gram candidates


def test_ranked_orders_by_hits_then_recency():
    assert ranked({7: 1, 8: 2, 9: 1}) == [(8, 0.5), (9, 0.25), (7, 0.25)]
    assert ranked({7: 1, 8: 2, 9: 1}, min_hits=2) == [(8, 0.5)]


def test_tree_lookups_best_first():
    table = {1: [(2, 0.6), (3, 0.4)], 2: [(4, 0.5), (5, 0.5)], 3: [(6, 1.0)], 6: [(7, 0.1)]}
    cands = lambda ctx: table.get(ctx[-1], [])  # noqa: E731
    # path probabilities: 2 .6, 3 .4, 3->6 .4, 2->4 .3, 2->5 .3, 6->7 .04
    d = tree_lookups([1], 10, cands, 0.0)
    assert d.tokens == [2, 3, 6, 4, 5, 7] and d.parents == [-1, -1, 1, 0, 0, 2]
    assert all(p < i for i, p in enumerate(d.parents))  # parents come before children
    assert tree_lookups([1], 3, cands, 0.0).tokens == [2, 3, 6]  # the node budget
    assert tree_lookups([1], 10, cands, 0.35).tokens == [2, 3, 6]  # the path-probability cut
    chain = tree_lookups([3], 10, cands, 0.0)
    assert chain.tokens == [6, 7] and chain.parents is None  # a single path is a chain


def test_map_k_tree_branches_over_candidates():
    d = NgramMapKTreeDrafter(n=3)
    # (1,2,3) -> 4 (2 hits) or 5 (1 hit); (2,3,4) -> 9 or 1 (1 hit each, 9 the most recent)
    assert d.propose(seq(PATTERN), 3) == Draft([4, 5, 9], parents=[-1, -1, 0])
    assert NgramMapKTreeDrafter(n=3, min_hits=2).propose(seq(PATTERN), 3) == Draft([4])  # 1-hit ones never branch
    assert NgramMapKTreeDrafter(n=3, m=2).propose(seq(PATTERN), 16).tokens == [4, 5]  # -m bounds the nodes


def test_suffix_tree_branches_where_continuations_split():
    toks = [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3]  # (1,2,3) -> 4 once, 5 once (the most recent)
    assert SuffixDrafter(factor=4).propose(seq(toks), 4).tokens == [5, 7, 1, 2]
    assert SuffixTreeDrafter(factor=4).propose(seq(toks), 4) == Draft([5, 4, 7, 9], parents=[-1, -1, 0, 1])
    assert SuffixTreeDrafter(factor=4, min_prob=0.6).propose(seq(toks), 4) == Draft([])
    assert SuffixTreeDrafter(factor=1).propose(seq(toks), 16).tokens == [5, 4, 7]  # 3 = factor x match length


# ---- ngram-mod


def test_mod_collisions_newest_wins():
    d = NgramModDrafter(n=2, m=4, pool_size=1)  # every n-gram lands in the one entry
    d.FILL_LIMIT = 1.0  # (no pressure handling here)
    assert d.propose(seq([1, 2, 3, 4, 5]), 4).tokens == [5, 5, 5, 5]
    assert d.pool.tolist() == [5]
    big = NgramModDrafter(n=2, pool_size=1 << 16)
    assert big.propose(seq([1, 2, 3, 1, 2, 4, 8, 1, 2]), 1).tokens == [4]  # (1,2)->3, then ->4: newest wins


def test_mod_pool_shared_across_sequences():
    d = NgramModDrafter(n=3, m=8, pool_size=1 << 16)
    a, b = seq([10, 11, 12, 13, 14], slot=0), seq([7, 10, 11, 12], slot=1)
    assert d.propose(b, 8).tokens == []
    d.propose(a, 8)
    assert d.propose(b, 8).tokens == [13, 14]  # b drafts from a's n-grams
    d.release(a)
    d.release(b)
    c = seq([20, 21, 22, 23], slot=0)
    d.release(c)  # released without ever drafting: its n-grams still reach the pool
    assert d.propose(seq([5, 20, 21, 22], slot=1), 8).tokens == [23]
    d.reset()
    assert d.used == 0 and (d.pool < 0).all()
    assert d.propose(seq([5, 20, 21, 22], slot=1), 8).tokens == []


def test_mod_pressure_clears_one_region():
    d = NgramModDrafter(n=1, pool_size=256)  # limit: 64 used entries, regions of 32
    rng = np.random.default_rng(0)
    s = seq([0])
    cleared = False
    for tok in rng.permutation(5000)[:400].tolist():
        before = d.pool.copy()
        s.tokens.append(tok)
        d.propose(s, 1)
        assert d.used == int((d.pool >= 0).sum()) <= d.FILL_LIMIT * len(d.pool)
        if d.next_region == 1 and not cleared:  # the first pressure event: region 0 emptied, the rest kept
            cleared = True
            assert (d.pool[:32] < 0).all()
            kept = before[32:] >= 0
            assert kept.sum() > 30 and (d.pool[32:][kept] == before[32:][kept]).all()
    assert cleared and d.used > 0


# ---- suffix


def test_suffix_own_context_and_adaptive_length():
    rng = random.Random(1)
    x = rng.sample(range(1000, 2000), 40)
    d = SuffixDrafter(factor=1)
    s = seq(x + x[:20])
    # matched order 8 plus 12 earlier positions whose 8-token context was known: 20 tokens allowed
    assert d.propose(s, 32).tokens == x[20:40]
    assert d.propose(s, 5).tokens == x[20:25]
    short = x[:20] + [5] + x[8:10]  # longest known suffix: x[8:10] (2 tokens) -> at most 2 drafted
    assert SuffixDrafter(factor=1).propose(seq(short), 32).tokens == [x[10], x[11]]
    assert SuffixDrafter(factor=0.5).propose(seq(short), 32).tokens == [x[10]]
    assert SuffixDrafter(factor=3).propose(seq(short), 32).tokens == x[10:16]


def test_suffix_min_prob():
    toks = [1, 2, 3, 4] * 3 + [1, 2, 3, 5, 8, 1, 2, 3]  # (1,2,3) -> 4 three times, 5 once
    assert SuffixDrafter(min_prob=0.7).propose(seq(toks), 1).tokens == [4]  # p = 0.75
    assert SuffixDrafter(min_prob=0.8).propose(seq(toks), 1).tokens == []


def test_match_acceptance_scores_what_was_committed():
    acc = MatchAcceptance()
    # a chain of match lengths 1, 4, 4: 5 and 7 accepted, 1 rejected (the target's token was 2), the bonus 9 ignored
    hits, expected = acc.score(Draft([5, 7, 1]), [1, 4, 4], [5, 7, 2, 9])
    assert hits == 2 and MATCH_PRIOR[0] + 2 * MATCH_PRIOR[3] < expected < 2  # each rate as it stood
    assert (acc.seen, acc.hits) == ([1, 0, 0, 2], [1, 0, 0, 1])
    assert acc.rate(1) > MATCH_PRIOR[0] and acc.rate(4) < MATCH_PRIOR[3]
    # a tree, roots 5 and 4, 5 -> 7, 4 -> 9; committed 4 then 8: 4 accepted, 5 and 9 rejected, 7 unknown (under 5)
    acc = MatchAcceptance()
    acc.score(Draft([5, 4, 7, 9], parents=[-1, -1, 0, 1]), [2, 2, 3, 3], [4, 8])
    assert (acc.seen, acc.hits) == ([0, 2, 1, 0], [0, 1, 0, 0])
    acc = MatchAcceptance()
    acc.score(Draft([5, 7]), [1, 1], [5])  # past the committed tokens: nothing said
    assert (acc.seen, acc.hits) == ([1, 0, 0, 0], [1, 0, 0, 0])
    # a request whose drafts failed trusts the rates less; one that did well no more than they say
    assert MatchAcceptance.trust(0, 6) == pytest.approx(0.25) and MatchAcceptance.trust(5, 1) == 1.0


def test_suffix_stops_where_the_path_probability_falls_below_the_engines_stop():
    toks = [1, 2, 3, 4, 9, 8, 1, 2, 3, 4, 9, 8, 1, 2, 3]  # (1, 2, 3) -> 4 -> 9 -> 8, every context seen twice
    d = SuffixDrafter(factor=4)
    assert d.confidence_stop
    full = d.propose(seq(toks), 6).tokens
    assert full == [4, 9, 8, 1, 2, 3]
    assert d.propose(seq(toks), 6, min_path_prob=0.5).tokens == full[:3]  # 5+ tokens matched: 0.8, 0.64, 0.51
    assert d.propose(seq(toks), 6, min_path_prob=0.9).tokens == []
    s = seq(toks)
    d.propose(s, 6)
    s.tokens += [4, 7]  # the target took 4, then 7 where the draft said 9
    d.update(s, 6, 1)
    assert (d.accepted.seen, d.accepted.hits) == ([0, 0, 0, 2], [0, 0, 0, 1])
    for _ in range(40):  # long matches keep failing: their rate falls below the stop
        d.accepted.observe(5, False)
    assert d.propose(seq(toks), 6, min_path_prob=0.5).tokens == []


def test_suffix_global_memory_and_eviction():
    rng = random.Random(2)
    prompts = [rng.sample(range(100, 200), 10) for _ in range(3)]
    outputs = [rng.sample(range(1000, 2000), 12) for _ in range(3)]
    d = SuffixDrafter(max_requests=2)
    probe = lambda i: d.propose(seq([7] + outputs[i][:8], slot=1), 4).tokens  # noqa: E731
    assert probe(0) == []
    d.release(seq(prompts[0] + outputs[0], prompt_len=10))
    assert probe(0) == outputs[0][8:12]  # a later request drafts from an earlier one's output
    for i in (1, 2):
        d.release(seq(prompts[i] + outputs[i], prompt_len=10))
    assert len(d.past) == 2
    assert probe(0) == [] and probe(1) == outputs[1][8:12] and probe(2) == outputs[2][8:12]
    fresh = SuffixDrafter(max_requests=2)
    for i in (1, 2):
        fresh.release(seq(prompts[i] + outputs[i], prompt_len=10))
    counts = lambda s: {h: s.glob.get(h) for h in s.glob.table}  # noqa: E731
    assert counts(d) == counts(fresh)  # eviction removed exactly the oldest request's counts
    d.reset()
    assert probe(2) == [] and len(d.past) == 0
    off = SuffixDrafter(max_requests=0)
    off.release(seq(prompts[0] + outputs[0], prompt_len=10))
    assert len(off.glob) == 0


def test_suffix_contexts_reach_into_the_prompt():
    d = SuffixDrafter()
    d.release(seq(list(range(100, 120)) + [7, 8], prompt_len=20))
    assert d.propose(seq(list(range(110, 120)), slot=1), 4).tokens == [7, 8]
    assert len(d.glob) == MAX_ORDER * 2  # only the output positions were added


# ---- chains and names


class _Fixed(Drafter):
    def __init__(self, name, tokens):
        self.name, self.tokens, self.calls = name, tokens, []

    def propose(self, seq, max_tokens, min_path_prob=0.0):
        self.calls.append("propose")
        return Draft(self.tokens[:max_tokens])

    def update(self, seq, drafted, accepted):
        self.calls.append("update")

    def release(self, seq):
        self.calls.append("release")


def test_chain_first_non_empty_wins():
    a, b, c = _Fixed("a", []), _Fixed("b", [5, 6]), _Fixed("c", [7])
    ch = ChainDrafter([a, b, c])
    s = seq([1])
    assert ch.name == "a,b,c" and ch.propose(s, 1).tokens == [5]
    ch.update(s, 1, 1)
    ch.release(s)
    assert a.calls == b.calls == ["propose", "update", "release"]
    assert c.calls == ["update", "release"]
    assert ChainDrafter([a, _Fixed("d", [])]).propose(s, 4).tokens == []


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("magic", "unknown spec type 'magic'"),
        ("ngram-mod,", "unknown spec type ''"),
        ("none,draft", "cannot contain 'none'"),
        ("suffix,suffix", "repeats"),
    ],
)
def test_parse_spec_type_errors(spec, needle):
    with pytest.raises(SpecdecError, match=needle):
        parse_spec_type(spec)
    assert parse_spec_type(" ngram-mod , draft") == ["ngram-mod", "draft"]
