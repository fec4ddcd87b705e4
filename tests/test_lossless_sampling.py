"""Sampling is lossless through the whole engine, for every spec type.

A tiny engineered target (a second-order Markov table with peaked rows) and a draft model that is
more sure of itself than the target (q near 0.9 where p is near 0.5: the case where cutting a draft
on the drawn token's probability biases the output). Every configuration's runs go through
`Engine` (batched steps, adaptive lengths, p-min, trees, chains); the joint distribution of the
first three output tokens must match plain sampling, computed exactly from the table:
chi-square p > 0.001 and total variation below `tv_bound` (1.4x what exact samples give). The draft model's chain and
tree (q surer than p: where a biased rule shows most) run 20,000 times; every other configuration 8,000.
"""
from __future__ import annotations

import itertools
import math
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from conftest import untrained_spec_types, word_tokenizer
from specdec.drafters import REGISTRY, BuildContext, build_drafter
from specdec.drafters.chain import ChainDrafter
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.early_exit import EarlyExitDrafter
from specdec.engine.engine import Engine, SpecConfig
from specdec.models.tokenizer import Tokenizer
from specdec.runtime.runner import Features
from specdec.sampling import SamplingParams, probs_from_logits

V = 6                      # token 0 is EOS and never drawn; 1..5 cycle 1 -> 2 -> ... -> 5 -> 1
PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
RUNS = 20_000
RUNS_MATRIX = 8_000        # the other configurations: the same test at a 1.6x wider bound, 2.5x cheaper
BATCH = 500                # sequences stepped together
MAX_TOKENS = 6             # the first output token is the prefill's; drafts cover tokens 2..6
P_MIN = 0.5


def _table(seed: int, sure: float, noise: float) -> torch.Tensor:
    """Logits [V, V, V]: row (previous, current) scores the next token; the cycle's next token gets
    `sure` extra, EOS is impossible."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(V, V, V, generator=g) * noise
    for cur in range(1, V):
        t[:, cur, cur % (V - 1) + 1] += sure
    t[..., 0] = float("-inf")
    return t


TARGET = _table(0, sure=2.0, noise=1.0)   # p(next in cycle) 0.3-0.86
DRAFT = _table(1, sure=2.5, noise=0.5)    # q(next in cycle) 0.55-0.9: often above P_MIN, the rest below


class MarkovRunner:
    """ModelRunner's interface over a Markov table: the logits after a token are table[previous, token].
    Its 'KV cache' is the token at each position of each slot."""

    capture = features = prefix = None  # no target features, no prefix cache

    def __init__(self, table: torch.Tensor, num_slots: int, context: int = 64):
        self.table, self.context = table, context
        self.hist = torch.zeros(num_slots, context + 64, dtype=torch.long)  # [slots, positions]
        self.tree: dict[int, list[int]] = {}
        self.model = SimpleNamespace(config=SimpleNamespace(eos_token_ids=[0], vocab_size=V, num_layers=1))

    @property
    def vocab_size(self) -> int:
        return V

    def _rows(self, slot: int, start: int, tokens: list[int], prev: list[int] | None = None) -> torch.Tensor:
        before = int(self.hist[slot, start - 1]) if start > 0 else 0
        prev = [before] + tokens[:-1] if prev is None else prev
        return self.table[torch.tensor(prev), torch.tensor(tokens)]  # [T, V]

    def forward(self, chunks, starts, slots, last_only=False, resume=None, resume_layer=0):
        """Rows from the tokens alone (a resumed forward's rows are the same); with `capture` set (an early-exit
        draft), `features` of one zero-width row per token, as many as the verify's resume rows."""
        out = []
        for c, s, slot in zip(chunks, starts, slots):
            rows = self._rows(slot, s, c)
            self.hist[slot, s:s + len(c)] = torch.tensor(c)
            out.append(rows[-1:] if last_only else rows)
        if self.capture is not None:
            self.features = [Features(torch.zeros(len(c), 0, 1), torch.zeros(len(c), 1)) for c in chunks]
        return out

    def prefill(self, tokens, slot, start=0):
        return self.forward([tokens], [start], [slot], last_only=True)[0][-1]

    def verify_tree(self, slot, start, tokens, parents):
        before = int(self.hist[slot, start - 1]) if start > 0 else 0
        prev = [before] + [tokens[p + 1] for p in parents]
        self.hist[slot, start] = tokens[0]
        self.tree[slot] = tokens
        return self._rows(slot, start, tokens, prev)

    def keep_path(self, slot, start, path):
        for depth, node in enumerate(path, start=1):
            self.hist[slot, start + depth] = self.tree[slot][node + 1]


class TickClock:
    """A virtual clock: every reading is `tick` seconds after the last, so measured costs (and the
    adaptive lengths read from them) are the same on every run."""

    def __init__(self, tick: float = 0.3):
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: intra-op threads only wait on each other (and on a busy machine, for long)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    d = tmp_path_factory.mktemp("markov-tok")
    word_tokenizer(d, V)
    return Tokenizer(d)


def _drafter(spec: str, p_min: float = P_MIN, branch_p: float = 0.0, mode: str = "first",
             target: MarkovRunner | None = None, vocab: int = V):
    """`vocab`: the draft model's logits cover token ids below it only (`--draft-vocab`)."""
    parts = spec.split(",")
    if len(parts) > 1:
        return ChainDrafter([_drafter(p, p_min, branch_p, target=target) for p in parts], mode)
    if spec == "draft":
        return DraftModelDrafter(MarkovRunner(DRAFT[..., :vocab], BATCH), V, p_min=p_min, branch_p=branch_p)
    if spec == "early-exit":  # DRAFT stands for the target's first layers, writing into the target's own history
        shallow = MarkovRunner(DRAFT, BATCH)
        shallow.hist = target.hist
        return EarlyExitDrafter(shallow, V, p_min=p_min, branch_p=branch_p)
    return build_drafter(spec, BuildContext(REGISTRY.option_values({"ngram_n": 2, "ngram_m": 4})))


def _engine(tokenizer: Tokenizer) -> Engine:
    engine = Engine(MarkovRunner(TARGET, BATCH), tokenizer, SpecConfig(draft_max=4, adaptive=True),
                    clock=TickClock())
    engine.cost.verify_s = {k: 1.0 + 0.05 * min(k, 6) for k in range(1, BATCH + 1)}  # every batch's plain cost known
    engine.cost.ema, engine.cost.smooth = 0.0, False  # costs stay as set: deterministic adaptive lengths
    return engine


def run_engine(engine: Engine, drafter, params: SamplingParams, runs: int = RUNS,
               seeds: bool = False) -> dict[int, tuple[int, ...]]:
    """Run index -> first three output tokens. `seeds`: run i has seed i (the seeded path); otherwise
    run i samples from its own generator seeded with i (rejection sampling, reproducible)."""
    out: dict[int, tuple[int, ...]] = {}
    for b0 in range(0, runs, BATCH):
        seqs = []
        for j in range(min(BATCH, runs - b0)):
            p = SamplingParams(**{**params.__dict__, "seed": b0 + j if seeds else None, "max_tokens": MAX_TOKENS})
            seq = engine.new_sequence(PROMPT, p, slot=j, drafter=drafter)
            if not seeds:
                seq.generator = torch.Generator().manual_seed(b0 + j)
            engine.prefill(seq)
            seqs.append(seq)
        while live := [s for s in seqs if s.finish_reason is None]:
            engine.step(live)
        for j, s in enumerate(seqs):
            engine.finish(s)
            assert s.error is None, s.error
            out[b0 + j] = tuple(s.output_ids[:3])
    return out


def exact_joint(params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(first three output tokens) under plain sampling from TARGET."""
    probs = probs_from_logits(TARGET.reshape(V * V, V), params).reshape(V, V, V)  # [prev, cur, next]
    a, b = PROMPT[-2], PROMPT[-1]
    return {(x, y, z): float(probs[a, b, x] * probs[b, x, y] * probs[x, y, z])
            for x, y, z in itertools.product(range(V), repeat=3)}


def fit(samples: list[tuple[int, ...]], want: dict[tuple[int, ...], float]) -> tuple[float, float]:
    """(chi-square p-value, total variation) of the samples against `want`; cells expected below 5
    are pooled into one."""
    n, counts = len(samples), Counter(samples)
    big = [c for c, p in want.items() if p * n >= 5]
    obs = [counts[c] for c in big] + [n - sum(counts[c] for c in big)]
    exp = [want[c] * n for c in big] + [n * (1 - sum(want[c] for c in big))]
    if exp[-1] < 5:  # nothing (or almost nothing) to pool
        obs, exp = obs[:-1], exp[:-1]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    p_value = float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2, dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))
    tv = 0.5 * sum(abs(counts[c] / n - p) for c, p in want.items())
    return p_value, tv


def tv_bound(want: dict[tuple[int, ...], float], n: int) -> float:
    """1.4x the total variation expected from `n` exact samples of `want` (each cell's |deviation| from its normal
    approximation; 0.021 at T 1 and 20,000 runs here): about 4 standard deviations of the sum above its mean."""
    return 1.4 * 0.5 * sum(math.sqrt(2 * p * (1 - p) / (math.pi * n)) for p in want.values())


T1 = SamplingParams(temperature=1.0)
CONFIGS = [(t, T1, {}) for t in untrained_spec_types() if t != "none"] + [
    ("draft", T1, {"branch_p": 0.95}),                                    # tree from the draft model
    ("ngram-mod,draft", T1, {}),                                          # chain, first non-empty draft
    ("suffix-tree,draft", T1, {"mode": "gain", "branch_p": 0.95}),        # chain by expected gain, tree members
    ("draft", SamplingParams(temperature=1.0, top_p=0.9), {"branch_p": 0.95}),
    ("suffix,draft", SamplingParams(temperature=1.0, top_k=5), {"mode": "gain"}),
    ("draft", T1, {"vocab": 4}),                                          # reduced draft vocabulary: 4, 5 never drafted
]
FULL = {("draft", ()), ("draft", ("branch_p",))}  # (spec, options) run RUNS times at T 1; the rest RUNS_MATRIX


@pytest.mark.parametrize("spec,params,opts", CONFIGS,
                         ids=[f"{s}-{p.top_p}-{p.top_k}-{'-'.join(o)}" for s, p, o in CONFIGS])
def test_engine_sampling_matches_plain(tokenizer, spec, params, opts):
    runs = RUNS if params is T1 and (spec, tuple(opts)) in FULL else RUNS_MATRIX
    engine = _engine(tokenizer)
    samples = list(run_engine(engine, _drafter(spec, target=engine.target, **opts), params, runs).values())
    want = exact_joint(params)
    p_value, tv = fit(samples, want)
    assert p_value > 1e-3 and tv < tv_bound(want, runs), (p_value, tv)


def test_seeded_output_is_the_same_for_every_drafter(tokenizer):
    """Seeded runs: token-identical to plain decoding with that seed whatever drafts, and (over seeds)
    distributed as plain sampling."""
    params = SamplingParams(temperature=1.0, top_p=0.95)
    plain = run_engine(_engine(tokenizer), None, params, runs=2000, seeds=True)
    for spec, opts in [("draft", {"branch_p": 0.95}), ("suffix-tree", {}), ("ngram-mod,draft", {})]:
        assert run_engine(_engine(tokenizer), _drafter(spec, **opts), params, runs=2000, seeds=True) == plain
    want = exact_joint(params)
    p_value, tv = fit(list(plain.values()), want)
    assert p_value > 1e-3 and tv < tv_bound(want, len(plain)), (p_value, tv)


def test_light_steps_keep_sampling_lossless(tokenizer):
    """The load controller's light arm (every other step here) narrows which chain members draft, before anything is
    drawn: the output is still distributed as plain sampling."""
    engine = _engine(tokenizer)
    step, n = engine.step, itertools.count()
    engine.step = lambda seqs, cap=None: step(seqs, cap, light=next(n) % 2 == 0)
    samples = list(run_engine(engine, _drafter("ngram-mod,draft", target=engine.target), T1, RUNS_MATRIX).values())
    assert {"ngram-mod", "draft"} <= set(engine.cost.draft_s)  # both drafted
    want = exact_joint(T1)
    p_value, tv = fit(samples, want)
    assert p_value > 1e-3 and tv < tv_bound(want, RUNS_MATRIX), (p_value, tv)
