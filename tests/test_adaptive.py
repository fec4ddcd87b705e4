"""Adaptive draft length: the cost model picks long drafts when they pay and none when they don't."""

import pytest

from specdec.acceptance import PRIOR_ACCEPT, AcceptanceEstimate
from specdec.engine.adaptive import (
    PROBE_EVERY,
    RETRY_WASTE,
    CostModel,
    choose_draft_len,
    failed_share,
    retry_pace,
)


def _cost(draft_per_token, verify_slope=0.01):
    c = CostModel()
    for t in (1, 2, 5, 9, 17):
        c.observe_verify(t, 0.25 * (1 + verify_slope * (t - 1)))
    c.observe_draft(10, 10 * draft_per_token)
    return c


def _markov_engine(tmp_path, slots: int = 1, tick: float = 0.3):
    """An engine over the Markov test target of tests/test_lossless_sampling.py, with `slots` sequence slots."""
    from test_lossless_sampling import TARGET, MarkovRunner, TickClock, V, word_tokenizer

    from specdec.engine.engine import Engine, SpecConfig
    from specdec.models.tokenizer import Tokenizer

    word_tokenizer(tmp_path, V)
    return Engine(
        MarkovRunner(TARGET, slots, context=1024), Tokenizer(tmp_path), SpecConfig(draft_max=4), clock=TickClock(tick)
    )


def _markov_draft_model(slots: int = 1):
    """That pair's draft model, as a `draft` drafter."""
    from test_lossless_sampling import DRAFT, MarkovRunner, V

    from specdec.drafters.draft_model import DraftModelDrafter

    return DraftModelDrafter(MarkovRunner(DRAFT, slots, context=1024), V)


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


def test_retries_drift_slower_where_a_failed_draft_is_dear():
    """A mixture of experts: a second row costs 1.34x a one-row forward (Qwen3-30B-A3B shape), so a drafter that is
    never accepted drifts back to drafting at RETRY_WASTE of a plain token's cost, not every few steps."""
    cheap, dear = _cost(0.0), CostModel()
    for t, s in ((1, 23.8e-3), (2, 31.8e-3), (3, 35.9e-3), (5, 46.8e-3)):
        dear.observe_verify(t, s)
        assert retry_pace(failed_share(dear, rows=t - 1)) == 1.0  # measured once: a warm-up, retried at the full pace
        dear.observe_verify(t, s)
    assert retry_pace(failed_share(cheap)) == 1.0 and retry_pace(failed_share(dear)) < 0.1

    def steps_until_drafting(pace: float) -> int:
        acc = AcceptanceEstimate()
        for _ in range(30):
            acc.observe(1, 0)
        steps = 0
        while choose_draft_len(dear, acc, 0, 4) == 0:
            acc.relax(pace)
            steps += 1
        return steps

    assert steps_until_drafting(retry_pace(failed_share(dear))) > 10 * steps_until_drafting(1.0) > 0


@pytest.mark.parametrize("second_row", [0.05, 0.34, 0.6])
def test_retries_of_a_drafter_never_accepted_cost_retry_waste(second_row):
    """A drafter whose drafts are never accepted, steps driven as the planner drives them: the one-token retries
    the drift leads to cost about RETRY_WASTE of the time, however dear a second row is."""
    cost = CostModel()
    for t, s in ((1, 1.0), (2, 1.0 + second_row), (3, 1.0 + 1.8 * second_row)):
        cost.observe_verify(t, s)
        cost.observe_verify(t, s)
    acc, spent, steps = AcceptanceEstimate([0.0]), 0.0, 5000
    for _ in range(steps):
        k = choose_draft_len(cost, acc, 0, 2)
        acc.relax(retry_pace(failed_share(cost)), start=k)
        if k:
            acc.observe(k, 0)
            spent += cost.verify_cost(1 + k) - 1.0
    assert 0 < spent / steps < 1.5 * RETRY_WASTE


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


def test_probe_due_every_probe_every_undrafted_steps():
    cost = CostModel()
    due = [cost.probe_due("d") for _ in range(3 * PROBE_EVERY)]
    assert due.count(True) == 3 and due[PROBE_EVERY - 1]
    cost.observe_draft(2, 0.1, "d")  # a draft resets the count
    assert not any(cost.probe_due("d") for _ in range(PROBE_EVERY - 1))
    slow = [cost.probe_due("e", every=4 * PROBE_EVERY) for _ in range(8 * PROBE_EVERY)]  # a dear probe: rarer
    assert slow.count(True) == 2 and slow[4 * PROBE_EVERY - 1]


def test_a_size_measured_once_is_a_warm_up():
    cost = CostModel()
    cost.observe_verify(2, 0.08)  # a first forward that paid for a warm-up
    cost.observe_verify(2, 0.05)
    assert cost.verify_s[2] == 0.05  # replaced, not averaged
    cost.observe_verify(2, 0.06)
    assert cost.verify_s[2] == pytest.approx(0.05 + cost.ema * 0.01)


def test_larger_sizes_move_with_the_smallest():
    """A longer context makes the one-row forwards (measured every undrafted step) dearer: the larger sizes, measured
    only when drafted, move with them, so a draft never looks free for a stale cost."""
    cost = CostModel()
    for t, s in ((1, 0.10), (1, 0.10), (2, 0.12), (2, 0.12)):
        cost.observe_verify(t, s)
    cost.observe_verify(1, 0.20)
    assert cost.verify_s[1] == pytest.approx(0.12) and cost.verify_s[2] == pytest.approx(0.12 * 1.2)


def test_drafts_grow_as_their_forwards_get_measured():
    """A fresh engine's drafts ramp 1, 3, 7, 15 tokens: a forward is at most twice the largest measured."""
    cost = CostModel()
    assert cost.ramp(1) <= 0
    lengths = []
    for size in (1, 2, 4, 8):
        cost.observe_verify(size, 0.01)
        lengths.append(cost.ramp(1))
    assert lengths == [1, 3, 7, 15] and cost.ramp(5) == 11  # in a batch, rows already held count


def test_positions_a_step_does_not_draft_drift_back():
    acc = AcceptanceEstimate([0.9, 0.3, 0.3])
    acc.relax(start=1)
    assert acc.rates[0] == 0.9 and all(0.3 < r < PRIOR_ACCEPT for r in acc.rates[1:])


@pytest.mark.parametrize("spec", ["draft", "suffix"])
def test_a_drafter_that_does_not_pay_drafts_only_probes(tmp_path, spec):
    """Drafting costs far more than a target forward: after its first measurement the drafter is asked for
    nothing but one-token probes, at most one every PROBE_EVERY steps (fewer, the dearer a probe is)."""
    from test_lossless_sampling import _drafter

    from specdec.sampling import SamplingParams

    engine = _markov_engine(tmp_path)
    engine.cost.verify_s = {k: 0.01 for k in range(1, 6)}  # one tick of drafting (0.3 s) is 30 target forwards
    engine.cost.ema = 0.0
    drafter = _markov_draft_model() if spec == "draft" else _drafter(spec)
    seq = engine.generate([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], SamplingParams(max_tokens=400), drafter=drafter)
    steps, drafted = seq.stats.target_forwards, seq.stats.drafted
    assert steps > 300 and 0 < drafted <= 4 + steps / PROBE_EVERY, (steps, drafted)


@pytest.mark.parametrize("setup_per_token, drafts", [(1.0, False), (1e-7, True)])
def test_a_draft_models_setup_is_paid_only_where_it_is_repaid(tmp_path, setup_per_token, drafts):
    """A draft model must first prefill a new prompt itself: with that catch-up measured dearer than anything
    drafting can save over the request's tokens left, it never drafts (no probe either); cheap, it drafts."""
    from specdec.sampling import SamplingParams

    engine = _markov_engine(tmp_path, tick=0.0)
    engine.cost.verify_s = {k: 0.01 for k in range(1, 6)}
    engine.cost.draft_s, engine.cost.setup_s, engine.cost.ema = {"draft": 1e-4}, {"draft": setup_per_token}, 0.0
    seq = engine.generate([1, 2, 3, 4, 5] * 10, SamplingParams(max_tokens=100), drafter=_markov_draft_model())
    assert (seq.stats.drafted > 0) == drafts, seq.stats.drafted


@pytest.mark.parametrize("setup_per_token, model_asked", [(1.0, False), (1e-7, True)])
def test_a_chain_leaves_out_a_member_whose_setup_does_not_pay(tmp_path, setup_per_token, model_asked):
    """`draft,suffix`: where the draft model's catch-up on the prompt is not repaid, the chain drafts without it
    (the suffix drafter alone, from the first step on) instead of paying it or drafting nothing."""
    from test_lossless_sampling import _drafter

    from specdec.drafters.chain import ChainDrafter
    from specdec.sampling import SamplingParams

    engine = _markov_engine(tmp_path, tick=0.0)
    model, asked = _markov_draft_model(), []
    propose = model.propose_batch
    model.propose_batch = lambda *a: asked.append(1) or propose(*a)
    chain = ChainDrafter([model, _drafter("suffix")])
    engine.cost.verify_s = {k: 0.01 for k in range(1, 6)}
    engine.cost.draft_s, engine.cost.setup_s = {model.name: 1e-4}, {model.name: setup_per_token}
    engine.cost.ema = 0.0
    seq = engine.generate([1, 2, 3, 4, 5] * 10, SamplingParams(max_tokens=100), drafter=chain)
    assert bool(asked) == model_asked and seq.stats.drafted > 0, (len(asked), seq.stats.drafted)
    assert not chain.declined  # released with the sequence


@pytest.mark.parametrize("model_cost", [1e-6, 1.0])
def test_a_chains_cheap_member_drafts_alone_where_the_expensive_one_does_not_pay(tmp_path, model_cost):
    """The engine judges a chain's members apart: with the draft model's tokens measured dearer than the forwards
    they could save, only its one-token probes ask it, while the nearly free first member still drafts every step
    it can (judged as one, the chain's mixed cost would stop both); cheap, the model drafts where the first has
    nothing."""
    from test_lossless_sampling import _drafter

    from specdec.drafters.base import Draft, Drafter
    from specdec.drafters.chain import ChainDrafter
    from specdec.engine.adaptive import PROBE_EVERY
    from specdec.sampling import SamplingParams

    class EveryOther(Drafter):
        """The suffix drafter's draft at every other call, nothing at the others."""

        name = "every-other"

        def __init__(self):
            self.inner, self.calls = _drafter("suffix"), 0

        def propose(self, seq, max_tokens, min_path_prob=0.0):
            self.calls += 1
            return self.inner.propose(seq, max_tokens) if self.calls % 2 else Draft([])

    engine = _markov_engine(tmp_path, tick=0.0)
    model, asked = _markov_draft_model(), []
    propose = model.propose_batch
    model.propose_batch = lambda *a: asked.append(1) or propose(*a)
    chain = ChainDrafter([EveryOther(), model])
    engine.cost.verify_s = {k: 0.01 for k in range(1, 6)}
    engine.cost.draft_s, engine.cost.ema = {model.name: model_cost, "every-other": 1e-6}, 0.0
    seq = engine.generate([1, 2, 3, 4, 5] * 10, SamplingParams(max_tokens=100), drafter=chain)
    probes = seq.stats.target_forwards // PROBE_EVERY + 1
    assert seq.stats.drafted > 0 and (len(asked) <= probes) == (model_cost == 1.0), (len(asked), probes)
    assert engine.cost.acceptance("every-other").rates


def test_row_cost_is_the_measured_slope_and_raises_the_confidence_threshold(tmp_path):
    """A draft model stops where one more token's expected yield no longer pays for drafting it and for the row
    it adds to the verification (on AVX2 an 8-row forward costs ~2.5x a one-row one)."""
    from dataclasses import replace

    from specdec.engine.planner import DraftPlanner
    from specdec.sampling import SamplingParams
    from specdec.sequence import Draft

    cost = CostModel()
    assert cost.row_cost() == 0.0
    cost.observe_verify(1, 0.08)
    assert cost.row_cost() == 0.0  # one size: no slope yet
    cost.observe_verify(9, 0.24)
    assert cost.row_cost() == pytest.approx(0.02)
    engine = _markov_engine(tmp_path)
    seq = engine.generate([1, 2, 3], SamplingParams(max_tokens=8), drafter=_markov_draft_model())
    seq.options = replace(seq.options, params=SamplingParams(max_tokens=100))  # room to draft again
    seq.acceptance = {seq.drafter.name: AcceptanceEstimate([0.99] * 16)}
    engine.cost.verify_s, engine.cost.draft_s = {1: 0.08, 9: 0.24}, {seq.drafter.name: 0.02}
    asked = []  # the budgets the planner gives the draft model
    seq.drafter.propose_parts = lambda seqs, budgets: asked.extend(budgets) or [Draft([]) for _ in seqs]
    DraftPlanner(engine.spec, engine.cost, engine.target.context, engine.clock).propose([seq])
    k, min_path_prob = asked[0][seq.drafter.name]
    assert k == 4 and min_path_prob == pytest.approx((0.02 + 0.02) / 0.08)


def test_in_a_batch_a_draft_must_beat_the_batchs_cheaper_plain_tokens():
    """Where a forward over B rows costs little more than one row (weight reads dominate), plain decoding in a
    batch of B costs verify(B) / B per token: a draft that pays alone can lose there, and the confidence
    threshold rises by the same factor."""
    from specdec.engine.adaptive import expected_saving, plain_cost

    cost = CostModel(verify_s={1: 0.10, 2: 0.11, 4: 0.13, 8: 0.25, 16: 0.45}, draft_s={"d": 0.03})
    acc = AcceptanceEstimate([0.7] * 16)
    cost.history["d"] = acc
    assert plain_cost(cost, 1) == pytest.approx(0.10) and plain_cost(cost, 4) == pytest.approx(0.0325)
    assert choose_draft_len(cost, acc, 0, 8, "d") > 0  # alone, drafting pays
    assert choose_draft_len(cost, acc, 0, 8, "d", batch=4) == 0  # in a batch of 4 it does not
    assert expected_saving(cost, 8, "d") > 0 and expected_saving(cost, 8, "d", batch=4) == 0
    # batch 1 is the single-sequence formula: E(k) / (k * draft + verify(k + 1))
    k = choose_draft_len(cost, acc, 0, 8, "d")
    exp = 1 + sum(0.7**i for i in range(1, k + 1))
    assert exp / (k * 0.03 + cost.verify_cost(k + 1)) > 1 / 0.10


def test_a_batched_chain_forward_is_measured_by_its_tokens(tmp_path):
    """A step of two sequences runs one forward over their tokens: the cost model learns what that many tokens
    cost (before, only single-sequence steps were measured, so a batch's drafts ran on no measured costs)."""
    from specdec.sampling import SamplingParams

    engine = _markov_engine(tmp_path, slots=2)
    seqs = [engine.new_sequence([1, 2, 3], SamplingParams(max_tokens=8), slot=i) for i in range(2)]
    for s in seqs:
        engine.prefill(s)
    engine.step(seqs)
    assert list(engine.cost.verify_s) == [2]


def test_in_a_batch_a_probe_never_pays_a_catch_up_on_a_new_prompt(tmp_path, monkeypatch):
    """Where drafting is not expected to pay, the draft model's one-token probes re-measure it; in a batch they do
    so only on sequences whose prompt it has already read: a probe there never buys its prefill of a new prompt
    (while the other sequences wait). Alone, a probe may."""
    import specdec.engine.planner as planner
    from specdec.sampling import SamplingParams

    monkeypatch.setattr(planner, "probe_every", lambda *a: PROBE_EVERY)  # probes every PROBE_EVERY steps, however dear
    drafted = []
    for batch in (1, 2):
        engine = _markov_engine(tmp_path, slots=batch)
        engine.cost.verify_s = {k: 0.01 for k in range(1, 6)}
        engine.cost.draft_s, engine.cost.ema = {"draft": 0.3}, 0.0
        drafter = _markov_draft_model(batch)
        seqs = [
            engine.new_sequence([1, 2, 3, 4, 5] * 10, SamplingParams(max_tokens=100), slot=i, drafter=drafter)
            for i in range(batch)
        ]
        for s in seqs:
            engine.prefill(s)
        while any(s.finish_reason is None for s in seqs):
            engine.step([s for s in seqs if s.finish_reason is None])
        drafted.append(sum(s.stats.drafted for s in seqs))
    assert drafted[0] > 0 and drafted[1] == 0, drafted


def test_plain_due_while_unmeasured_and_every_remeasure_steps():
    from specdec.engine.adaptive import REMEASURE

    cost = CostModel(verify_s={17: 0.3})
    assert cost.plain_due(1)  # plain decoding alone was never measured: a 17-row forward says nothing about it
    cost.observe_verify(1, 0.1)
    due = [cost.plain_due(1) for _ in range(2 * REMEASURE)]
    assert due.index(True) == REMEASURE and cost.plain_due(2)
    cost.observe_verify(1, 0.1)  # any forward over one token re-measures it
    assert not cost.plain_due(1)


def test_an_adaptive_engine_measures_plain_decoding_at_its_batch(tmp_path):
    """Every draft is weighed against plain decoding at the step's batch: a step runs plain while that cost is
    unmeasured, and again after REMEASURE steps without a forward over that many tokens."""
    from test_lossless_sampling import _drafter

    from specdec.engine.adaptive import REMEASURE
    from specdec.sampling import SamplingParams

    engine = _markov_engine(tmp_path)
    seq = engine.new_sequence([1, 2, 3, 4, 5] * 10, SamplingParams(max_tokens=1000), drafter=_drafter("suffix"))
    engine.prefill(seq)
    steps = [engine.step([seq]) for _ in range(3 * REMEASURE)]
    plain, caps = [s.forward_tokens == 1 for s in steps], [s.cap for s in steps]  # cap 0: the step's drafts were off
    assert seq.finish_reason is None
    assert caps[0] == 0 and 1 in engine.cost.verify_s
    assert any(c is None for c in caps)
    for i in range(len(plain) - REMEASURE):
        assert any(plain[i : i + REMEASURE + 1]), i  # never more than REMEASURE steps without a plain forward
    forced = [i for i, c in enumerate(caps) if c == 0]
    assert all(not any(plain[i - REMEASURE : i]) for i in forced[1:])  # and only when it is due


def test_a_draft_is_priced_on_top_of_the_rows_already_in_the_step():
    """Where every row costs the same (a compute-bound forward), a sequence's draft is weighed against the rows
    the step's forward already holds: the first sequences of a batch get their drafts, a later one whose rows
    would land where forwards cost more per row gets a shorter one or none (eight sequences each priced on
    top of the batch alone made 136-token forwards on the server)."""
    cost = CostModel(verify_s={1: 0.025, 8: 0.048, 17: 0.072, 136: 0.688}, draft_s={"d": 0.0})
    acc = AcceptanceEstimate([0.9] * 16)
    alone = choose_draft_len(cost, acc, 0, 16, "d", batch=8)
    assert alone > 0 and alone == choose_draft_len(cost, acc, 0, 16, "d", batch=8, rows=8)
    assert choose_draft_len(cost, acc, 0, 16, "d", batch=8, rows=100) < alone


def test_above_the_largest_measured_forward_rows_cost_the_measured_slope():
    cost = CostModel(verify_s={1: 0.02, 9: 0.06})
    assert cost.verify_cost(17) == pytest.approx(0.10)  # was 0.06: rows past the largest measured looked free
    assert CostModel(verify_s={4: 0.03}).verify_cost(8) == pytest.approx(0.03)  # one size: no slope yet


def test_a_new_sequence_starts_from_the_drafters_history_never_below_the_prior():
    from specdec.acceptance import PRIOR_ACCEPT
    from specdec.sampling import SamplingParams
    from specdec.sequence import Sequence

    good, bad = AcceptanceEstimate([0.99] * 8), AcceptanceEstimate([0.1] * 8)
    seq = Sequence([1, 2], 2, 0, SamplingParams())
    assert seq.acceptance_of("a", good).rates == [0.99] * 8
    assert seq.acceptance_of("b", bad).rates == [PRIOR_ACCEPT] * 8
    assert seq.acceptance_of("c").rates == [] and seq.acceptance_of("a", bad).rates == [0.99] * 8  # kept once made
    # where a failed draft is dear (retry_pace < 1), a drafter that did badly starts only that far toward the prior
    assert seq.acceptance_of("d", bad, pace=0.1).rates == pytest.approx([0.1 + 0.1 * (PRIOR_ACCEPT - 0.1)] * 8)
    noisy = AcceptanceEstimate([0.8, 0.6, 0.9])  # first position above the prior: lifted as before, whatever the pace
    assert seq.acceptance_of("e", noisy, pace=0.1).rates == [0.8, PRIOR_ACCEPT, 0.9]


def test_a_size_measured_at_a_busy_moment_does_not_cut_drafts_in_a_batch():
    """Forwards of 16 + k rows at ~3.5 ms a row on top of 16 rows at 4.5 ms each, measured with noise, one size
    (17) at a busy moment: read as measured, one drafted row looked to cost 25 ms and a batch of 16 drafted one
    token a step; read off the local lines (`CostModel.smoothed`), a sure draft is drafted long."""
    noise = [0.004, -0.003, 0.002, -0.004, 0.003, -0.002, 0.0]
    verify = {t: 0.072 + 0.0035 * (t - 16) + noise[t % 7] for t in range(10, 60, 3) if t != 16}
    verify |= {16: 0.072, 17: 0.097}
    acc = AcceptanceEstimate([1.0] * 16)
    raw = CostModel(verify_s=dict(verify), draft_s={"d": 0.0}, smooth=False)
    smooth = CostModel(verify_s=dict(verify), draft_s={"d": 0.0})
    assert choose_draft_len(raw, acc, 0, 1, "d", batch=16) == 0
    assert choose_draft_len(smooth, acc, 0, 16, "d", batch=16) >= 8
    assert smooth.verify_cost(17) < 0.085  # measured 0.097; the line through its neighbours gives 0.0755
    assert all(smooth.verify_cost(t) <= smooth.verify_cost(t + 1) for t in range(10, 60))  # never falls


def test_smoothing_keeps_sizes_without_close_neighbours_as_measured():
    cost = CostModel(verify_s={1: 0.1, 16: 0.2, 512: 1.0})
    assert [cost.verify_cost(t) for t in (1, 16, 512)] == [0.1, 0.2, 1.0]
    cost.observe_verify(16, 0.4)  # a new measurement refits
    assert cost.verify_cost(16) == pytest.approx(0.2 + cost.ema * 0.2)


def test_a_lone_dear_size_past_a_gap_does_not_keep_drafts_out_of_it():
    """Sizes 5-17 measured on a line (3.5 ms a row), then one 144-row forward at a cold, busy moment (834 ms): read
    between 17 and 144 the rows cost 6 ms each and a batch of 16 drafted a token at most; in the gap the
    line fitted at 17 goes on, so drafts are tried and the gap gets measured."""
    verify = {t: 0.016 + 0.0035 * t for t in (5, 7, 8, 10, 12, 13, 14, 15, 16, 17)} | {144: 0.834}
    cost = CostModel(verify_s=verify, draft_s={"d": 0.0})
    assert cost.verify_cost(40) == pytest.approx(0.016 + 0.0035 * 40)
    assert cost.verify_cost(144) == pytest.approx(0.834)
    assert choose_draft_len(cost, AcceptanceEstimate([1.0] * 16), 0, 16, "d", batch=16) == 16
    assert (
        choose_draft_len(
            CostModel(verify_s=verify, draft_s={"d": 0.0}, smooth=False),
            AcceptanceEstimate([1.0] * 16),
            0,
            16,
            "d",
            batch=16,
        )
        <= 1
    )  # as measured: to 17
