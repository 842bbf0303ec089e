"""Reference tests for learner.replay.SuccessReplay (ARPO's success replay buffer)."""

from __future__ import annotations

import random

import msgpack
import pytest

from learner.replay import ReplayError, SuccessReplay

FAILED = [0.0] * 4


def _group(task: str, batch: int, scores: list[float]) -> list[str]:
    """Trajectory stand-ins: strings naming task, batch and rollout index (the buffer treats them as opaque)."""
    return [f"{task}/b{batch}/r{i}" for i in range(len(scores))]


def test_stores_only_successes_above_threshold():
    replay = SuccessReplay()
    scores = [0.0, 0.1, 0.11, 1.0]
    assert replay.add_group("t", _group("t", 0, scores), scores) == 2
    assert replay.stored("t") == [("t/b0/r2", 0.11), ("t/b0/r3", 1.0)]
    assert replay.stats() == {"tasks": 1, "stored": 2, "injections": 0}


def test_fifo_evicts_the_oldest_at_the_ninth_success():
    replay = SuccessReplay(capacity_per_task=8)
    for batch in range(9):
        replay.add_group("t", [f"s{batch}"], [1.0])
    assert [t for t, _ in replay.stored("t")] == [f"s{i}" for i in range(1, 9)]
    assert replay.stats()["stored"] == 8


def test_capacity_is_per_task():
    replay = SuccessReplay(capacity_per_task=2)
    replay.add_group("a", ["a0", "a1", "a2"], [1.0, 1.0, 1.0])
    replay.add_group("b", ["b0"], [1.0])
    assert [t for t, _ in replay.stored("a")] == ["a1", "a2"]
    assert [t for t, _ in replay.stored("b")] == ["b0"]
    assert replay.stats() == {"tasks": 2, "stored": 3, "injections": 0}


def test_injects_into_all_failed_group_replacing_the_first_rollout():
    replay = SuccessReplay()
    replay.add_group("t", ["good"], [0.9])
    trajectories = _group("t", 1, FAILED)
    out, scores, injected = replay.maybe_inject("t", trajectories, FAILED)
    assert injected
    assert out == ["good", "t/b1/r1", "t/b1/r2", "t/b1/r3"]
    assert scores == [0.9, 0.0, 0.0, 0.0]
    assert trajectories == _group("t", 1, FAILED)  # the caller's list is untouched
    assert replay.stats()["injections"] == 1


def test_no_injection_into_a_group_with_a_success_or_high_spread():
    replay = SuccessReplay()
    replay.add_group("t", ["good"], [1.0])
    for scores in ([1.0, 0.0, 0.0, 0.0], [1.0] * 4, [0.3] * 4):
        out, out_scores, injected = replay.maybe_inject("t", _group("t", 1, scores), scores)
        assert not injected
        assert out == _group("t", 1, scores) and out_scores == scores
    assert replay.stats()["injections"] == 0


def test_no_injection_without_a_stored_success_of_that_task():
    replay = SuccessReplay()
    replay.add_group("other", ["good"], [1.0])
    _, _, injected = replay.maybe_inject("t", _group("t", 0, FAILED), FAILED)
    assert not injected


def test_a_success_is_replayed_from_the_next_batch_on():
    # batch 0: task t has one success. Inject first (nothing stored yet), then add.
    replay = SuccessReplay()
    batch0 = [1.0, 0.0, 0.0, 0.0]
    _, _, injected = replay.maybe_inject("t", _group("t", 0, batch0), batch0)
    assert not injected
    replay.add_group("t", _group("t", 0, batch0), batch0)
    # batch 1: all failed -> batch 0's success comes back in place of rollout 0
    out, scores, injected = replay.maybe_inject("t", _group("t", 1, FAILED), FAILED)
    assert injected and out[0] == "t/b0/r0" and scores[0] == 1.0
    replay.add_group("t", _group("t", 1, FAILED), FAILED)
    assert replay.stats()["stored"] == 1  # the injected copy is not stored again


def test_disabled_buffer_stores_and_injects_nothing():
    replay = SuccessReplay(enabled=False)
    assert replay.add_group("t", ["good"], [1.0]) == 0
    out, scores, injected = replay.maybe_inject("t", _group("t", 1, FAILED), FAILED)
    assert not injected and out == _group("t", 1, FAILED) and scores == FAILED
    assert replay.stats() == {"tasks": 0, "stored": 0, "injections": 0}


def test_draw_is_uniform_and_seeded():
    stored = [f"s{i}" for i in range(8)]

    def draws(seed: int, n: int) -> list[str]:
        replay = SuccessReplay(seed=seed)
        replay.add_group("t", stored, [1.0] * 8)
        return [replay.maybe_inject("t", ["f"] * 4, FAILED)[0][0] for _ in range(n)]

    # Same seed, same draws; the draw is random.Random(seed).randrange(8) over the FIFO, oldest first.
    expected_rng = random.Random(5)
    assert draws(5, 20) == [stored[expected_rng.randrange(8)] for _ in range(20)]
    assert draws(5, 20) == draws(5, 20)
    assert draws(5, 20) != draws(6, 20)
    # Uniform: 4000 draws over 8 slots, each within 5 standard deviations of 500 (sd = sqrt(4000/8*7/8) ~ 20.9).
    counts = {s: 0 for s in stored}
    for name in draws(0, 4000):
        counts[name] += 1
    assert all(abs(c - 500) < 105 for c in counts.values()), counts


def test_state_round_trip_through_msgpack():
    replay = SuccessReplay(seed=3)
    replay.add_group("a", [{"id": "a0", "tokens": [1, 2]}, {"id": "a1", "tokens": [3]}], [1.0, 0.5])
    replay.add_group("b", [{"id": "b0", "tokens": []}], [0.2])
    replay.maybe_inject("a", [{"id": "x"}] * 4, FAILED)

    blob = msgpack.packb(replay.state_dict(), use_bin_type=True)
    restored = SuccessReplay(seed=999)
    restored.load_state_dict(msgpack.unpackb(blob, raw=False))

    assert restored.stats() == replay.stats() == {"tasks": 2, "stored": 3, "injections": 1}
    assert restored.stored("a") == replay.stored("a")
    assert restored.stored("b") == replay.stored("b")
    # the RNG continues where the original left off
    for _ in range(10):
        assert restored.maybe_inject("a", [{}] * 4, FAILED) == replay.maybe_inject("a", [{}] * 4, FAILED)


def test_state_round_trip_with_encode_and_decode():
    class Traj:
        def __init__(self, name: str) -> None:
            self.name = name

    replay: SuccessReplay[Traj] = SuccessReplay()
    replay.add_group("t", [Traj("x"), Traj("y")], [1.0, 1.0])
    state = replay.state_dict(encode=lambda t: {"name": t.name})
    assert state["tasks"]["t"] == [[{"name": "x"}, 1.0], [{"name": "y"}, 1.0]]
    restored: SuccessReplay[Traj] = SuccessReplay()
    restored.load_state_dict(state, decode=lambda d: Traj(d["name"]))
    assert [t.name for t, _ in restored.stored("t")] == ["x", "y"]


def test_load_trims_to_capacity_keeping_the_newest():
    big = SuccessReplay(capacity_per_task=8)
    big.add_group("t", [f"s{i}" for i in range(8)], [1.0] * 8)
    small = SuccessReplay(capacity_per_task=3)
    small.load_state_dict(big.state_dict())
    assert [t for t, _ in small.stored("t")] == ["s5", "s6", "s7"]


def test_load_rejects_unknown_schema_and_malformed_state():
    replay = SuccessReplay()
    with pytest.raises(ReplayError, match="schema"):
        replay.load_state_dict({"schema": 99})
    state = replay.state_dict()
    del state["rng"]
    with pytest.raises(ReplayError, match="malformed"):
        replay.load_state_dict(state)


@pytest.mark.parametrize(
    ("trajectories", "scores"),
    [(["a", "b"], [1.0]), ([], []), (["a"], [float("nan")])],
)
def test_bad_groups_are_rejected(trajectories, scores):
    replay = SuccessReplay()
    with pytest.raises(ReplayError):
        replay.add_group("t", trajectories, scores)
    with pytest.raises(ReplayError):
        replay.maybe_inject("t", trajectories, scores)


def test_bad_configuration_is_rejected():
    with pytest.raises(ReplayError):
        SuccessReplay(capacity_per_task=0)
    with pytest.raises(ReplayError):
        SuccessReplay(success_threshold=float("nan"))
