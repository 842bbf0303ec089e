"""LoopLag: the window and run-wide figures from hand-made samples, and a real event loop blocked on purpose."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from arpo_async.loop_lag import HISTOGRAM_MS, LoopLag, bucket_quantile


def test_window_percentiles_match_numpy_and_take_starts_a_new_window():
    lag = LoopLag()
    samples = [0.4, 1.2, 0.0, 3.5, 80.0, 2.2, 0.9, 1.1, 0.3, 7.0]
    for s in samples:
        lag.record(s)
    taken = lag.take()
    assert taken == {"p50": round(float(np.percentile(samples, 50)), 3),
                     "p99": round(float(np.percentile(samples, 99)), 3), "max": 80.0, "samples": 10}
    assert lag.take() == {"p50": 0.0, "p99": 0.0, "max": 0.0, "samples": 0}  # a new, empty window
    assert lag.summary()["samples"] == 10  # the run-wide figures keep every sample


def test_run_wide_summary_reads_the_1ms_histogram():
    lag = LoopLag()
    for _ in range(98):
        lag.record(0.3)  # bucket 1 (ceil)
    lag.record(12.5)  # bucket 13
    lag.record(-2.0)  # counts as 0 ms: bucket 0
    lag.record(HISTOGRAM_MS * 3.0)  # beyond the range: last bucket, exact max
    summary = lag.summary()
    assert summary["p50"] == 1.0
    assert summary["p99"] == 13.0  # 100 of 101 samples lie at or below 13 ms
    assert summary["max"] == HISTOGRAM_MS * 3.0
    assert summary["samples"] == 101


def test_two_bucket_readings_subtract_to_the_samples_between_them():
    lag = LoopLag()
    for _ in range(200):
        lag.record(0.5)  # before: 200 samples in bucket 1
    before = lag.buckets()
    assert before == {1: 200}
    for ms in [2.0] * 97 + [40.0, 60.0, 300.0]:
        lag.record(ms)
    after = lag.buckets()
    between = {ms: n - before.get(ms, 0) for ms, n in after.items() if n - before.get(ms, 0)}
    assert between == {2: 97, 40: 1, 60: 1, 300: 1}
    assert bucket_quantile(between, 0.99) == 60  # 99 of the 100 samples between lie at or below 60 ms
    assert bucket_quantile(between, 0.5) == 2
    assert bucket_quantile(after, 0.99) == 2  # the whole run's p99 hides the three slow wake-ups
    assert bucket_quantile({}, 0.99) == 0
    with pytest.raises(ValueError, match="quantile"):
        bucket_quantile(between, 1.5)


def test_rejects_a_bad_period():
    with pytest.raises(ValueError, match="period_s"):
        LoopLag(period_s=0)


def test_a_blocked_loop_shows_up_and_a_free_one_does_not():
    """Block the loop's thread 3 times for 150 ms: the window's max and p99 see it; a thread doing the same
    blocking work (the way the learner trains) barely moves the free loop's median."""

    async def scenario():
        lag = LoopLag(period_s=0.01)
        probe = asyncio.create_task(lag.run())
        try:
            await asyncio.sleep(0.3)
            for _ in range(3):
                time.sleep(0.15)  # holds the event loop's thread
                await asyncio.sleep(0.05)
            blocked = lag.take()
            await asyncio.gather(*(asyncio.to_thread(time.sleep, 0.15) for _ in range(3)))
            free = lag.take()
        finally:
            probe.cancel()
        return blocked, free, lag.summary()

    blocked, free, summary = asyncio.run(scenario())
    assert blocked["max"] >= 120, blocked
    assert blocked["samples"] >= 20
    assert free["max"] < 120, free
    assert free["p50"] < 20, free
    assert summary["max"] >= 120 and summary["samples"] == blocked["samples"] + free["samples"]
