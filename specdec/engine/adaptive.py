"""Adaptive draft length: pick k to maximise expected tokens per second.

Two measured ingredients:
- `CostModel` (per engine, i.e. per machine and model pair): seconds for a target forward over
  t tokens, and seconds per drafted token for the drafter, both running averages; a forward's cost is read off a
  least-squares line through the sizes measured near t (`CostModel.smoothed`), so one noisy size cannot make
  the rows past it look dear.
- `AcceptanceEstimate` (per sequence): for each draft position i, the probability that the
  draft token there is accepted given that every earlier one was.

Expected tokens for a draft of k: E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j (the bonus token
always comes). Expected time: T(k) = k * draft_cost + verify(k + 1). Choose argmax E/T.
In a step over B sequences a sequence pays its share of the plain forward and the rows its draft adds on top
of the R rows the forward already holds (the B last tokens and the drafts granted to sequences asked before it
in this step): T(k) = k * draft_cost + verify(B) / B + verify(R + k) - verify(R), against plain decoding's
verify(B) / B per token (forward costs are measured by the tokens of a forward, whichever sequences they belong
to). Where a forward's cost per row grows past some size, later sequences see the dearer rows.
While a forward is bound by reading the weights, B rows cost little more than one, so each token of plain
decoding gets cheaper with B while a draft's extra rows (past that point) do not: drafts that pay alone may
not pay in a batch. With a 1.5B target on an AVX2 CPU, two sequences' plain forward took 0.12 s and one carrying
their 16-token drafts (~30 tokens) 0.56 s: drafting as if alone ran at 0.83x plain decoding's speed at two clients.

Drafters that know their confidence (the draft model) instead get the budget k_max and stop by
themselves once the product of their token probabilities falls below (draft_cost + row_cost) / (verify(B) / B):
past that point another draft token is expected to save less target time than drafting and verifying it costs.

A drafter that must first catch up on a new prompt (a draft model's own prefill) drafts for a sequence only where
that one-off setup (measured seconds per token) is expected to be repaid over the rest of the request: the time a
token saves at the best draft length, from the drafter's acceptance over earlier requests, times the tokens left.

Every drafter, the draft model included, drafts nothing in a step where no k > 0 is expected to beat
plain decoding. Its acceptance estimates then drift back toward the prior, and after PROBE_EVERY
undrafted steps it drafts one token anyway, so costs and acceptance that changed get measured again;
in a batch, a probe skips a sequence whose prompt the drafter has not read (its catch-up would hold up the batch).
The positions past a step's draft drift back the same way, so a position that did badly a few times is tried again
once drafts stop short of it. Where a failed one-token draft costs more than RETRY_WASTE of a plain token, the drift
is paced so that the retries of a drafter that is never accepted cost RETRY_WASTE of the time (`retry_pace`), probes
a quarter of it (`probe_every`), and a new sequence of a drafter whose first position did badly starts that much of
the way back to the prior, not at it: on a mixture of experts a second row reads more experts (Qwen3-30B-A3B shape:
a 2-row forward costs 1.34x a 1-row one), and at the full pace a drafter that is never accepted drafted again every
third or fourth step and several tokens at each request's start, 0.93x plain (`specdec bench ... --methods
none,synthetic --spec-synth-rates 0.0`).

A fresh engine's drafts grow with its measurements (`CostModel.ramp`: a forward at most twice the largest measured),
and a size's first measurement, which may carry a warm-up, is replaced by its second.

Every draft is weighed against plain decoding at the step's batch, verify(B), so that cost must be measured, not
guessed from larger forwards (a one-sequence server that always drafts 16 tokens would otherwise take a one-row
forward to cost as much as a 17-row one): a step over B sequences runs plain while a forward over B tokens is
unmeasured, and again every REMEASURE steps over B sequences without one (costs drift with the machine's load).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from itertools import accumulate

from specdec.acceptance import EMA, PRIOR_ACCEPT, RELAX, AcceptanceEstimate

COST_EMA = 0.2  # weight of a new forward's or draft's time in its running average
PROBE_EVERY = 32  # undrafted steps (per drafter, over all sequences) before a one-token probe
RETRY_WASTE = 0.01  # the share of the time retries may cost a drafter that is never accepted (`retry_pace`)
REMEASURE = 64  # steps over B sequences without a forward over B tokens before a plain step re-measures it
SPAN = 1.5  # `CostModel.smoothed`: a size's cost is fitted over the measured sizes within this factor of it


@dataclass
class CostModel:
    verify_s: dict[int, float] = field(default_factory=dict)  # tokens per forward -> seconds
    draft_s: dict[str, float] = field(default_factory=dict)  # drafter name -> seconds per drafted token
    setup_s: dict[str, float] = field(default_factory=dict)  # drafter name -> seconds per token of catch-up
    history: dict[str, AcceptanceEstimate] = field(default_factory=dict)  # drafter name -> over all sequences
    idle: dict[str, int] = field(default_factory=dict)  # drafter name -> undrafted steps since its last draft
    unmeasured: dict[int, int] = field(default_factory=dict)  # batch size -> steps since a forward of that size
    once: set[int] = field(default_factory=set)  # sizes measured once: a warm-up, replaced by the next measurement
    ema: float = COST_EMA
    # Above the largest measured size, forwards grow by the measured slope per row (False: `row_cost`) or in
    # proportion to tokens (True: compute-bound, for batches much larger than any measured).
    proportional_above: bool = False
    smooth: bool = True  # costs read off local least-squares lines through the measured sizes (`smoothed`)
    _smooth: dict[int, float] = field(default_factory=dict, init=False, repr=False, compare=False)
    _smooth_of: dict | None = field(default=None, init=False, repr=False, compare=False)  # the table fitted
    _slopes: dict[int, float] = field(default_factory=dict, init=False, repr=False, compare=False)
    _sizes_of: dict | None = field(default=None, init=False, repr=False, compare=False)  # the table `_sorted` sorts
    _sorted: list[int] = field(default_factory=list, init=False, repr=False, compare=False)

    def observe_verify(self, tokens: int, seconds: float) -> None:
        """A forward over `tokens` took `seconds`. A size's first forward may pay for a warm-up (the gpt-oss-20b
        shape, replayed: 80 ms for a 2-row forward's first, 49 after), so the second replaces it; then running
        averages."""
        old = self.verify_s.get(tokens)
        first = old is None or tokens in self.once
        self.verify_s[tokens] = seconds if first else old + self.ema * (seconds - old)
        (self.once.add if old is None else self.once.discard)(tokens)
        self.unmeasured[tokens] = 0
        self._smooth_of = None
        if not first and old > 0 and tokens == min(self.verify_s):
            self._scale_above(tokens, self.verify_s[tokens] / old)

    def _scale_above(self, tokens: int, factor: float) -> None:
        """Sizes above `tokens` move with it: the smallest size is measured most often (every undrafted step), and a
        longer context or a busier machine makes every forward dearer. Left where they were, a long prompt's one-row
        forwards came to cost more than the two-row ones measured before it, so a draft looked free: a never-accepted
        synthetic drafter on the Qwen3-30B-A3B shape drafted 47 tokens in a 128-token request."""
        for t in self.verify_s:
            if t > tokens:
                self.verify_s[t] *= factor

    def plain_due(self, batch: int) -> bool:
        """Count a step over `batch` sequences; True when plain decoding at that batch (a forward over `batch`
        tokens) is unmeasured or was last measured REMEASURE such steps ago: time for a plain step."""
        n = self.unmeasured[batch] = self.unmeasured.get(batch, 0) + 1
        return batch not in self.verify_s or n > REMEASURE

    def ramp(self, rows: int) -> int:
        """The most draft tokens a forward already holding `rows` tokens may take: up to twice the largest forward
        measured. Above it `verify_cost` guesses (with one size measured, that more rows are free), so a fresh
        engine's drafts grow 1, 3, 7, 15 tokens as their forwards get measured, not 16 at once (a 17-row forward
        of the gpt-oss-20b shape costs 3.8 one-row ones: `scripts/profile_step.py --rows 1,17`)."""
        return 2 * max(self.verify_s, default=0) - rows

    def observe_draft(self, drafted: int, seconds: float, drafter: str = "") -> None:
        if drafted:
            self.idle[drafter] = 0
            per, old = seconds / drafted, self.draft_s.get(drafter)
            self.draft_s[drafter] = per if old is None else old + self.ema * (per - old)

    def observe_setup(self, tokens: int, seconds: float, drafter: str = "") -> None:
        if tokens and seconds > 0:
            per, old = seconds / tokens, self.setup_s.get(drafter)
            self.setup_s[drafter] = per if old is None else old + self.ema * (per - old)

    def setup_cost(self, tokens: int, drafter: str = "") -> float:
        """Seconds for `drafter` to catch up on `tokens` (0 until measured)."""
        return tokens * self.setup_s.get(drafter, 0.0)

    def acceptance(self, drafter: str = "") -> AcceptanceEstimate:
        """`drafter`'s acceptance over every sequence so far (the engine feeds it)."""
        return self.history.setdefault(drafter, AcceptanceEstimate())

    def probe_due(self, drafter: str = "", every: float = PROBE_EVERY) -> bool:
        """Count one undrafted step of `drafter`; True once every `every` of them (time to re-measure;
        `probe_every`: rarer where a failed one-token draft is dear)."""
        self.idle[drafter] = self.idle.get(drafter, 0) + 1
        if self.idle[drafter] < every:
            return False
        self.idle[drafter] = 0
        return True

    def draft_cost(self, drafter: str = "") -> float:
        """Seconds per drafted token (0 until measured)."""
        return self.draft_s.get(drafter, 0.0)

    def row_cost(self) -> float:
        """Seconds one more token adds to a target forward: the slope between the smallest and the largest
        measured sizes (0 until two are measured). Near 0 where verification is memory-bound (AVX-512 VNNI);
        on AVX2 an 8-row forward costs ~2.5x a one-row one."""
        if len(self.verify_s) < 2:
            return 0.0
        lo, hi = min(self.verify_s), max(self.verify_s)
        return max(0.0, (self.verify_s[hi] - self.verify_s[lo]) / (hi - lo))

    def verify_cost(self, tokens: float) -> float:
        """Forward time for `tokens`, interpolated between measured sizes (their `smoothed` costs, unless `smooth` is
        off); below the smallest, as the smallest; above the largest, see `proportional_above` (one size measured:
        as that one)."""
        if not self.verify_s:
            return 1.0
        costs = self.smoothed() if self.smooth else self.verify_s  # (smoothed() also fits _slopes)
        if tokens in costs:
            return costs[tokens]
        sizes = self._sizes(costs)
        at = bisect_left(sizes, tokens)  # sizes[at - 1] < tokens < sizes[at]
        if 0 < at < len(sizes):
            lo, hi = sizes[at - 1], sizes[at]
            w = (tokens - lo) / (hi - lo)
            between = costs[lo] * (1 - w) + costs[hi] * w
            slope = self._slopes.get(lo) if self.smooth else None
            # In a gap, no dearer than the line fitted at its lower end goes on: a lone dear size beyond the gap (a
            # forward's first run at that size, a busy moment) would otherwise keep drafts out of it for good.
            return between if slope is None else min(between, costs[lo] + (tokens - lo) * slope)
        if at == 0:
            return costs[sizes[0]]
        lo = sizes[-1]
        if self.proportional_above:
            return costs[lo] * tokens / lo
        return costs[lo] + (tokens - lo) * self.row_cost()

    def _sizes(self, costs: dict[int, float]) -> list[int]:
        """`costs`' sizes in order, sorted again when the table gains a size (none is ever removed) or is another
        table: a step prices every sequence's draft lengths against it, and at 500 sequences a step there are
        hundreds of sizes."""
        if self._sizes_of is not costs or len(self._sorted) != len(costs):
            self._sizes_of, self._sorted = costs, sorted(costs)
        return self._sorted

    def smoothed(self) -> dict[int, float]:
        """Each measured size's cost read off a least-squares line through the sizes within a factor SPAN of it
        (where there are at least three), then never more than a larger size's (cached until the next measurement).
        A size measured at a busy moment, or seldom, sits off its neighbours' line; interpolated as it is, the rows
        just past it look dear and those past the next size cheap, so drafts in a batch (priced by the rows they
        add) came out short and erratic: forwards of 16 rows measured at 67.8 ms and of 17 at 81.1 priced the one
        drafted row at 13 ms, three plain tokens' worth (4.2 ms each), so a one-token draft never paid."""
        if self._smooth_of is not self.verify_s:  # measured since (`observe_verify` clears it), or a table set anew
            self._smooth_of = self.verify_s
            pts = sorted(self.verify_s.items())
            xs = [t for t, _ in pts]
            # running sums of (1, x, y, x^2, xy): any window's least-squares line in O(1), a refit in O(n log n)
            sums = list(
                accumulate(
                    ((1, x, y, x * x, x * y) for x, y in pts),
                    lambda a, b: tuple(u + v for u, v in zip(a, b)),
                    initial=(0, 0, 0.0, 0, 0.0),
                )
            )
            lines = [
                _line_at(
                    t, y, [u - v for u, v in zip(sums[bisect_right(xs, t * SPAN)], sums[bisect_left(xs, t / SPAN)])]
                )
                for t, y in pts
            ]
            fit = [v for v, _ in lines]
            for i in range(len(fit) - 2, -1, -1):
                fit[i] = min(fit[i], fit[i + 1])
            self._smooth = {t: f for (t, _), f in zip(pts, fit)}
            self._slopes = {t: max(0.0, d) for (t, _), (_, d) in zip(pts, lines) if d is not None}
        return self._smooth


def _line_at(t: int, own: float, sums: list[float]) -> tuple[float, float | None]:
    """(value at t, slope) of the least-squares line through the points whose sums of (1, x, y, x^2, xy) are given;
    with fewer than three points, (t's own measurement, None)."""
    n, sx, sy, sxx, sxy = sums
    if n < 3:
        return own, None
    slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    return (sy + slope * (n * t - sx)) / n, slope


def _rate(
    cost: CostModel,
    acc: AcceptanceEstimate,
    k_min: int,
    k_max: int,
    drafter: str,
    batch: int = 1,
    rows: int | None = None,
) -> tuple[int, float]:
    """(k, expected tokens per second) for the best k in [k_min, k_max], or k = 0 (plain decoding), for a sequence
    in a step over `batch` sequences: its share of the plain forward plus the rows its draft adds to a forward of
    `rows` tokens (default `batch`; batch 1: the whole forward over its k + 1 tokens)."""
    draft_s = cost.draft_cost(drafter)
    rows = batch if rows is None else rows
    base = cost.verify_cost(rows)
    share = plain_cost(cost, batch)
    best_k, best_rate = 0, 1.0 / share
    expected = 1.0  # the bonus token always comes
    for k, survive in enumerate(acc.survival(k_max), start=1):
        expected += survive
        if k < k_min:
            continue
        rate = expected / (k * draft_s + share + cost.verify_cost(rows + k) - base)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k, best_rate


def choose_draft_len(
    cost: CostModel,
    acc: AcceptanceEstimate,
    k_min: int,
    k_max: int,
    drafter: str = "",
    batch: int = 1,
    rows: int | None = None,
) -> int:
    """The k in [k_min, k_max] (or 0) with the most expected tokens per second for `drafter` in a step over
    `batch` sequences whose forward already holds `rows` tokens (default `batch`)."""
    return _rate(cost, acc, k_min, k_max, drafter, batch, rows)[0]


def expected_saving(cost: CostModel, k_max: int, drafter: str = "", batch: int = 1) -> float:
    """Seconds per token that drafting up to k_max tokens a step saves over plain decoding in steps over `batch`
    sequences, at the best draft length and with `drafter`'s acceptance over earlier sequences (0 when drafting is
    not expected to pay)."""
    _, rate = _rate(cost, cost.acceptance(drafter), 1, k_max, drafter, batch)
    return max(0.0, plain_cost(cost, batch) - 1.0 / rate)


def failed_share(cost: CostModel, drafter: str = "", batch: int = 1, rows: int | None = None) -> float | None:
    """What a failed one-token draft costs (drafting it, one more forward row), in plain tokens; None while one more
    row's cost is a warm-up's (measured once)."""
    rows = batch if rows is None else rows
    if rows + 1 in cost.once:
        return None
    failed = cost.draft_cost(drafter) + cost.verify_cost(rows + 1) - cost.verify_cost(rows)
    return failed / plain_cost(cost, batch)


def retry_pace(failed: float | None) -> float:
    """How fast an undrafted position's acceptance drifts back toward the prior (1: RELAX per step), so that at no
    acceptance at all the retries the drift leads to cost RETRY_WASTE of the time. A failed retry of share f lowers
    the estimate by EMA of itself, from the break-even rate (about f) to (1 - EMA) f, and the drift brings it back
    in EMA f / (RELAX pace (PRIOR_ACCEPT - (1 - EMA) f)) steps: a retry's share of those steps is RETRY_WASTE at the
    pace below, whatever f (where f itself is below RETRY_WASTE, retrying every step costs no more: full pace). At
    the pace of RETRY_WASTE / f, a never-accepted synthetic drafter on the Qwen3-30B-A3B shape drafted 55 single
    tokens in its first 256-token request (`specdec bench ... --spec-synth-rates 0.0`). `failed`: `failed_share`."""
    if failed is None or failed <= RETRY_WASTE:  # unmeasured (a warm-up's), or cheap: retry at the full pace
        return 1.0
    gap = PRIOR_ACCEPT - (1 - EMA) * failed
    return 1.0 if gap <= 0 else min(1.0, RETRY_WASTE * EMA / (RELAX * gap))


def probe_every(failed: float | None) -> float:
    """Undrafted steps between one-token probes: PROBE_EVERY, or more where a failed probe (`failed`:
    `failed_share`) costs more than PROBE_EVERY / 4 * RETRY_WASTE plain tokens, so probes cost at most a quarter of
    RETRY_WASTE of the time."""
    return PROBE_EVERY if failed is None else max(PROBE_EVERY, 4 * failed / RETRY_WASTE)


def plain_cost(cost: CostModel, batch: int = 1) -> float:
    """Seconds per token of plain decoding in steps over `batch` sequences: what a token a draft gets accepted
    saves."""
    return cost.verify_cost(batch) / batch
