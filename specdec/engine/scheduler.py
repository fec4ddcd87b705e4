"""Continuous batching: requests wait in a queue, take a free KV slot, are prefilled in chunks
and then step together with every other running sequence; one engine thread does all model work."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable

from specdec.engine.engine import Engine
from specdec.engine.load_control import LIGHT, LoadController
from specdec.errors import SpecdecError
from specdec.runtime.cpu import release_free_memory, release_openmp_workers
from specdec.runtime.runner import PREFILL_CHUNK
from specdec.sampling import SamplingParams
from specdec.sequence import Drafter, RequestOptions, Sequence, StreamCallback

PREFILL_BUDGET = 2048  # prompt tokens prefilled per loop iteration, between decode steps

log = logging.getLogger(__name__)


class QueueFull(SpecdecError):
    """The waiting queue is at --max-queue."""


class EngineStopped(SpecdecError):
    """The engine thread has died: nothing more can be served."""


class Request:
    """A generation the scheduler runs: its prompt and `RequestOptions`, callbacks (`on_done` is called once, from the
    engine thread), and what became of it: its sequence, error and timings."""

    def __init__(
        self,
        prompt_ids: list[int],
        options: RequestOptions | SamplingParams,
        drafter: Drafter | None = None,
        *,
        on_text: StreamCallback | None = None,
        on_done: Callable[[Request], None] | None = None,
        **fields: Any,
    ):
        """`options`: the request's; or sampling parameters, a `drafter` and other RequestOptions `fields`."""
        self.prompt_ids = prompt_ids
        self.options = RequestOptions.of(options, drafter, **fields)
        self.on_text, self.on_done = on_text, on_done
        self.seq: Sequence | None = None
        self.error: str | None = None
        self.cancelled = False
        self.submitted = time.perf_counter()
        self.first_token_s: float | None = None  # time to first token, from submission
        self.finished_s: float | None = None  # time to the end, from submission


class Scheduler:
    """Owns the engine thread. `submit` and `cancel` are safe from any thread.

    Work that raises fails only the requests it was for. Anything else that raises in the loop fails the
    requests in flight and the loop goes on; if the loop dies anyway, every request still queued or in
    flight ends with an error, `fatal` says why and `on_fatal` is called (the server then exits)."""

    def __init__(
        self,
        engine: Engine,
        num_slots: int,
        max_queue: int = 64,
        controller: LoadController | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        prefill_budget: int = PREFILL_BUDGET,
    ):
        self.engine, self.controller, self.max_queue = engine, controller, max_queue
        self.num_slots = num_slots
        self.prefill_chunk, self.prefill_budget = prefill_chunk, prefill_budget
        self.free = list(range(num_slots))[::-1]
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.running: list[Request] = []
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.tokens_out = 0
        self.spec_steps = 0  # steps in which some sequence could draft
        self.prefill_s = 0.0  # seconds of prompt prefill (engine thread)
        self.step_s = 0.0  # seconds of decode steps: what the load controller's goodput is measured over
        self.fatal: str | None = None  # why the engine thread died
        self.on_fatal: Callable[[], None] | None = None  # called from the engine thread if it dies

    # -- any thread -------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        """Queue `req`; at most `max_queue` requests wait beyond the free slots (0: a request needs a free slot)."""
        with self._cv:
            if self.fatal:
                raise EngineStopped("the engine has stopped")
            if self._stop:
                raise QueueFull("the server is shutting down")
            if len(self.waiting) - len(self.free) >= self.max_queue:
                raise QueueFull(f"every slot is busy and the queue is full ({self.max_queue} waiting requests)")
            self.waiting.append(req)
            self._cv.notify()

    def cancel(self, req: Request) -> None:
        with self._cv:
            req.cancelled = True
            self._cv.notify()

    def start(self) -> None:
        """Start the engine thread; the caller's OpenMP workers end (they would slow the engine's)."""
        if self._thread and self._thread.is_alive():
            return
        release_openmp_workers()
        self._thread = threading.Thread(target=self._loop, name="specdec-engine", daemon=True)
        self._thread.start()

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting; finish (drain) or cancel in-flight work; join the engine thread."""
        with self._cv:
            self._stop = True
            if not drain:
                for r in [*self.waiting, *self.prefilling, *self.running]:
                    r.cancelled = True
            self._cv.notify()
        if self._thread:
            self._thread.join(timeout)

    @property
    def load(self) -> dict:
        return {
            "waiting": len(self.waiting),
            "running": len(self.running) + len(self.prefilling),
            "free_slots": len(self.free),
        }

    # -- engine thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while self._wait_for_work():
                try:
                    self.run_once()
                except Exception as e:  # noqa: BLE001 - outside any one request's work: fail what is in flight
                    log.exception("engine loop error; failing the requests in flight")
                    self._fail_in_flight(f"engine error: {type(e).__name__}: {e}")
        except BaseException as e:  # noqa: BLE001 - the thread ends here; what it leaves must not hang
            self._die(f"{type(e).__name__}: {e}")

    def _wait_for_work(self) -> bool:
        """Block until there is work; False once stopped with nothing left. Going idle, hand the heap freed by
        the last batches back to the OS first (glibc keeps it otherwise: a server's RSS would stay at the
        high-water mark of its largest batch)."""
        with self._cv:
            idle = not self._awake()
        if idle:
            release_free_memory()
        with self._cv:
            while not self._awake():
                self._cv.wait()
            return bool(self.waiting or self.prefilling or self.running)

    def _awake(self) -> bool:
        """Work to do, or a stop to act on (call holding the lock)."""
        return bool(self.waiting or self.prefilling or self.running or self._stop)

    def _fail_in_flight(self, error: str) -> None:
        """End every admitted request with `error`, freeing its slot."""
        for group in (self.prefilling, self.running):
            while group:
                self._release(group.pop(), error=error)

    def _die(self, reason: str) -> None:
        """The loop is gone: end every request (none may hang), refuse new ones, tell the owner."""
        log.critical("the engine thread died: %s", reason, exc_info=True)
        with self._cv:
            self.fatal = reason
            gone = [*self.waiting, *self.prefilling, *self.running]
            self.waiting.clear()
            self.prefilling.clear()
            self.running.clear()
        for r in gone:
            self._close(r, error=f"the engine stopped: {reason}")
        if self.on_fatal:
            self.on_fatal()

    def run_once(self) -> None:
        """Drop cancelled work, admit waiting requests, prefill up to the budget (in chunks), step the batch."""
        self._reap_cancelled()
        self._admit()
        budget = self.prefill_budget
        while self.prefilling and budget > 0:
            req = self.prefilling[0]
            before = req.seq.prefilled - req.seq.cached_tokens
            t = time.perf_counter()
            try:
                done = self.engine.prefill(req.seq, min(self.prefill_chunk, budget))
            except Exception as e:  # noqa: BLE001 - a failing request must not take the others down
                self.prefilling.pop(0)
                self._release(req, error=f"prefill failed: {e}")
                continue
            finally:
                self.prefill_s += time.perf_counter() - t
            budget -= max(1, req.seq.prefilled - req.seq.cached_tokens - before)  # tokens computed, not reused
            if done:
                self.prefilling.pop(0)
                req.first_token_s = time.perf_counter() - req.submitted
                self.running.append(req)
        self._close_finished()
        if self.running:
            self._decode()

    def _decode(self) -> None:
        seqs = [r.seq for r in self.running]
        can_draft = any(s.drafter is not None for s in seqs)
        load = min(self.num_slots, len(seqs) + len(self.prefilling) + len(self.waiting))
        arm = self.controller.choose(load) if self.controller and can_draft else None
        t = time.perf_counter()
        try:
            info = self.engine.step(seqs, None if arm == LIGHT else arm, light=arm == LIGHT)
        except Exception as e:  # noqa: BLE001
            for r in list(self.running):
                self.running.remove(r)
                self._release(r, error=f"decoding failed: {e}")
            return
        finally:
            self.step_s += time.perf_counter() - t
        self.steps += 1
        self.spec_steps += can_draft and info.cap != 0
        self.tokens_out += info.committed
        if self.controller and can_draft:
            # a plain step the engine ran to measure plain decoding counts as off
            self.controller.observe(0 if info.cap == 0 else arm, info, load)
        self._close_finished()

    def _admit(self) -> None:
        with self._cv:
            while self.waiting and self.free:
                req = self.waiting.popleft()
                slot = self.free.pop()
                try:
                    req.seq = self.engine.new_sequence(req.prompt_ids, req.options, slot, req.on_text)
                except Exception as e:  # noqa: BLE001 - a bad request must not stop the engine
                    self.free.append(slot)
                    self._close(req, error=f"{type(e).__name__}: {e}")
                    continue
                self.prefilling.append(req)
                if self.controller:
                    self.controller.admit()

    def _reap_cancelled(self) -> None:
        with self._cv:
            gone = [r for r in self.waiting if r.cancelled]
            for r in gone:
                self.waiting.remove(r)
        for r in gone:
            self._close(r)
        for group in (self.prefilling, self.running):
            for r in [r for r in group if r.cancelled]:
                group.remove(r)
                self._release(r, "cancelled")

    def _close_finished(self) -> None:
        for r in [r for r in self.running if r.seq.finish_reason is not None]:
            self.running.remove(r)
            self._release(r, error=r.seq.error)

    def _release(self, req: Request, reason: str | None = None, error: str | None = None) -> None:
        """Finish the request's sequence (with `reason` if cut short), free its slot, report."""
        try:
            self.engine.finish(req.seq, reason or ("error" if error else None))
        except Exception as e:  # noqa: BLE001 - e.g. a drafter's release or the stream callback
            error = error or f"finishing failed: {type(e).__name__}: {e}"
        with self._cv:
            self.free.append(req.seq.slot)
        self._close(req, error)

    @staticmethod
    def _close(req: Request, error: str | None = None) -> None:
        req.error = error or req.error
        req.finished_s = time.perf_counter() - req.submitted
        if req.on_done:
            try:
                req.on_done(req)
            except Exception:  # noqa: BLE001 - a broken callback must not stop the engine
                pass
