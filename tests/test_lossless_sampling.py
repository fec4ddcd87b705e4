"""Sampling is lossless through the whole engine, for every spec type.

A tiny engineered target (a second-order Markov table with peaked rows) and a draft model that is
more sure of itself than the target (q near 0.9 where p is near 0.5: the case where cutting a draft
on the drawn token's probability biases the output). Every configuration's runs go through
`Engine` (batched steps, adaptive lengths up to 4 drafts, p-min, trees, chains) for six output tokens: the prefill's,
then tokens drafted and verified over one or several steps. Their distribution must match plain sampling, computed
exactly from the table, on every window checked: each position alone, each pair and each triple of consecutive
positions (six tokens jointly would need far more runs): chi-square p above 0.001 / windows (0.001 for the whole
check) and, on the triples, total variation below `tv_bound` (1.4x what exact samples give). The draft model's chain
and tree (q surer than p: where a biased rule shows most) run 20,000 times; every other configuration 8,000.
Negative controls: verifiers biased only past the second drafted token must fail the same check, on tokens 4-6.
A target with recurrent layers (Qwen3.5) gets trees cut to their first path and early-exit drafts without resume:
the same check.
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
from specdec.engine import engine as engine_module
from specdec.engine.engine import Engine, SpecConfig
from specdec.models.tokenizer import Tokenizer
from specdec.runtime.runner import Features
from specdec.sampling import SamplingParams, probs_from_logits, sample
from specdec.verify import verify_tree_sampling

V = 6  # token 0 is EOS and never drawn; 1..5 cycle 1 -> 2 -> ... -> 5 -> 1
PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
RUNS = 20_000
RUNS_MATRIX = 8_000  # the other configurations: the same test at a 1.6x wider bound, 2.5x cheaper
BATCH = 500  # sequences stepped together
MAX_TOKENS = 6  # the first output token is the prefill's; drafts cover tokens 2..6
DRAFT_MAX = 4  # so tokens 4..6 are often a later verify step's, or a chain's third or fourth draft
P_MIN = 0.5
ALPHA = 1e-3  # the chance that exact samples fail one configuration's check (all its windows together)


def _table(seed: int, sure: float, noise: float) -> torch.Tensor:
    """Logits [V, V, V]: row (previous, current) scores the next token; the cycle's next token gets
    `sure` extra, EOS is impossible."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(V, V, V, generator=g) * noise
    for cur in range(1, V):
        t[:, cur, cur % (V - 1) + 1] += sure
    t[..., 0] = float("-inf")
    return t


TARGET = _table(0, sure=2.0, noise=1.0)  # p(next in cycle) 0.3-0.86
DRAFT = _table(1, sure=2.5, noise=0.5)  # q(next in cycle) 0.55-0.9: often above P_MIN, the rest below


class MarkovRunner:
    """ModelRunner's interface over a Markov table: the logits after a token are table[previous, token].
    Its 'KV cache' is the token at each position of each slot."""

    capture = features = prefix = None  # no target features, no prefix cache

    def __init__(self, table: torch.Tensor, num_slots: int, context: int = 64, recurrent: bool = False):
        self.table, self.context, self.recurrent = table, context, recurrent  # recurrent: the engine sends chains
        self.hist = [[0] * (context + 64) for _ in range(num_slots)]  # [slots][positions]
        self.tree: dict[int, list[int]] = {}
        self.model = SimpleNamespace(config=SimpleNamespace(eos_token_ids=[0], vocab_size=V, num_layers=1))

    @property
    def vocab_size(self) -> int:
        return V

    def forward(self, chunks, starts, slots, last_only=False, resume=None, resume_layer=0, settle=True):
        """Rows from the tokens alone (a resumed forward's rows are the same), all chunks' in one lookup; with
        `capture` set (an early-exit draft), `features` of one zero-width row per token, as many as the verify's
        resume rows."""
        prev, tokens = [], []
        for c, s, slot in zip(chunks, starts, slots):
            h = self.hist[slot]
            prev += [h[s - 1] if s > 0 else 0, *c[:-1]][: len(c)]
            tokens += c
            h[s : s + len(c)] = c
        rows = self.table[torch.tensor(prev), torch.tensor(tokens)].split([len(c) for c in chunks])  # [T, V] each
        out = [r[-1:] if last_only else r for r in rows]
        if self.capture is not None:
            self.features = [Features(torch.zeros(len(c), 0, 1), torch.zeros(len(c), 1)) for c in chunks]
        return out

    def prefill(self, tokens, slot, start=0):
        return self.forward([tokens], [start], [slot], last_only=True)[0][-1]

    def verify_tree(self, slot, start, tokens, parents):
        assert not self.recurrent, "a tree sent to a recurrent target"
        before = self.hist[slot][start - 1] if start > 0 else 0
        prev = [before] + [tokens[p + 1] for p in parents]
        self.hist[slot][start] = tokens[0]
        self.tree[slot] = tokens
        return self.table[torch.tensor(prev), torch.tensor(tokens)]  # [T, V]

    def keep_path(self, slot, start, path):
        for depth, node in enumerate(path, start=1):
            self.hist[slot][start + depth] = self.tree[slot][node + 1]


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


def _drafter(
    spec: str,
    p_min: float = P_MIN,
    branch_p: float = 0.0,
    mode: str = "first",
    target: MarkovRunner | None = None,
    vocab: int = V,
):
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


def _engine(tokenizer: Tokenizer, recurrent: bool = False) -> Engine:
    engine = Engine(
        MarkovRunner(TARGET, BATCH, recurrent=recurrent),
        tokenizer,
        SpecConfig(draft_max=DRAFT_MAX, adaptive=True),
        clock=TickClock(),
    )
    engine.cost.verify_s = {k: 1.0 + 0.05 * min(k, 6) for k in range(1, BATCH + 1)}  # every batch's plain cost known
    engine.cost.ema, engine.cost.smooth = 0.0, False  # costs stay as set: deterministic adaptive lengths
    return engine


def run_engine(
    engine: Engine, drafter, params: SamplingParams, runs: int = RUNS, seeds: bool = False
) -> dict[int, tuple[int, ...]]:
    """Run index -> its MAX_TOKENS output tokens. `seeds`: run i has seed i (the seeded path); otherwise
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
            assert len(s.output_ids) == MAX_TOKENS, s.output_ids
            out[b0 + j] = tuple(s.output_ids)
    return out


def exact_windows(params: SamplingParams) -> dict[tuple[int, ...], dict[tuple[int, ...], float]]:
    """Window (output positions, from 1) -> P(its tokens) under plain sampling from TARGET: every position alone, every
    pair and every triple of consecutive positions up to MAX_TOKENS."""
    probs = probs_from_logits(TARGET.reshape(V * V, V), params).reshape(V, V, V).double()  # [prev, cur, next]
    pairs = [torch.zeros(V, V, dtype=torch.float64)]  # [i]: P(tokens at positions i-1, i); [0]: the prompt's last 2
    pairs[0][PROMPT[-2], PROMPT[-1]] = 1
    for _ in range(MAX_TOKENS):
        pairs.append((pairs[-1][..., None] * probs).sum(0))  # [cur, next]
    tables = {(i,): pairs[i].sum(0) for i in range(1, MAX_TOKENS + 1)}
    tables |= {(i, i + 1): pairs[i + 1] for i in range(1, MAX_TOKENS)}
    tables |= {(i, i + 1, i + 2): pairs[i + 1][..., None] * probs for i in range(1, MAX_TOKENS - 1)}
    return {w: {c: float(t[c]) for c in itertools.product(range(V), repeat=len(w))} for w, t in tables.items()}


def rejected(samples: list[tuple[int, ...]], params: SamplingParams) -> dict[tuple[int, ...], tuple[float, float]]:
    """The windows on which `samples` (each MAX_TOKENS output tokens) fail plain sampling -> (chi-square p-value,
    total variation): p-value below ALPHA / windows or, on a triple (many cells: its total variation stays near its
    mean, a single position's does not), total variation above `tv_bound`."""
    windows = exact_windows(params)
    out = {}
    for w, want in windows.items():
        p_value, tv = fit([tuple(s[i - 1] for i in w) for s in samples], want)
        if p_value < ALPHA / len(windows) or (len(w) == 3 and tv >= tv_bound(want, len(samples))):
            out[w] = (p_value, tv)
    return out


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
    p_value = float(
        torch.special.gammaincc(
            torch.tensor((len(obs) - 1) / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
        )
    )
    tv = 0.5 * sum(abs(counts[c] / n - p) for c, p in want.items())
    return p_value, tv


def tv_bound(want: dict[tuple[int, ...], float], n: int) -> float:
    """1.4x the total variation expected from `n` exact samples of `want` (each cell's |deviation| from its normal
    approximation; 0.021 for tokens 1-3 at T 1 and 20,000 runs here): for a triple's 125 possible cells, about 4
    standard deviations of the sum above its mean."""
    return 1.4 * 0.5 * sum(math.sqrt(2 * p * (1 - p) / (math.pi * n)) for p in want.values())


T1 = SamplingParams(temperature=1.0)
CONFIGS = [(t, T1, {}) for t in untrained_spec_types() if t != "none"] + [
    ("draft", T1, {"branch_p": 0.95}),  # tree from the draft model
    ("ngram-mod,draft", T1, {}),  # chain, first non-empty draft
    ("suffix-tree,draft", T1, {"mode": "gain", "branch_p": 0.95}),  # chain by expected gain, tree members
    ("draft", SamplingParams(temperature=1.0, top_p=0.9), {"branch_p": 0.95}),
    ("suffix,draft", SamplingParams(temperature=1.0, top_k=5), {"mode": "gain"}),
    ("draft", T1, {"vocab": 4}),  # reduced draft vocabulary: 4, 5 never drafted
    ("draft", T1, {"branch_p": 0.95, "recurrent": True}),  # a tree cut to its first path (Qwen3.5's layers)
    ("suffix-tree,early-exit", T1, {"mode": "gain", "branch_p": 0.95, "recurrent": True}),  # trees, no resume
]
FULL = {("draft", ()), ("draft", ("branch_p",))}  # (spec, options) run RUNS times at T 1; the rest RUNS_MATRIX


@pytest.mark.parametrize(
    "spec,params,opts", CONFIGS, ids=[f"{s}-{p.top_p}-{p.top_k}-{'-'.join(o)}" for s, p, o in CONFIGS]
)
def test_engine_sampling_matches_plain(tokenizer, spec, params, opts):
    runs = RUNS if params is T1 and (spec, tuple(opts)) in FULL else RUNS_MATRIX
    opts = dict(opts)
    engine = _engine(tokenizer, opts.pop("recurrent", False))
    samples = list(run_engine(engine, _drafter(spec, target=engine.target, **opts), params, runs).values())
    assert not rejected(samples, params)


def test_seeded_output_is_the_same_for_every_drafter(tokenizer):
    """Seeded runs: token-identical to plain decoding with that seed whatever drafts, and (over seeds)
    distributed as plain sampling."""
    params = SamplingParams(temperature=1.0, top_p=0.95)
    plain = run_engine(_engine(tokenizer), None, params, runs=2000, seeds=True)
    for spec, opts in [("draft", {"branch_p": 0.95}), ("suffix-tree", {}), ("ngram-mod,draft", {})]:
        assert run_engine(_engine(tokenizer), _drafter(spec, **opts), params, runs=2000, seeds=True) == plain
    assert not rejected(list(plain.values()), params)


def test_light_steps_keep_sampling_lossless(tokenizer):
    """The load controller's light arm (every other step here) narrows which chain members draft, before anything is
    drawn: the output is still distributed as plain sampling."""
    engine = _engine(tokenizer)
    step, n = engine.step, itertools.count()
    engine.step = lambda seqs, cap=None: step(seqs, cap, light=next(n) % 2 == 0)
    samples = list(run_engine(engine, _drafter("ngram-mod,draft", target=engine.target), T1, RUNS_MATRIX).values())
    assert {"ngram-mod", "draft"} <= set(engine.cost.draft_s)  # both drafted
    assert not rejected(samples, T1)


def _depths(parents: list[int]) -> list[int]:
    """Each node's depth in its tree: the drafts before it on its path."""
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth


def q_read_small(boost: float, past: int):
    """`verify_tree_sampling` reading the draft's probabilities `boost` times too small at nodes `past` or more drafts
    deep: there a drafted token is accepted with probability min(1, boost p/q), and the residual is off too."""

    def verify(tokens, parents, draft_probs, *args, **kw):
        deep = [i for i, d in enumerate(_depths(parents)) if d >= past]
        if draft_probs is not None and deep:
            draft_probs = draft_probs.clone()
            draft_probs[deep] /= boost
        return verify_tree_sampling(tokens, parents, draft_probs, *args, **kw)

    return verify


def no_residual(past: int):
    """`verify_tree_sampling` that, where it rejects the drafts after `past` or more accepted ones, draws the target's
    token from p itself instead of the residual norm(max(p - q, 0))."""

    def verify(tokens, parents, draft_probs, target_logits, params, generator, relax=None):
        new, path = verify_tree_sampling(tokens, parents, draft_probs, target_logits, params, generator, relax)
        at = path[-1] if path else -1
        if len(path) >= past and at in parents:  # the last accepted node had children: all rejected
            new[-1] = int(sample(probs_from_logits(target_logits[at + 1 : at + 2], params), generator)[0])
        return new, path

    return verify


BIASED = {  # name -> (verifier, runs): enough for p-values far below the check's (1e-22 and 1e-13 here)
    "q-read-small": (q_read_small(1.5, past=2), RUNS_MATRIX),
    "no-residual": (no_residual(past=2), 12_000),  # a subtler bias: 8,000 runs reject it at p 1e-6 only
}


@pytest.mark.parametrize("rule", list(BIASED))
def test_check_rejects_a_biased_verifier(tokenizer, monkeypatch, rule):
    """Negative control: the engine with a verifier biased only from its third draft on (tokens 4-6, after one step or
    several) fails the check, on windows past token 3 alone, where a check of the first three tokens cannot look."""
    verify, runs = BIASED[rule]
    monkeypatch.setattr(engine_module, "verify_tree_sampling", verify)
    engine = _engine(tokenizer)
    samples = list(run_engine(engine, _drafter("draft", target=engine.target), T1, runs).values())
    found = rejected(samples, T1)
    assert found, "the check passed a biased verifier"
    assert all(max(w) >= 4 for w in found), found  # tokens 1-3 are unbiased: nothing there is rejected
