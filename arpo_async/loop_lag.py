"""Event-loop lag: how late a periodic ``asyncio.sleep`` wakes, as p50/p99/max over a window and over the run.

Role: one small task per process (:meth:`LoopLag.run`) that sleeps ``period_s`` again and again and records how much
later than asked each sleep returned. Anything that holds the event loop's thread (a blocking call, a long
callback, CPU starvation of the process, the GIL held by another thread) shows up as lag; a loop that is free
wakes within about a millisecond. The same probe as Node.js's ``monitorEventLoopDelay`` and aiodebug's
``log_slow_callbacks`` (which times callbacks instead), reduced to one coroutine.

Owns: the samples of the current window (reset by :meth:`LoopLag.take`, one window per metrics record) and a
run-wide histogram of 1-ms buckets (:meth:`LoopLag.summary`, bounded memory whatever the run's length).

Invariants: a sample is ``max(0, woke - (slept_at + period_s))`` in milliseconds; the window keeps at most
``max_window`` samples (the newest); percentiles are numpy's linear ones (arpo_async.stage_timings.percentile)
over the window, and the run-wide ones are read off the histogram (exact to the bucket: 1 ms up to
``HISTOGRAM_MS``, beyond it counted in the last bucket and reported as ``max``).
"""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import Mapping

from arpo_async.stage_timings import percentile

HISTOGRAM_MS = 10_000
"""Run-wide histogram range: lags from 0 to this many ms in 1-ms buckets (longer ones go in the last bucket)."""


class LoopLag:
    """The lag monitor of one event loop (see the module docstring).

    Args:
        period_s: seconds between probes (the sleep asked for; > 0). 20 ms costs ~50 wake-ups a second.
        max_window: most samples one window keeps (the newest ones).

    Raises:
        ValueError: ``period_s`` <= 0 or ``max_window`` < 1.
    """

    def __init__(self, period_s: float = 0.02, max_window: int = 100_000) -> None:
        if period_s <= 0 or max_window < 1:
            raise ValueError(f"LoopLag needs period_s > 0 and max_window >= 1, got {period_s}, {max_window}")
        self.period_s = period_s
        self._window: collections.deque[float] = collections.deque(maxlen=max_window)
        self._histogram = [0] * (HISTOGRAM_MS + 1)
        self._count = 0
        self._max_ms = 0.0

    def record(self, lag_ms: float) -> None:
        """Add one sample (milliseconds late; negative values count as 0)."""
        lag_ms = max(0.0, lag_ms)
        self._window.append(lag_ms)
        self._histogram[min(HISTOGRAM_MS, math.ceil(lag_ms))] += 1
        self._count += 1
        self._max_ms = max(self._max_ms, lag_ms)

    async def run(self) -> None:
        """Probe until cancelled: sleep ``period_s``, record how late the wake-up came (loop.time() clock)."""
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time() + self.period_s
            await asyncio.sleep(self.period_s)
            self.record(1e3 * (loop.time() - asked))

    def take(self) -> dict[str, float]:
        """The window so far as ``{"p50", "p99", "max": ms, "samples": n}`` (zeros when empty); a new window
        starts. One metrics record's ``loop_lag_ms``."""
        window = list(self._window)
        self._window.clear()
        if not window:
            return {"p50": 0.0, "p99": 0.0, "max": 0.0, "samples": 0}
        return {"p50": round(percentile(window, 50), 3), "p99": round(percentile(window, 99), 3),
                "max": round(max(window), 3), "samples": len(window)}

    def summary(self) -> dict[str, float]:
        """The whole run so far, from the histogram: ``{"p50", "p99"}`` as the upper edge of the 1-ms bucket that
        holds that quantile, ``max`` exact (ms), ``samples``. Does not start a new window."""
        if not self._count:
            return {"p50": 0.0, "p99": 0.0, "max": 0.0, "samples": 0}
        return {"p50": float(self._bucket(0.50)), "p99": float(self._bucket(0.99)),
                "max": round(self._max_ms, 3), "samples": self._count}

    def buckets(self) -> dict[int, int]:
        """The run-wide histogram's non-empty buckets, ``{ms: samples}`` (a bucket ``ms`` holds the lags in
        ``(ms - 1, ms]``; the last one everything longer). Two readings taken apart subtract to the samples of
        the time between them (:func:`bucket_quantile` reads a quantile off the difference)."""
        return {ms: n for ms, n in enumerate(self._histogram) if n}

    def _bucket(self, q: float) -> int:
        return bucket_quantile(dict(enumerate(self._histogram)), q)


def bucket_quantile(buckets: Mapping[int, int], q: float) -> int:
    """The smallest bucket (ms) at or below which at least ``q`` (0..1) of the samples in ``buckets`` (``{ms:
    samples}``, as :meth:`LoopLag.buckets` gives) lie; 0 when there are none.

    Raises:
        ValueError: ``q`` outside [0, 1].
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    need, seen = math.ceil(q * sum(buckets.values())), 0
    for ms in sorted(buckets):
        seen += buckets[ms]
        if seen >= need:
            return ms
    return 0
