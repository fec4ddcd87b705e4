"""Load-aware speculation: pick each step's draft cap by goodput at the current batch size.

Speculation pays at low load and loses when the machine is busy (a batched forward over many
sequences' drafts is compute-bound, and drafting costs grow with the batch). The controller
decides by throughput, never by acceptance rate alone:

- Arms: a cap on each sequence's draft length per step; 0 = no speculation, None = no cap (each
  sequence's own adaptive length); LIGHT = no cap, but only drafter parts that run no model draft (a chain's
  suffix tree or n-grams without its draft model: no catch-ups, no draft forwards, so cheap to try under load).
- Load: the batch the engine is heading for, i.e. running plus admitted-but-prefilling plus waiting
  requests (at most the slots); measurements are kept per load up to EXACT_LOADS, per power-of-two bucket above.
  Keying by load instead of the current batch keeps a filling server from speculating through its ramp-up at high
  concurrency.
- Measured goodput: per load bucket and arm, committed tokens per second over all sequences
  (running averages of tokens and of step seconds), plus, for the arms that draft, the drafters'
  catch-up on new prompts (a draft model prefilling them, one-off per sequence) as seconds per
  committed token: a slow average over every step of any arm (SETUP_EMA), so a catch-up is spread
  over the tokens after it, and the charge fades while nothing catches up (a catch-up once paid is
  sunk: an arm must not stay ruled out by it). A measurement expires after `ttl` steps of its
  bucket (the ttl doubles each time the arm loses again, except LIGHT's: cheap to re-run), and for an
  arm that drafts once as many requests were admitted since as the bucket holds (what drafts gain
  depends on the requests: a second wave of requests like the first drafts from the first one's
  outputs): then the arm is run again for MIN_OBS steps and measured afresh.
- Predicted goodput, for arms not (or no longer) measured in a bucket: from measured parts that
  carry across batch sizes: target forward seconds by total tokens, drafting seconds per step by
  batch size (a draft model drafts a step's sequences in one batch, so its cost grows slower than
  the batch; unmeasured sizes: interpolated, or per sequence times the batch), tokens and draft
  tokens per sequence-step with that arm:
      goodput(arm, b) = b * tokens_per_seq(arm) / (draft_s(arm, b) + forward(b * (1 + drafted_per_seq(arm)))
                                                   + b * tokens_per_seq(arm) * setup_per_token)   (0 for off)
  An arm is run only when its (measured or predicted) goodput is the best, so a hopeless arm at
  high load costs nothing to rule out. Before speculation was ever measured, the uncapped arm is tried at low load
  (up to EXPLORE_LOAD) on requests just admitted (EXPLORE_FRESH) and only LIGHT otherwise; LIGHT, until measured, is
  predicted to win (it is tried).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.engine.adaptive import CostModel
from specdec.engine.engine import StepInfo

EMA = 0.25
SETUP_EMA = 0.05  # catch-up seconds per committed token: its average spreads one catch-up over ~20 steps
TTL = 48  # steps of a bucket before a losing arm's measurement expires (doubles per loss)
LIGHT_TTL = 16  # the same for LIGHT, which never doubles: its drafts stop where they do not pay, so a re-run is cheap
MAX_TTL = 1536
MIN_OBS = 2  # observations before a measured goodput replaces the prediction
EXPLORE_LOAD = 2  # the highest load at which speculation with every drafter part is tried before it was measured
# ... and only within this many steps of a request's admission: the tail of a wave of requests (a few sequences near
# their ends) explored it with a draft model catching up on long prompts, 0.2 s for 8 tokens, never repaid
# (`specdec bench serve ... --concurrency 8 --requests 8`: the controller's steps logged)
EXPLORE_FRESH = 8
# Loads up to this are measured each on its own: a bucket of 5-8 compared plain decoding measured at 8 (188 tok/s)
# with the light arm measured at 5 (102-153 tok/s, where plain made 134-148) and ran plain for 17 steps
# (`specdec bench serve ... --concurrency 8 --requests 8`, the controller's steps logged)
EXACT_LOADS = 8
LIGHT = "light"  # the arm where only model-free drafter parts draft (`Engine.step(light=True)`)
Arm = int | str | None  # a draft cap (0: off; None: no cap) or LIGHT


def bucket(batch: int) -> int:
    """Batch sizes 1 to EXACT_LOADS are their own buckets; above, 9-16, 17-32, ... -> 16, 32, ..."""
    return batch if batch <= EXACT_LOADS else 1 << (batch - 1).bit_length()


@dataclass
class _Avg:
    tokens: float = 0.0
    seconds: float = 0.0
    n: int = 0

    def add(self, tokens: float, seconds: float) -> None:
        w = 1.0 if self.n == 0 else EMA
        self.tokens += w * (tokens - self.tokens)
        self.seconds += w * (seconds - self.seconds)
        self.n += 1


@dataclass
class _ArmParts:
    """Per-sequence-step averages of one arm, over every batch size."""

    tokens: float = 1.0
    drafted: float = 0.0
    draft_s: float = 0.0
    n: int = 0
    by_batch: CostModel = field(default_factory=lambda: CostModel(ema=EMA, proportional_above=True))  # step draft s

    def add(self, info: StepInfo) -> None:
        w = 1.0 if self.n == 0 else EMA
        b = info.batch
        self.tokens += w * (info.committed / b - self.tokens)
        self.drafted += w * (info.drafted / b - self.drafted)
        self.draft_s += w * (info.draft_s / b - self.draft_s)
        self.by_batch.observe_verify(b, info.draft_s)
        self.n += 1

    def draft_cost(self, batch: int) -> float:
        """Drafting seconds of a step over `batch` sequences: interpolated between measured batch sizes,
        proportional outside them; per sequence times the batch before any is measured."""
        sizes = self.by_batch.verify_s
        if not sizes:
            return batch * self.draft_s
        lo = min(sizes)
        return sizes[lo] * batch / lo if batch < lo else self.by_batch.verify_cost(batch)


@dataclass
class _Measured:
    avg: _Avg = field(default_factory=_Avg)
    at_step: int = 0  # the bucket's step count at the last observation
    at_admitted: int = 0  # requests admitted before the last observation


class LoadController:
    def __init__(self, draft_max: int, arms: tuple[Arm, ...] | None = None):
        self.arms: tuple[Arm, ...] = arms or tuple(dict.fromkeys((0, min(4, draft_max), None, LIGHT)))
        self.parts: dict[Arm, _ArmParts] = {a: _ArmParts() for a in self.arms}
        self.forward = CostModel(ema=EMA, proportional_above=True)  # forward seconds by total tokens
        self.measured: dict[tuple[int, Arm], _Measured] = {}
        self.ttl: dict[tuple[int, Arm], int] = {}
        self.steps: dict[int, int] = {}  # bucket -> steps run
        self.chosen: dict[int, Arm] = {}  # bucket -> arm of the last step (for reports)
        self.setup = 0.0  # drafters' catch-up seconds per committed token, over every step (SETUP_EMA)
        self.admitted = 0  # requests admitted so far (`admit`)
        self.since_admit = 0  # steps since the last admission

    def admit(self) -> None:
        """A request joined the batch: once a bucket's worth have, its measurements describe other requests."""
        self.admitted += 1
        self.since_admit = 0

    def choose(self, batch: int) -> Arm:
        """The arm for the next step at load `batch`."""
        b = bucket(batch)
        unknown = None in self.arms and self.parts[None].n == 0
        if unknown and batch <= EXPLORE_LOAD and self.since_admit <= EXPLORE_FRESH:
            return None  # nothing known about speculation yet: at low load, on new requests, try every drafter part
        # Under load, before speculation with every part was measured: plain decoding or the light arm only,
        # until a quieter moment shows what the rest does.
        arms = [a for a in self.arms if not unknown or a in (0, LIGHT)]
        best = max(arms, key=lambda a: self.goodput(a, batch))
        self.chosen[b] = best
        return best

    def goodput(self, arm: Arm, batch: int) -> float:
        """Measured goodput of `arm` in this batch size's bucket while fresh; infinite for an arm measured there
        that expired or has fewer than MIN_OBS observations since (it is due to be run and measured afresh, not
        judged from averages that predate what changed); else the prediction."""
        b = bucket(batch)
        if (b, arm) in self.measured:
            return self._measured(arm, b) if self._fresh(arm, b) else float("inf")
        return self.predict(arm, batch)

    def _measured(self, arm: Arm, b: int) -> float:
        """Committed tokens per second of `arm` in bucket `b`, its catch-up per token included."""
        avg = self.measured[(b, arm)].avg
        t = avg.seconds + avg.tokens * self._setup(arm)
        return avg.tokens / t if t > 0 else 0.0

    def _setup(self, arm: Arm) -> float:
        """Catch-up seconds per committed token that `arm` is charged (none for plain decoding and LIGHT)."""
        return 0.0 if arm in (0, LIGHT) else self.setup

    def _fresh(self, arm: Arm, b: int) -> bool:
        """Measured MIN_OBS times, last within its ttl and (an arm that drafts) before fewer than `b` requests were
        admitted since."""
        m = self.measured.get((b, arm))
        return (
            m is not None
            and m.avg.n >= MIN_OBS
            and (arm == 0 or self.admitted - m.at_admitted < b)
            and self.steps.get(b, 0) - m.at_step <= self.ttl.get((b, arm), TTL)
        )

    def predict(self, arm: Arm, batch: int) -> float:
        if arm == LIGHT and not self.parts[arm].n:
            return float("inf")  # cheap to measure: tried before anything is predicted for it
        p = self.parts[arm] if self.parts[arm].n else self._scaled(arm)
        t = (
            p.draft_cost(batch)
            + self.forward.verify_cost(batch * (1 + p.drafted))
            + batch * p.tokens * self._setup(arm)
        )
        return batch * p.tokens / t if t > 0 else float("inf")

    def _scaled(self, arm: int | None) -> _ArmParts:
        """An unmeasured cap, guessed from the uncapped arm: drafts cut to the cap."""
        full = self.parts[None]
        if arm == 0:
            return _ArmParts(1.0, 0.0, 0.0, 0)
        f = min(1.0, arm / full.drafted) if full.drafted > 0 else 1.0
        by_batch = CostModel({b: s * f for b, s in full.by_batch.verify_s.items()}, ema=EMA, proportional_above=True)
        return _ArmParts(1 + (full.tokens - 1) * f, full.drafted * f, full.draft_s * f, 0, by_batch)

    def observe(self, arm: Arm, info: StepInfo, load: int | None = None) -> None:
        """A step ran with `arm` at `load` (default: its batch). A step that stepped no sequence (every
        drafter raised) measures nothing."""
        if info.batch == 0:
            return
        load = load or info.batch
        b = bucket(load)
        self.since_admit += 1
        self.steps[b] = step = self.steps.get(b, 0) + 1
        self.forward.observe_verify(info.forward_tokens, info.forward_s)
        self.setup += SETUP_EMA * (info.setup_s / max(1, info.committed) - self.setup)
        self.parts[arm].add(info)
        m = self.measured.setdefault((b, arm), _Measured())
        if m.avg.n >= MIN_OBS and not self._fresh(arm, b):
            m.avg = _Avg()  # re-examined after expiring: measured afresh
        m.avg.add(info.committed, info.seconds)
        m.at_step, m.at_admitted = step, self.admitted
        # A re-examined arm that still loses is left alone twice as long next time; LIGHT, cheap to try, is re-run
        # every LIGHT_TTL steps (two steps' averages decide it, and it loses to plain decoding's ever-fresh ones by
        # noise: a batch of code edits ran plain for 49 steps at 90 tok/s after two light steps at 71, where light
        # ran at 119-180 tok/s at other loads; `specdec bench serve`, 8 clients).
        others = [g for g in (self.goodput(a, load) for a in self.arms if a != arm) if g != float("inf")]
        key = (b, arm)
        if m.avg.n >= MIN_OBS and others and self._measured(arm, b) < max(others) and arm != LIGHT:
            self.ttl[key] = min(MAX_TTL, 2 * self.ttl.get(key, TTL // 2))
        elif m.avg.n >= MIN_OBS:
            self.ttl[key] = LIGHT_TTL if arm == LIGHT else TTL

    def report(self) -> dict:
        """Per bucket: the last chosen arm and each arm's current goodput (measured or predicted)."""
        return {
            str(b): {
                "chosen": _arm_name(self.chosen.get(b)),
                "goodput": {_arm_name(a): _rounded(self.goodput(a, b)) for a in self.arms},
            }
            for b in sorted(self.steps)
        }


def _rounded(goodput: float) -> float | None:
    """Goodput for reports: None for an arm due to be run and measured (infinite goodput)."""
    return round(goodput, 2) if goodput != float("inf") else None


def _arm_name(arm: Arm) -> str:
    return "off" if arm == 0 else "adaptive" if arm is None else arm if arm == LIGHT else f"cap{arm}"
