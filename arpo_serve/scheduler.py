"""Request batching for `arpo-serve`: one asyncio task feeds the engine one batch at a time.

Role: owns the queue of waiting requests, the pause state and the abort marks. ``run`` waits until requests
are waiting and generation is not paused, takes up to ``max_batch`` of them (FIFO) and runs them together in a
worker thread (``asyncio.to_thread``); requests that arrive meanwhile form the next batch.

Invariants:
- at most one batch or weight load runs at a time (``_engine_lock``), so weights never change inside a batch and
  every token of a response carries the one weight version of its batch;
- after ``pause()`` returns no batch is running. All three SGLang pause modes stop new batches; ``abort`` also
  ends the queued and running requests (finish_reason abort, partial output kept). ``in_place`` and ``retract``
  let the running batch finish first: unlike SGLang, a request is never suspended halfway through.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Callable, TypeVar

from arpo_serve.engine import Engine, GenerationResult, PreparedRequest

log = logging.getLogger(__name__)
T = TypeVar("T")

PAUSE_MODES = ("abort", "retract", "in_place")


class EngineFailure(RuntimeError):
    """The engine raised while running a batch (HTTP 500 for the requests in it)."""


@dataclass
class SchedulerStats:
    """Counters reported by /get_server_info (internal_states)."""

    batches: int = 0
    """Batches run so far."""
    requests_finished: int = 0
    """Requests answered (any finish reason)."""
    requests_aborted: int = 0
    """Requests that ended with finish_reason abort."""
    tokens_generated: int = 0
    """Output tokens over all requests."""
    last_batch_size: int = 0
    max_batch_size_seen: int = 0
    busy_seconds: float = 0.0
    """Wall time spent inside batches."""
    weight_updates: int = 0


@dataclass
class _Waiting:
    request: PreparedRequest
    future: asyncio.Future


class Scheduler:
    """Collects requests and runs them in batches on ``engine``.

    Args:
        engine: the inference engine (blocking methods run in worker threads).
        max_batch: most requests per batch. Larger batches raise throughput and each request's latency.
    """

    def __init__(self, engine: Engine, max_batch: int = 16):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.engine = engine
        self.max_batch = max_batch
        self.stats = SchedulerStats()
        self._waiting: deque[_Waiting] = deque()
        self._running: list[PreparedRequest] = []
        self._paused = False
        self._wake = asyncio.Event()
        self._engine_lock = asyncio.Lock()
        self._abort_marks: set[str] = set()
        self._abort_running = False
        self._marks_lock = threading.Lock()

    # ------------------------------------------------------------ state

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def flushable(self) -> bool:
        """Whether SGLang would flush its cache now: no running batch, and nothing waiting unless generation is
        paused (sglang 0.5.23 managers/scheduler.py ``flush_cache``: ``is_fully_idle(ignore_waiting=paused)``)."""
        return not self._running and (not self._waiting or self._paused)

    def internal_state(self) -> dict:
        """Counters and queue depths for /get_server_info (with the grammar backend's, GrammarBackend.state)."""
        return {**asdict(self.stats), "queue_depth": self.queue_depth, "running_requests": self.running,
                "paused": self._paused, "max_batch": self.max_batch,
                "weight_version": self.engine.weight_version, **self.engine.grammars.state()}

    # ------------------------------------------------------------ requests

    async def submit(self, request: PreparedRequest) -> GenerationResult:
        """Queue ``request`` and wait for its result. Cancelling the caller aborts the request.

        Raises EngineFailure when the engine failed on its batch.
        """
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(_Waiting(request, future))
        self._wake.set()
        try:
            return await future
        except asyncio.CancelledError:
            self.abort(request.rid)
            raise

    def abort(self, rid: str | None = None, *, abort_all: bool = False) -> int:
        """Abort queued requests at once and mark running ones (they stop at the next decode step).

        Returns the number of requests affected."""
        hit = [w for w in self._waiting if abort_all or w.request.rid == rid]
        for w in hit:
            self._waiting.remove(w)
            if not w.future.done():
                w.future.set_result(self._aborted_result(w.request))
        running = [r for r in self._running if abort_all or r.rid == rid]
        if running:  # marks live until the end of the running batch, so only mark what runs now
            with self._marks_lock:
                if abort_all:
                    self._abort_running = True
                else:
                    self._abort_marks.add(rid)
        return len(hit) + len(running)

    def _is_aborted(self, rid: str) -> bool:  # called from the worker thread
        with self._marks_lock:
            return self._abort_running or rid in self._abort_marks

    def _aborted_result(self, r: PreparedRequest) -> GenerationResult:
        self.stats.requests_aborted += 1
        self.stats.requests_finished += 1
        return GenerationResult(r.rid, [], [], [], {"type": "abort", "message": "Abort request."},
                                len(r.input_ids), self.engine.weight_version)

    # ------------------------------------------------------------ pause / exclusive engine access

    async def pause(self, mode: str = "abort") -> None:
        """Stop starting batches; returns once no batch runs. ``mode`` as SGLang's (see module docstring).

        Raises ValueError on an unknown mode."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"invalid mode {mode!r}, expected one of {PAUSE_MODES}")
        self._paused = True
        if mode == "abort":
            self.abort(abort_all=True)
        async with self._engine_lock:
            pass

    def resume(self) -> None:
        """Start batches again."""
        self._paused = False
        self._wake.set()

    async def exclusive(self, fn: Callable[[], T], *, abort_all: bool = False) -> T:
        """Run blocking ``fn`` in a worker thread while no batch runs (e.g. a weight load).

        ``abort_all`` first aborts every queued and running request, as SGLang's ``abort_all_requests``."""
        if abort_all:
            self.abort(abort_all=True)
        async with self._engine_lock:
            return await asyncio.to_thread(fn)

    # ------------------------------------------------------------ the batching loop

    async def run(self) -> None:
        """The scheduler task: forever take a batch and run it. Cancel it to stop."""
        while True:
            while not self._waiting or self._paused:
                self._wake.clear()
                await self._wake.wait()
            async with self._engine_lock:
                if self._paused or not self._waiting:
                    continue
                batch = [self._waiting.popleft() for _ in range(min(self.max_batch, len(self._waiting)))]
                await self._run_batch(batch)

    async def _run_batch(self, batch: list[_Waiting]) -> None:
        self._running = [w.request for w in batch]
        started = time.monotonic()
        try:
            results = await asyncio.to_thread(
                self.engine.generate_batch, self._running, self._is_aborted
            )
        except Exception as e:  # the engine failed: fail this batch's requests, keep serving
            log.exception("batch of %d failed", len(batch))
            for w in batch:
                if not w.future.done():
                    w.future.set_exception(EngineFailure(f"{type(e).__name__}: {e}"))
            return
        finally:
            self._running = []
            with self._marks_lock:
                self._abort_running = False
                self._abort_marks.difference_update(w.request.rid for w in batch)
            self.stats.busy_seconds += time.monotonic() - started
        self.stats.batches += 1
        self.stats.last_batch_size = len(batch)
        self.stats.max_batch_size_seen = max(self.stats.max_batch_size_seen, len(batch))
        for w, result in zip(batch, results):
            self.stats.requests_finished += 1
            self.stats.tokens_generated += len(result.output_ids)
            if result.finish_reason.get("type") == "abort":
                self.stats.requests_aborted += 1
            if not w.future.done():
                w.future.set_result(result)

