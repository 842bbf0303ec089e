"""DesktopPool: booted desktops on demand, with warm spares, staggered starts and health checks.

Owns: the desktops it started through a :class:`DesktopFleet` (spares, desktops in use, desktops being
removed), the queue of actors waiting for one, and one task (the runner) whose ``asyncio.TaskGroup`` owns
every background task: the refill tasks that start desktops, the removal of released desktops and the
periodic health check of the spares.

Invariants:

- the pool keeps ``warm_spares`` booted desktops beyond those in use, plus one being started for each waiting
  actor: ``len(spares) + starting + resetting >= warm_spares + waiting`` after every change (the refill rule);
- at most the fleet's ``max_concurrent_starts`` containers boot at once (a semaphore in DesktopFleet.start,
  first come first served), so starts are staggered; a boot's deadline counts from its own slot, so a start
  queued behind hundreds of others never times out for the wait;
- :meth:`acquire` returns a spare at once when there is one (after a /health check), else the next desktop that
  finishes booting (first come, first served);
- a desktop serves at most ``max_episodes`` episodes: :meth:`release` resets a reusable one in place (the
  controller's POST /reset, ~0.13 s: apps killed, files under /root and /tmp put back, pointer parked; see
  actors/desktop/image/reset.py) and hands it out again; a desktop that reached ``max_episodes``, whose
  episode hit an environment error, or whose reset failed is removed (in the background) and the refill rule
  starts a replacement. ``max_episodes=1`` gives every episode a fresh container (nothing can leak);
- a start that fails is retried ``start_attempts`` times with exponential backoff (``retry_base_s * 2**i``,
  capped at ``retry_max_s``); then the oldest waiting :meth:`acquire` raises DesktopError (with no one
  waiting, the pool waits ``retry_max_s`` before trying again);
- spares are health-checked every ``health_interval_s`` and when handed out; a dead one is removed and replaced;
  at most ``HEALTH_CHECKS_AT_ONCE`` checks run at once (each /health runs xdpyinfo in its desktop), and each
  check's ``health_timeout_s`` counts from its own call, so 256 spares are not declared dead because they were
  all asked at the same moment on 2 cores;
- :meth:`close` cancels the background tasks and removes every desktop the pool started, wherever it is.

The trade-offs: each warm spare costs one desktop's RAM (~100-200 MB, see docs/benchmarks.md) and buys a reset
that takes a /health round trip instead of a container boot; reuse (``max_episodes`` > 1) saves a container
boot per episode (the machine's CPU, see bench_e2e.py) at the price of state outside /root and /tmp surviving
up to ``max_episodes`` episodes.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Self

import tenacity

from actors.desktop.controller_client import DesktopError
from actors.desktop.fleet import Desktop, DesktopFleet
from arpo_async.config import ActorConfig

log = logging.getLogger(__name__)

_DEFAULTS = ActorConfig()
HEALTH_CHECKS_AT_ONCE = 8
"""Periodic /health checks of spares in flight at once (each runs xdpyinfo in its desktop)."""
"""The run config's defaults: a pool built without arguments behaves as ``arpo run`` configures it."""


class DesktopPool:
    """A pool of booted desktops over one fleet (see the module docstring).

    Use as ``async with DesktopPool(fleet) as pool: d = await pool.acquire(); ...; await pool.release(d)``,
    or call :meth:`start` and :meth:`close` yourself. Must be used from one event loop.

    Start-ups are bounded by the fleet (``DesktopFleet(max_concurrent_starts=...)``, ``actors.max_concurrent_starts``).

    Defaults of the arguments that are run-config keys (warm_spares, start_attempts =
    ``actors.desktop_start_attempts``, health_interval_s = ``actors.desktop_health_interval_s``, max_episodes =
    ``actors.desktop_max_episodes``) are that key's default in :class:`arpo_async.config.ActorConfig`.

    Args:
        fleet: starts and removes the containers (its ``start`` returns only healthy desktops).
        warm_spares: booted desktops kept ready beyond those in use (>= 0). More = faster resets, more RAM.
        start_attempts: tries per desktop before DesktopError surfaces (>= 1).
        retry_base_s: wait after the first failed start (seconds); doubles per failure.
        retry_max_s: cap on one wait between tries, and the pause after a start gave up with no one waiting.
        health_interval_s: seconds between health checks of the spares.
        health_timeout_s: deadline of one /health call (seconds); no answer in time = dead.
        max_episodes: episodes one desktop serves, with an in-place reset between them (>= 1; 1 = a fresh
            container per episode).
        reset_timeout_s: deadline of one /reset call (seconds); no answer in time = the desktop is replaced.
    """

    def __init__(self, fleet: DesktopFleet, *, warm_spares: int = _DEFAULTS.warm_spares,
                 start_attempts: int = _DEFAULTS.desktop_start_attempts, retry_base_s: float = 1.0,
                 retry_max_s: float = 10.0, health_interval_s: float = _DEFAULTS.desktop_health_interval_s,
                 health_timeout_s: float = 5.0, max_episodes: int = _DEFAULTS.desktop_max_episodes,
                 reset_timeout_s: float = 30.0) -> None:
        if warm_spares < 0 or start_attempts < 1 or max_episodes < 1:
            raise ValueError("need warm_spares >= 0, start_attempts >= 1 and max_episodes >= 1")
        if min(retry_base_s, retry_max_s) < 0 or min(health_interval_s, health_timeout_s) <= 0:
            raise ValueError("retry delays must be >= 0 and health periods > 0")
        self.fleet = fleet
        self.warm_spares = warm_spares
        self.start_attempts = start_attempts
        self.retry_base_s = retry_base_s
        self.retry_max_s = retry_max_s
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.max_episodes = max_episodes
        self.reset_timeout_s = reset_timeout_s
        self._health_slots = asyncio.Semaphore(HEALTH_CHECKS_AT_ONCE)
        self._spares: collections.deque[Desktop] = collections.deque()
        self._in_use: dict[str, Desktop] = {}
        self._all: dict[str, Desktop] = {}  # every desktop started and not yet removed
        self._waiters: collections.deque[asyncio.Future[Desktop]] = collections.deque()
        self._starting = 0
        self._resetting = 0
        self._wake = asyncio.Event()
        self._spare_added = asyncio.Event()
        self._tg: asyncio.TaskGroup | None = None
        self._runner: asyncio.Task | None = None
        self._closed = False
        self.stats: collections.Counter[str] = collections.Counter()
        """Counts: started, start_failures (single tries), start_gave_up, warm_acquires, cold_acquires,
        dead_spares, resets, reset_failures, retired (removed after max_episodes), removed, remove_failures."""

    # ---- views -----------------------------------------------------------------------------------------
    @property
    def spares(self) -> list[Desktop]:
        """Booted desktops not handed out (oldest first)."""
        return list(self._spares)

    @property
    def in_use(self) -> list[Desktop]:
        """Desktops handed out by :meth:`acquire` and not yet released."""
        return list(self._in_use.values())

    @property
    def starting(self) -> int:
        """Desktops being started right now (booting or waiting for a start slot)."""
        return self._starting

    @property
    def resetting(self) -> int:
        """Released desktops being reset in place for their next episode."""
        return self._resetting

    @property
    def waiting(self) -> int:
        """Callers of :meth:`acquire` waiting for a desktop to boot."""
        return sum(not f.done() for f in self._waiters)

    # ---- lifecycle -------------------------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    def start(self, tg: asyncio.TaskGroup | None = None) -> asyncio.Task:
        """Start the runner task (refills spares, health checks) and return it; call once, from a running event
        loop. With ``tg`` the runner belongs to that task group (the process's, in actors.main: the pool's failure
        then stops the process, and the group waits for the runner, so cancel it when done); without, to the
        event loop (``async with``), and :meth:`close` stops it."""
        if self._runner is not None or self._closed:
            raise RuntimeError("DesktopPool.start: already started or closed")
        create_task = tg.create_task if tg is not None else asyncio.get_running_loop().create_task
        self._runner = create_task(self._run(), name="desktop-pool")
        return self._runner

    async def close(self) -> None:
        """Stop every background task and remove every desktop the pool started (spares, in use, released).

        Idempotent. Waiting :meth:`acquire` calls raise DesktopError. Raises DesktopError when some container
        could not be removed (after trying all of them).
        """
        self._closed = True
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.wait([self._runner])
        self._fail_all_waiters(DesktopError("the desktop pool is closed"))
        desktops = list(self._all.values())
        self._spares.clear()
        self._in_use.clear()
        results = await asyncio.gather(*(self._remove(d) for d in desktops))
        if not all(results):
            raise DesktopError(f"the desktop pool could not remove {results.count(False)} of {len(desktops)} "
                               "desktops (see the log)")

    async def wait_spares(self, count: int | None = None) -> None:
        """Wait until at least ``count`` spares (default ``warm_spares``) are booted; use with a deadline."""
        want = self.warm_spares if count is None else count
        while len(self._spares) < want:
            self._check_running()
            self._spare_added.clear()
            await self._spare_added.wait()

    # ---- acquire / release -----------------------------------------------------------------------------
    async def acquire(self) -> Desktop:
        """A booted, healthy desktop for one episode: a warm spare at once if there is one, else the next
        to finish booting. Give it back with :meth:`release`.

        Raises:
            DesktopError: starting a desktop failed ``start_attempts`` times in a row, or the pool is closed.
        """
        while True:
            self._check_running()
            if not self._spares:
                return await self._wait_for_boot()
            desktop = self._spares.popleft()
            self._in_use[desktop.container_id] = desktop
            self._wake.set()  # one spare fewer: refill
            try:
                healthy = await desktop.controller.health(timeout=self.health_timeout_s)
            except BaseException:
                self._in_use.pop(desktop.container_id, None)
                self._discard(desktop)
                raise
            if healthy:
                self.stats["warm_acquires"] += 1
                desktop.episodes += 1
                return desktop
            log.warning("spare desktop %s is dead; removing it", desktop.name)
            self.stats["dead_spares"] += 1
            self._in_use.pop(desktop.container_id, None)
            self._discard(desktop)

    async def release(self, desktop: Desktop, *, reusable: bool = True) -> None:
        """Give back a desktop after its episode (dead or alive).

        A reusable desktop below ``max_episodes`` is reset in place in the background and handed out again;
        any other (``reusable=False``: its episode hit an environment error; or it served ``max_episodes``) is
        removed in the background and the pool starts a replacement. Removes it inline when the pool is not
        running. Never raises for a failed reset: that desktop is removed instead.
        """
        self._in_use.pop(desktop.container_id, None)
        if reusable and desktop.episodes < self.max_episodes and self._tg is not None and not self._closed:
            self._resetting += 1
            self._tg.create_task(self._reset(desktop))
        else:
            if reusable and 1 < self.max_episodes <= desktop.episodes:
                self.stats["retired"] += 1
            if not self._discard(desktop):
                await self._remove(desktop)
        self._wake.set()

    # ---- internals -------------------------------------------------------------------------------------
    def _check_running(self) -> None:
        if self._closed or self._runner is None:
            raise DesktopError("the desktop pool is not running (call start() or use `async with`)")
        if self._runner.done():
            raise DesktopError("the desktop pool's runner stopped (see the log for its error)")

    async def _wait_for_boot(self) -> Desktop:
        future: asyncio.Future[Desktop] = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        self._wake.set()
        try:
            desktop = await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                handed = future.result()  # handed over just as we were cancelled: keep it as a spare
                self._in_use.pop(handed.container_id, None)
                self._deliver(handed)
            raise
        finally:
            if future in self._waiters:
                self._waiters.remove(future)
        self.stats["cold_acquires"] += 1
        desktop.episodes += 1
        return desktop

    async def _run(self) -> None:
        """The runner: owns the task group of every background task; refills whenever woken."""
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                tg.create_task(self._health_loop())
                while True:
                    self._wake.clear()
                    self._refill(tg)
                    await self._wake.wait()
        except Exception as exc:
            log.error("desktop pool runner failed: %s: %s", type(exc).__name__, exc)
            self._fail_all_waiters(DesktopError(f"the desktop pool failed: {type(exc).__name__}: {exc}"))
            raise
        finally:
            self._tg = None

    def _refill(self, tg: asyncio.TaskGroup) -> None:
        """Start desktops until spares + starting + resetting covers warm_spares + waiting (the refill rule)."""
        deficit = self.warm_spares + self.waiting - len(self._spares) - self._starting - self._resetting
        for _ in range(max(0, deficit)):
            self._starting += 1
            tg.create_task(self._start_one())

    async def _start_one(self) -> None:
        try:
            try:
                desktop = await self._start_with_retry()
            except DesktopError as exc:
                self.stats["start_gave_up"] += 1
                if not self._fail_one_waiter(exc):
                    log.error("%s; trying again in %g s", exc, self.retry_max_s)
                    await asyncio.sleep(self.retry_max_s)  # still counted as starting: no hot retry loop
                return
            self._all[desktop.container_id] = desktop
            self.stats["started"] += 1
            self._deliver(desktop)
        finally:
            self._starting -= 1
            self._wake.set()

    async def _reset(self, desktop: Desktop) -> None:
        """Reset a released desktop in place and deliver it; remove it when the reset or /health fails."""
        try:
            why = "not healthy after /reset"
            try:
                await desktop.controller.reset(timeout=self.reset_timeout_s)
                healthy = await desktop.controller.health(timeout=self.health_timeout_s)
            except DesktopError as exc:
                why, healthy = str(exc), False
            if healthy:
                self.stats["resets"] += 1
                self._deliver(desktop)
                return
            log.warning("desktop %s could not be reset (%s); replacing it", desktop.name, why)
            self.stats["reset_failures"] += 1
            self._discard(desktop)
        finally:
            self._resetting -= 1
            self._wake.set()

    async def _start_with_retry(self) -> Desktop:
        """One desktop, started under the fleet's start slot, tried ``start_attempts`` times (tenacity: waits of
        ``retry_base_s * 2**(i-1)`` capped at ``retry_max_s``). Raises DesktopError after the last failure."""

        def failed(state: tenacity.RetryCallState) -> None:
            self.stats["start_failures"] += 1
            log.warning("desktop start failed (try %d of %d): %s", state.attempt_number, self.start_attempts,
                        state.outcome.exception())

        retrying = tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(self.start_attempts),
            wait=tenacity.wait_exponential(multiplier=self.retry_base_s, min=0, max=self.retry_max_s),
            retry=tenacity.retry_if_exception_type(DesktopError), after=failed, reraise=True)
        try:
            async for attempt in retrying:
                with attempt:
                    desktop = await self.fleet.start()
        except DesktopError as exc:
            raise DesktopError(f"could not start a desktop in {self.start_attempts} tries: {exc}") from exc
        return desktop

    def _deliver(self, desktop: Desktop) -> None:
        """Hand a booted desktop to the oldest waiter, else keep it as a spare."""
        while self._waiters:
            future = self._waiters.popleft()
            if not future.done():
                self._in_use[desktop.container_id] = desktop
                future.set_result(desktop)
                return
        self._spares.append(desktop)
        self._spare_added.set()

    def _fail_one_waiter(self, exc: DesktopError) -> bool:
        while self._waiters:
            future = self._waiters.popleft()
            if not future.done():
                future.set_exception(exc)
                return True
        return False

    def _fail_all_waiters(self, exc: DesktopError) -> None:
        while self._fail_one_waiter(exc):
            pass
        self._spare_added.set()  # wake wait_spares so it sees the pool stopped

    def _discard(self, desktop: Desktop) -> bool:
        """Remove a desktop in the background; False when the pool's task group is not running."""
        if self._tg is None:
            return False
        self._tg.create_task(self._remove(desktop))
        return True

    async def _remove(self, desktop: Desktop) -> bool:
        try:
            await self.fleet.remove(desktop)
        except DesktopError as exc:
            self.stats["remove_failures"] += 1
            log.error("cannot remove desktop %s: %s", desktop.name, exc)
            return False
        self._all.pop(desktop.container_id, None)
        self.stats["removed"] += 1
        return True

    async def _check(self, desktop: Desktop) -> bool:
        """One spare's /health under a health slot; its deadline starts when the slot is taken."""
        async with self._health_slots:
            return await desktop.controller.health(timeout=self.health_timeout_s)

    async def _health_loop(self) -> None:
        """Every ``health_interval_s``: /health on every spare; dead ones are removed and replaced."""
        while True:
            await asyncio.sleep(self.health_interval_s)
            spares = list(self._spares)
            t0 = time.monotonic()
            healthy = await asyncio.gather(*(self._check(d) for d in spares))
            for desktop, ok in zip(spares, healthy):
                if not ok and desktop in self._spares:
                    log.warning("spare desktop %s failed its health check; replacing it", desktop.name)
                    self.stats["dead_spares"] += 1
                    self._spares.remove(desktop)
                    self._discard(desktop)
            log.debug("health-checked %d spares in %.3f s", len(spares), time.monotonic() - t0)
            self._wake.set()
