"""Continuous batching: batched greedy output equals single-request output (fp32); cancel frees slots;
the load controller turns speculation off when measured goodput says so."""

import specdec
from specdec.engine.engine import StepInfo
from specdec.engine.load_control import LoadController
from specdec.engine.scheduler import QueueFull, Request, Scheduler
from specdec.sampling import SamplingParams

PROMPTS = [
    "t5 t9 t12 t5 t9 t12 t5 t9",
    "t33 t2 t71",
    "t8 " * 20 + "t4",
    "t60",
    "t1 t2 t3 t1 t2 t3 t1 t2",
    "t40 t41 t40 t41",
    "t7 " * 30,
    "t90 t91",
]
SPECS = ["none", "draft", "ngram-simple", "suffix", "ngram-mod", "ngram-map-k", "draft", "ngram-mod,draft"]


def _llm(tiny_dir, **kw):
    llm = specdec.LLM(
        str(tiny_dir("llama")),
        draft=str(tiny_dir("llama", seed=1, layers=1)),
        spec_type="none",
        dtype="fp32",
        context=64,
        progress=False,
        parallel=4,
        **kw,
    )
    llm.engine.stop_ids = set()
    return llm


def _run(sched, reqs, submit=True):
    for r in reqs if submit else ():
        sched.submit(r)
    for _ in range(10_000):
        if all(r.seq is not None and r.seq.finish_reason for r in reqs):
            return
        sched.run_once()
    raise AssertionError("requests did not finish")


def test_batched_greedy_equals_single_requests(tiny_dir):
    # fixed draft lengths and no load controller: every drafter drafts at every step (adaptive lengths, and the
    # controller's plain and light arms under load, could leave nothing drafted to check)
    llm = _llm(tiny_dir, draft_branch_p=0.5, adaptive=False)
    # the n-gram drafters also on a prompt whose output repeats itself (t80 t80 ...): their drafts are accepted
    repeats = ["ngram-simple", "ngram-mod", "ngram-map-k", "ngram-mod,draft"]
    prompts, specs = PROMPTS + [PROMPTS[2]] * len(repeats), SPECS + repeats
    lens = [30, 7, 12, 40, 25, 3, 20, 33] + [30] * len(repeats)
    bases = [llm.generate(p, max_tokens=n, spec_type="none").token_ids for p, n in zip(prompts, lens)]
    sched = Scheduler(llm.engine, 4, controller=None, prefill_chunk=5)
    texts = [[] for _ in prompts]
    reqs = [
        Request(llm.encode(p), SamplingParams(max_tokens=n), llm.drafter_for(s), on_text=texts[i].append)
        for i, (p, n, s) in enumerate(zip(prompts, lens, specs))
    ]
    _run(sched, reqs)
    stats = {s: [0, 0] for s in specs if s != "none"}  # spec -> [drafted, accepted]
    for r, base, t, s in zip(reqs, bases, texts, specs):
        assert r.seq.output_ids == base, s
        assert "".join(t) == r.seq.text
        if s != "none":
            stats[s][0] += r.seq.stats.drafted
            stats[s][1] += r.seq.stats.accepted
    assert sorted(sched.free) == [0, 1, 2, 3] and sched.steps > 0
    # the draft model: drafted only, a random one (seed 1) is right by chance alone
    assert all(d > 0 and (a > 0 or s == "draft") for s, (d, a) in stats.items()), stats


def test_cancel_frees_the_slot_and_spares_the_others(tiny_dir):
    llm = _llm(tiny_dir)
    base = llm.generate(PROMPTS[0], max_tokens=30, spec_type="draft").token_ids
    sched = Scheduler(llm.engine, 2, max_queue=2)
    done = []
    a = Request(llm.encode(PROMPTS[0]), SamplingParams(max_tokens=30), llm.drafter_for("draft"), on_done=done.append)
    b = Request(llm.encode(PROMPTS[1]), SamplingParams(max_tokens=30), on_done=done.append)
    sched.submit(a)
    sched.submit(b)
    sched.run_once()
    sched.run_once()
    sched.cancel(b)
    _run(sched, [a], submit=False)
    assert b.seq.finish_reason == "cancelled" and b in done
    assert a.seq.output_ids == base
    assert sorted(sched.free) == [0, 1]
    for _ in range(4):  # two for the free slots, two waiting (max_queue=2)
        sched.submit(Request([1], SamplingParams()))
    try:
        sched.submit(Request([1], SamplingParams()))
        raise AssertionError("queue limit not enforced")
    except QueueFull:
        pass


def test_bad_request_is_reported_not_raised(tiny_dir):
    llm = _llm(tiny_dir)
    bad = Request(list(range(1, 80)), SamplingParams())  # longer than the context of 64
    ok = Request(llm.encode(PROMPTS[1]), SamplingParams(max_tokens=5))
    sched = Scheduler(llm.engine, 2)
    sched.submit(bad)
    _run(sched, [ok])
    assert bad.error and "context" in bad.error and len(ok.seq.output_ids) == 5


def _step(batch, committed, drafted, draft_s, forward_s):
    return StepInfo(batch, committed, drafted, batch + drafted, forward_s, draft_s, draft_s + forward_s)


def test_load_controller_speculates_at_low_load_and_stops_at_high_load():
    c = LoadController(draft_max=8)
    # batch 1: drafting 4 tokens costs 0.1 s, the forward barely grows, 3 tokens come out per step
    for _ in range(6):
        arm = c.choose(1)
        if arm == 0:
            c.observe(arm, _step(1, 1, 0, 0.0, 0.25))
        else:
            c.observe(arm, _step(1, 3, 4, 0.1, 0.26))
    assert c.choose(1) != 0
    # batch 16: the forward is compute-bound (0.05 s per token beyond 16)
    for _ in range(30):
        arm = c.choose(16)
        if arm == 0:
            c.observe(arm, _step(16, 16, 0, 0.0, 0.5))
        else:
            c.observe(arm, _step(16, 48, 64, 1.6, 0.5 + 0.05 * 64))
    assert c.choose(16) == 0
    assert c.choose(1) != 0
    assert c.report()["16"]["chosen"] == "off"


def _plain_and_spec(
    setup_every: int = 0, setup_s: float = 0.0, steps: int = 200, start: LoadController | None = None
) -> tuple[LoadController, int]:
    """A controller at batch 1 where plain decoding gives 1 token per 0.25 s and speculation 3 per 0.625 s (1.2x),
    plus a catch-up of `setup_s` on every `setup_every`-th speculative step (a new request); and how many of the
    `steps` it speculated."""
    c = start or LoadController(draft_max=8, arms=(0, 4, None))  # no light arm: every drafting step pays catch-ups
    if start is None:  # both arms measured once, as a server has them after its first requests
        c.observe(0, _step(1, 1, 0, 0.0, 0.25))
        c.observe(None, _step(1, 3, 4, 0.1, 0.525))
    spec = 0
    for _ in range(steps):
        arm = c.choose(1)
        info = _step(1, 1, 0, 0.0, 0.25) if arm == 0 else _step(1, 3, 4, 0.1, 0.525)
        if arm != 0:
            spec += 1
            info.setup_s = setup_s if setup_every and spec % setup_every == 1 else 0.0
        c.observe(arm, info)
    return c, spec


def test_load_controller_counts_a_draft_models_catch_up():
    """Speculation that gains 1.2x per step but pays a catch-up on every new prompt (3 s per 33-token request) runs
    on far fewer steps than the same steps without the catch-up, which run on nearly all. The catch-up is spread
    over the tokens after it."""
    (_, fast), (slow, slow_steps) = _plain_and_spec(), _plain_and_spec(setup_every=11, setup_s=3.0)
    assert fast > 0.9 * 200
    assert slow_steps < 0.6 * fast and slow.setup > 0.005  # seconds per committed token


def test_load_controller_forgets_a_paid_catch_up():
    """One catch-up (3 s) rules speculation out for a while; plain steps wear the charge down (no catch-up is paid
    in them), and speculation, 1.2x per step, comes back."""
    c, _ = _plain_and_spec(steps=0)
    info = _step(1, 3, 4, 0.1, 0.525)
    info.setup_s = 3.0
    c.observe(None, info)
    assert c.choose(1) == 0
    assert _plain_and_spec(steps=300, start=c)[0].choose(1) != 0


def test_a_failing_sequence_ends_alone(tiny_dir):
    """A sequence whose verification raises ends with an error; the rest of its batch is untouched."""
    llm = _llm(tiny_dir)
    base = llm.generate(PROMPTS[0], max_tokens=20, spec_type="none").token_ids
    sched = Scheduler(llm.engine, 2)
    good = Request(llm.encode(PROMPTS[0]), SamplingParams(max_tokens=20))
    bad = Request(llm.encode(PROMPTS[1]), SamplingParams(max_tokens=20))
    sched.submit(good)
    sched.submit(bad)
    sched.run_once()  # both prefilled
    real = llm.engine._verify

    def verify(seq, *args):
        if seq is bad.seq:
            raise RuntimeError("probability tensor contains nan")
        return real(seq, *args)

    llm.engine._verify = verify
    _run(sched, [good], submit=False)
    assert good.seq.output_ids == base and good.error is None
    assert bad.seq.finish_reason == "error" and "nan" in bad.error
    assert sorted(sched.free) == [0, 1]


def test_tiny_temperatures_are_greedy():
    assert SamplingParams(temperature=1e-300).greedy and not SamplingParams(temperature=0.1).greedy


def test_the_engine_thread_hands_freed_heap_back_when_idle(tiny_dir, monkeypatch):
    """Going idle after a request, the loop trims the heap (a server's RSS would otherwise stay at its largest
    batch's high-water mark; tests/test_soak.py bounds RSS growth). Starting, the caller's OpenMP workers end."""
    import threading

    from specdec.engine import scheduler

    trims, released = threading.Semaphore(0), []
    monkeypatch.setattr(scheduler, "release_free_memory", trims.release)
    monkeypatch.setattr(scheduler, "release_openmp_workers", lambda: released.append(threading.current_thread()))
    llm = _llm(tiny_dir)
    sched = Scheduler(llm.engine, 2)
    done = threading.Event()
    sched.start()
    assert released == [threading.current_thread()]
    try:
        assert trims.acquire(timeout=30)  # idle at start
        sched.submit(Request(llm.encode(PROMPTS[0]), SamplingParams(max_tokens=5), on_done=lambda _: done.set()))
        assert done.wait(30) and trims.acquire(timeout=30)  # idle again after the request
    finally:
        sched.stop(timeout=30)


def test_a_thread_can_end_its_openmp_workers():
    """`Scheduler.start` ends its caller's OpenMP workers (that thread loaded the model; it does not decode): with
    more pooled threads than CPUs libgomp hardly spins between parallel regions, which made the engine thread's
    forwards ~25% slower."""
    import os
    import threading

    import torch

    from specdec.runtime.cpu import release_openmp_workers

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        results = []
        t = threading.Thread(
            target=lambda: (
                torch.ones(1 << 22).exp_().sum(),
                results.append(threads()),
                release_openmp_workers(),
                results.append(threads()),
            )
        )
        t.start()
        t.join()
    finally:
        torch.set_num_threads(n)
    assert results[0] - results[1] == 1  # the thread's pool had one worker (2 threads); released


def test_load_controller_drops_a_losing_arm_at_one_client():
    """At load 1 plain decoding is measured by the plain steps the engine runs now and then to measure it (StepInfo.cap
    0, engine/adaptive.py REMEASURE), not guessed from the 17-token verifications: a drafting arm that gives 4 tokens/s
    where plain decoding gives 6.7 is dropped."""
    c = LoadController(draft_max=16)
    for i in range(40):
        arm = c.choose(1)
        plain = arm == 0 or i % 20 == 0  # the engine's own plain steps where the controller asked for drafts
        c.observe(0 if plain else arm, _step(1, 1, 0, 0.0, 0.15) if plain else _step(1, 2, 16, 0.0, 0.5))
    assert c.choose(1) == 0


def test_under_load_the_controller_tries_only_the_light_arm_until_speculation_was_measured():
    """A fresh server at load 8 knows nothing of speculation: it never tries drafting with every part there (a draft
    model would catch up on 8 prompts), only the light arm (model-free parts), kept while it beats plain decoding; a
    losing light arm is re-run (two steps) every LIGHT_TTL steps."""
    from specdec.engine.load_control import LIGHT, LIGHT_TTL

    for light_s, want in ((0.06, LIGHT), (0.2, 0)):  # light steps: 16 tokens in 0.06 s (wins) or 0.2 s (loses)
        c, arms = LoadController(draft_max=8), []
        c.observe(0, _step(8, 8, 0, 0.0, 0.05))  # the engine's first step at a new batch size runs plain
        for _ in range(40):
            arms.append(c.choose(8))
            c.observe(arms[-1], _step(8, 16, 10, 0.001, light_s) if arms[-1] == LIGHT else _step(8, 8, 0, 0.0, 0.05))
        assert LIGHT in arms and set(arms) <= {0, LIGHT}
        assert arms[4:].count(want) >= len(arms[4:]) * LIGHT_TTL / (LIGHT_TTL + 3), (want, arms)
    assert LoadController(draft_max=8).choose(1) is None  # at low load: every part


def test_low_load_tries_every_part_only_on_new_requests():
    """Before speculation with every part was measured, a low load tries it only within EXPLORE_FRESH steps of an
    admission: the tail of a wave (sequences near their ends) cannot repay a draft model's catch-up."""
    from specdec.engine.load_control import EXPLORE_FRESH, LIGHT

    c = LoadController(draft_max=8)
    c.admit()
    assert c.choose(1) is None
    for _ in range(EXPLORE_FRESH + 1):
        c.observe(0, _step(1, 1, 0, 0.0, 0.02))
    assert c.choose(1) in (0, LIGHT)
    c.admit()
    assert c.choose(1) is None


def test_light_steps_draft_with_model_free_parts_only(tiny_dir):
    """The light arm asks only a chain's model-free members: the draft model never drafts nor catches up, and the
    output is the target's own."""
    from specdec.engine.load_control import LIGHT

    llm = _llm(tiny_dir)
    llm.engine.spec.adaptive = False  # draft whatever this machine's timings (the arm, not the length, is tested)
    prompt = PROMPTS[0]
    base = llm.generate(prompt, max_tokens=30, spec_type="none").token_ids
    sched = Scheduler(llm.engine, 4, controller=LoadController(8, arms=(LIGHT,)), prefill_chunk=5)
    drafter = llm.drafter_for("suffix,draft")
    for _ in range(2):  # the second time the suffix drafter knows the first one's output
        req = Request(llm.encode(prompt), SamplingParams(max_tokens=30), drafter)
        _run(sched, [req])
        assert req.seq.output_ids == base
    assert req.seq.stats.drafted > 0 and req.seq.stats.accepted > 0
    assert "draft" not in llm.engine.cost.draft_s and "draft" not in llm.engine.cost.setup_s


def test_a_drafting_arm_is_measured_afresh_once_the_batch_turned_over():
    """Light steps lost while the first requests ran (nothing to draft from); once a bucket's worth of new requests
    was admitted they are run again and win (a second wave drafts from the first one's outputs), long before their
    ttl would have expired."""
    from specdec.engine.load_control import LIGHT

    c = LoadController(draft_max=8)
    c.observe(0, _step(8, 8, 0, 0.0, 0.05))
    for light in ((9, 0.2), (16, 0.06)):  # first wave: light loses; second: it wins
        for _ in range(10):
            arm = c.choose(8)
            c.observe(arm, _step(8, light[0], 10, 0.001, light[1]) if arm == LIGHT else _step(8, 8, 0, 0.0, 0.05))
        assert c.choose(8) == (0 if light[1] > 0.1 else LIGHT)
        for _ in range(8):
            c.admit()


def test_the_light_arm_is_re_run_every_ttl_steps_however_often_it_lost():
    """Plain decoding's average is refreshed by every plain step, the light arm's only by its two-step re-runs: a
    light arm that loses narrowly (noise) is tried again every LIGHT_TTL steps of its bucket, its ttl never doubled
    (a losing arm with every part waits twice as long each time)."""
    from specdec.engine.load_control import LIGHT, LIGHT_TTL

    c = LoadController(draft_max=8)
    c.observe(0, _step(8, 8, 0, 0.0, 0.05))
    arms = []
    for _ in range(8 * LIGHT_TTL):
        arms.append(c.choose(8))
        c.observe(arms[-1], _step(8, 8, 4, 0.001, 0.052) if arms[-1] == LIGHT else _step(8, 8, 0, 0.0, 0.05))
    runs = [i for i, a in enumerate(arms) if a == LIGHT and (i == 0 or arms[i - 1] != LIGHT)]  # each re-run's start
    assert len(runs) >= 7 and all(b - a <= LIGHT_TTL + 3 for a, b in zip(runs, runs[1:])), arms
    assert arms.count(0) > arms.count(LIGHT)
