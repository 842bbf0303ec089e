"""Process entry helpers shared by arpo-learner and arpo-actors: one event loop, clean signal handling, and a
log that a flood of bad input cannot flood (:class:`WarningBudget`)."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import traceback
from typing import Any, Coroutine


def setup_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def run_until_signal(coro: Coroutine[Any, Any, Any], name: str) -> int:
    """Run ``coro`` as the process's one event loop; the first SIGINT / SIGTERM cancels it so its ``finally`` blocks
    run, and later ones are only logged, so they cannot cut that cleanup short (a process whose parent dies may get
    SIGTERM twice: Linux sends the parent-death signal again when a subreaper it was handed to dies too, as Ray's
    raylet does; a supervisor that will not wait sends SIGKILL).

    Returns:
        0 when the coroutine finished or was stopped by a signal; 1 when it raised: the error is logged at
        ERROR with its type, message and traceback (every sub-exception of an ExceptionGroup on its own), so
        the process's log, and `arpo run`'s message that quotes the log's last lines, show where it failed.
    """
    log = logging.getLogger(name)

    async def runner() -> int:
        task = asyncio.ensure_future(coro)
        loop = asyncio.get_running_loop()
        received: list[int] = []

        def stop(signum: int) -> None:  # the first signal cancels; a later one must not cut the cleanup short
            if not received:
                task.cancel()
            else:
                log.info("signal %d during cleanup: finishing the cleanup first", signum)
            received.append(signum)

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop, sig)
        try:
            await task
        except asyncio.CancelledError:
            log.info("stopped by signal; cleaned up")
        return 0

    try:
        return asyncio.run(runner())
    except BaseExceptionGroup as group:
        for exc in _leaves(group):
            _log_crash(log, name, exc)
        return 1
    except Exception as exc:  # noqa: BLE001 - the process boundary: report and exit non-zero
        _log_crash(log, name, exc)
        return 1


def _log_crash(log: logging.Logger, name: str, exc: BaseException) -> None:
    """One ERROR record: the traceback first, then ``<name> failed: <type>: <message>`` as the last line (the
    line a reader of the log's tail sees)."""
    trace = "".join(traceback.format_exception(exc)).rstrip()
    log.error("%s\n%s failed: %s: %s", trace, name, type(exc).__name__, exc)


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


class WarningBudget:
    """Per-message warnings at most ``burst`` per ``period_s`` seconds; the rest are not logged (:meth:`warning`
    returns False for them, so the caller counts them), and the first warning of the next period says how many were
    left out. A hostile peer's flood of bad frames then writes a few dozen log lines, not one per frame (the
    messages themselves are counted by reason in the learner's metrics either way).

    Args:
        log: where the warnings go.
        burst: warnings logged per period (>= 1).
        period_s: the period (seconds, > 0).
    """

    def __init__(self, log: logging.Logger, burst: int = 20, period_s: float = 10.0) -> None:
        self.log, self.burst, self.period_s = log, burst, period_s
        self._period_start = -period_s
        self._logged = self._left_out = 0

    def warning(self, message: str, *args: object) -> bool:
        """``log.warning(message, *args)`` if this period's budget allows; returns whether it was logged."""
        now = time.monotonic()
        if now - self._period_start >= self.period_s:
            if self._left_out:
                self.log.warning("%d more warnings like the ones above were not logged in %.0f s", self._left_out,
                                 self.period_s)
            self._period_start, self._logged, self._left_out = now, 0, 0
        if self._logged < self.burst:
            self._logged += 1
            self.log.warning(message, *args)
            return True
        self._left_out += 1
        return False
