"""The grammar backend's bookkeeping (issue 48 item 3): a grammar used by enough requests is pinned and no number of
other grammars evicts it, and compiles are queued per client, served in turn, at most ``per_client`` per client."""

from __future__ import annotations

import pytest

from arpo_async.grammar_cache import CompileQueue, PinnedCache


def test_the_least_recently_used_tier_drops_its_oldest_entry():
    cache = PinnedCache(size=3, pinned_max=2, pin_after=100)
    for key in "abc":
        cache.put(key, key.upper())
    assert cache.get("a") == "A"  # now the most recent
    cache.put("d", "D")
    assert "b" not in cache and [k for k in "acd" if k in cache] == ["a", "c", "d"] and len(cache) == 3


def test_a_grammar_used_by_enough_requests_is_pinned_and_a_flood_of_others_never_evicts_it():
    """The attack: the run's grammar evicted by 64 distinct grammars. Once pinned, 10,000 distinct ones leave it."""
    cache = PinnedCache(size=64, pinned_max=4, pin_after=4)
    cache.put("run", "RUN", uses=1)
    for _ in range(3):
        assert cache.get("run") == "RUN"
    assert cache.pinned == {"run"}
    for i in range(10_000):
        cache.put(f"flood{i}", i, uses=1)
    assert cache.get("run") == "RUN" and len(cache) == 64 + 1
    assert len(cache._uses) == 64 + 1  # counts are kept only for entries held: the flood leaves no trail


def test_a_grammar_below_the_pin_threshold_is_evicted_like_any_other():
    cache = PinnedCache(size=2, pinned_max=4, pin_after=4)
    cache.put("run", "RUN", uses=1)
    cache.get("run")  # 2 uses of 4
    cache.put("x", 1)
    cache.put("y", 2)
    assert "run" not in cache and cache.pinned == frozenset()


def test_when_the_pinned_tier_is_full_only_a_more_used_grammar_takes_a_place():
    """A client that pinned its own grammars first cannot keep the run's out: the run's grammar, asked more often,
    takes the place of the least used pinned one, which goes back to the least-recently-used tier."""
    cache = PinnedCache(size=8, pinned_max=2, pin_after=2)
    for key in ("squat1", "squat2"):
        cache.put(key, key, uses=2)
        cache.get(key)  # 3 uses each: pinned
    assert cache.pinned == {"squat1", "squat2"}
    cache.put("run", "RUN", uses=3)  # as many as the least used pinned one: no place yet
    assert cache.pinned == {"squat1", "squat2"}
    assert cache.get("run") == "RUN"  # 4 uses: more than squat1's 3
    assert "run" in cache.pinned and len(cache.pinned) == 2
    assert ("squat1" in cache) and ("squat2" in cache)  # the demoted one is still cached, just evictable


def test_compiles_are_bounded_per_client_and_a_pending_grammar_is_joined_for_free():
    queue = CompileQueue(per_client=2)
    a1, a2 = queue.submit("g1", "10.0.0.1"), queue.submit("g2", "10.0.0.1")
    assert a1 is not None and a2 is not None and a1 is not a2
    assert queue.submit("g3", "10.0.0.1") is None  # a third distinct grammar of the same client: refused
    assert queue.submit("g1", "10.0.0.1") is a1 and queue.submit("g1", "10.0.0.2") is a1  # joined, no place taken
    assert queue.held("10.0.0.1") == 2 and queue.held("10.0.0.2") == 0
    assert queue.submit("h1", "10.0.0.2") is not None  # another client has its own places
    key, _ = queue.next_job()
    assert key == "g1" and queue.held("10.0.0.1") == 2  # running still counts
    assert queue.done("g1") == 3  # three requests asked for it
    assert queue.submit("g3", "10.0.0.1") is not None  # a place came free


def test_clients_are_served_in_turn_so_a_flood_delays_another_client_by_one_compile_at_most():
    queue = CompileQueue(per_client=4)
    for i in range(4):
        queue.submit(f"flood{i}", "attacker")
    queue.submit("run", "actors")
    order = []
    while (job := queue.next_job()) is not None:
        order.append(job[0])
        queue.done(job[0])
    assert order == ["flood0", "run", "flood1", "flood2", "flood3"]
    assert len(queue) == 0 and queue.held("attacker") == 0


@pytest.mark.parametrize("args", [(0, 1, 1), (1, 0, 1), (1, 1, 0)])
def test_bounds_below_one_are_refused(args):
    with pytest.raises(ValueError, match="must be >= 1"):
        PinnedCache(*args)
    with pytest.raises(ValueError, match="must be >= 1"):
        CompileQueue(0)
