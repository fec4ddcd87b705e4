"""Adaptive draft length: the cost model picks long drafts when they pay and none when they don't."""
from specdec.engine.adaptive import AcceptanceEstimate, CostModel, choose_draft_len


def _cost(draft_per_token, verify_slope=0.01):
    c = CostModel()
    for t in (1, 2, 5, 9, 17):
        c.observe_verify(t, 0.25 * (1 + verify_slope * (t - 1)))
    c.observe_draft(10, 10 * draft_per_token)
    return c


def test_free_drafts_with_high_acceptance_use_the_maximum():
    acc = AcceptanceEstimate()
    for _ in range(20):
        acc.observe(16, 16)
    assert choose_draft_len(_cost(0.0), acc, 0, 16) == 16


def test_useless_drafts_are_turned_off_then_retried():
    acc = AcceptanceEstimate()
    for _ in range(30):
        acc.observe(8, 0)
    cost = _cost(0.0, verify_slope=0.05)
    assert choose_draft_len(cost, acc, 0, 16) == 0
    for _ in range(100):
        acc.relax()
    assert choose_draft_len(cost, acc, 0, 16) > 0


def test_expensive_drafts_shorten_the_chain():
    acc = AcceptanceEstimate([0.8] * 16)
    cheap = choose_draft_len(_cost(0.005), acc, 0, 16)
    dear = choose_draft_len(_cost(0.08), acc, 0, 16)
    assert 1 <= dear < cheap


def test_draft_min_is_respected():
    acc = AcceptanceEstimate([0.5] * 16)
    assert choose_draft_len(_cost(0.2), acc, 4, 16) in (0, *range(4, 17))


def test_known_cutoff_is_found():
    acc = AcceptanceEstimate()
    for _ in range(30):
        acc.observe(16, 6)  # always 6 accepted, the 7th rejected
    assert choose_draft_len(_cost(0.02), acc, 0, 16) == 6
