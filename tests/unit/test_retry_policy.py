"""The inference client's retry policy (arpo_async.inference_client.RetryPolicy over tenacity): full-jitter waits
under the exponential cap, the attempt budget, and no retry of a request error."""

from __future__ import annotations

import asyncio

import pytest
import tenacity

from arpo_async.inference_client import PolicyRequestError, RetryPolicy, RetryableError


def wait_after(policy: RetryPolicy, failures: int) -> float:
    state = tenacity.RetryCallState(retry_object=policy.retrying(), fn=None, args=(), kwargs={})
    state.attempt_number = failures
    return policy.retrying().wait(state)


def test_waits_are_full_jitter_under_the_exponential_cap():
    policy = RetryPolicy(attempts=6, base_delay_s=0.5, max_delay_s=3.0)
    for failures, cap in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 3.0), (5, 3.0)]:
        waits = [wait_after(policy, failures) for _ in range(400)]
        assert 0.0 <= min(waits) and max(waits) <= cap
        assert max(waits) > 0.8 * cap and min(waits) < 0.2 * cap  # spread over [0, cap], not a fixed delay


async def test_the_budget_is_the_attempt_count_and_request_errors_are_not_retried():
    policy = RetryPolicy(attempts=3, base_delay_s=0.0, max_delay_s=0.0)
    calls = []

    async def failing(error: Exception):
        async for attempt in policy.retrying():
            with attempt:
                calls.append(attempt.retry_state.attempt_number)
                await asyncio.sleep(0)
                raise error

    with pytest.raises(RetryableError):
        await failing(RetryableError("HTTP 503"))
    assert calls == [1, 2, 3]
    calls.clear()
    with pytest.raises(PolicyRequestError):
        await failing(PolicyRequestError("HTTP 400"))
    assert calls == [1]
