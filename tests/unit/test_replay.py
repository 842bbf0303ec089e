"""Reference tests for learner.algo.replay: SuccessReplay (ARPO's success replay buffer) and PrioritizedReplay."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import msgpack
import pytest

from arpo_async.messages import Outcome, Step, Trajectory
from arpo_async.success import DEFAULT_SUCCESS_THRESHOLD, is_success
from arpo_async.tasks import Task
from learner.algo.batcher import Batcher
from learner.algo.samples import train_samples
from learner.algo.replay import (
    Injection,
    PrioritizedReplay,
    ReplayError,
    SuccessReplay,
    make_replay,
    trajectory_length,
    trajectory_version,
)
from learner.rollouts.scheduler import Group
from learner.train.checkpoint import decode_trajectory, encode_trajectory

FAILED = [0.0] * 4


def _group(task: str, batch: int, scores: list[float]) -> list[str]:
    """Trajectory stand-ins: strings naming task, batch and rollout index (the buffer treats them as opaque)."""
    return [f"{task}/b{batch}/r{i}" for i in range(len(scores))]


def _inject(replay: SuccessReplay, task_id: str, trajectories: list, scores: list[float]) -> tuple[list, list, bool]:
    """``replay.inject`` as ``(trajectories, scores, injected)``."""
    result = replay.inject(task_id, trajectories, scores)
    return result.trajectories, result.scores, result.injected


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
    out, scores, injected = _inject(replay, "t", trajectories, FAILED)
    assert injected
    assert out == ["good", "t/b1/r1", "t/b1/r2", "t/b1/r3"]
    assert scores == [0.9, 0.0, 0.0, 0.0]
    assert trajectories == _group("t", 1, FAILED)  # the caller's list is untouched
    assert replay.stats()["injections"] == 1


def test_no_injection_into_a_group_with_a_success_or_high_spread():
    replay = SuccessReplay()
    replay.add_group("t", ["good"], [1.0])
    for scores in ([1.0, 0.0, 0.0, 0.0], [1.0] * 4, [0.3] * 4):
        out, out_scores, injected = _inject(replay, "t", _group("t", 1, scores), scores)
        assert not injected
        assert out == _group("t", 1, scores) and out_scores == scores
    assert replay.stats()["injections"] == 0


def test_no_injection_without_a_stored_success_of_that_task():
    replay = SuccessReplay()
    replay.add_group("other", ["good"], [1.0])
    _, _, injected = _inject(replay, "t", _group("t", 0, FAILED), FAILED)
    assert not injected


def test_a_success_is_replayed_from_the_next_batch_on():
    # batch 0: task t has one success. Inject first (nothing stored yet), then add.
    replay = SuccessReplay()
    batch0 = [1.0, 0.0, 0.0, 0.0]
    _, _, injected = _inject(replay, "t", _group("t", 0, batch0), batch0)
    assert not injected
    replay.add_group("t", _group("t", 0, batch0), batch0)
    # batch 1: all failed -> batch 0's success comes back in place of rollout 0
    out, scores, injected = _inject(replay, "t", _group("t", 1, FAILED), FAILED)
    assert injected and out[0] == "t/b0/r0" and scores[0] == 1.0
    replay.add_group("t", _group("t", 1, FAILED), FAILED)
    assert replay.stats()["stored"] == 1  # the injected copy is not stored again


def test_disabled_buffer_stores_and_injects_nothing():
    replay = SuccessReplay(enabled=False)
    assert replay.add_group("t", ["good"], [1.0]) == 0
    out, scores, injected = _inject(replay, "t", _group("t", 1, FAILED), FAILED)
    assert not injected and out == _group("t", 1, FAILED) and scores == FAILED
    assert replay.stats() == {"tasks": 0, "stored": 0, "injections": 0}


def test_draw_is_uniform_and_seeded():
    stored = [f"s{i}" for i in range(8)]

    def draws(seed: int, n: int) -> list[str]:
        replay = SuccessReplay(seed=seed)
        replay.add_group("t", stored, [1.0] * 8)
        return [_inject(replay, "t", ["f"] * 4, FAILED)[0][0] for _ in range(n)]

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
    _inject(replay, "a", [{"id": "x"}] * 4, FAILED)

    blob = msgpack.packb(replay.state_dict(), use_bin_type=True)
    restored = SuccessReplay(seed=999)
    restored.load_state_dict(msgpack.unpackb(blob, raw=False))

    assert restored.stats() == replay.stats() == {"tasks": 2, "stored": 3, "injections": 1}
    assert restored.stored("a") == replay.stored("a")
    assert restored.stored("b") == replay.stored("b")
    # the RNG continues where the original left off
    for _ in range(10):
        assert _inject(restored, "a", [{}] * 4, FAILED) == _inject(replay, "a", [{}] * 4, FAILED)


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
        _inject(replay, "t", trajectories, scores)


def test_bad_configuration_is_rejected():
    with pytest.raises(ReplayError):
        SuccessReplay(capacity_per_task=0)
    with pytest.raises(ReplayError):
        SuccessReplay(success_threshold=float("nan"))


def test_arpo_inject_reports_index_zero():
    replay = SuccessReplay()
    replay.add_group("t", ["good"], [1.0])
    result = replay.inject("t", ["f0", "f1"], [0.0, 0.0], version=3, rewards=[0.0, -0.5])
    assert result == Injection(["good", "f1"], [1.0, 0.0], 0)  # ARPO: always rollout 0, rewards ignored
    assert replay.inject("t", ["a", "b"], [1.0, 0.0]).index is None


# ---------------------------------------------------------------- prioritized replay


@dataclass(frozen=True)
class Ep:
    """A stored-trajectory stand-in with the two facts the priority reads: sampling version and length."""

    name: str
    version: int = 0
    length: int = 1


def _prio(**kwargs) -> PrioritizedReplay[Ep]:
    return PrioritizedReplay(version_of=lambda e: e.version, length_of=lambda e: e.length, **kwargs)


def test_priority_formula_by_hand():
    replay = _prio(capacity_per_task=8, max_total=100)
    # one group, success rate 1/4 -> s = 0.25; successes A (version 0, 2 steps) and B (version 4, 4 steps)
    replay.add_group("t", [Ep("A", 0, 2), Ep("B", 4, 4), Ep("x"), Ep("y")], [1.0, 1.0, 0.0, 0.0], version=8)
    assert replay.task_success("t") == pytest.approx(0.5)  # 2 of 4 scored above 0.1
    # p = (1 - 0.5 + 0.05)^1 * exp(-age/8) * steps^-0.5 at version 8
    p_a = 0.55 * math.exp(-8 / 8) * 2 ** -0.5  # 0.55 * 0.367879 * 0.707107 = 0.143071
    p_b = 0.55 * math.exp(-4 / 8) * 4 ** -0.5  # 0.55 * 0.606531 * 0.5      = 0.166796
    assert replay.priorities("t") == pytest.approx([p_a, p_b])
    assert p_a == pytest.approx(0.143071, abs=1e-6) and p_b == pytest.approx(0.166796, abs=1e-6)


def test_success_ema_update():
    replay = _prio()
    replay.add_group("t", [Ep("a"), Ep("b"), Ep("c"), Ep("d")], [1.0, 0.0, 0.0, 0.0])
    assert replay.task_success("t") == pytest.approx(0.25)  # first group sets the estimate
    replay.add_group("t", [Ep("e"), Ep("f")], [1.0, 1.0])
    assert replay.task_success("t") == pytest.approx(0.25 + 0.3 * (1.0 - 0.25))  # 0.475
    assert replay.task_success("never") is None


def test_draw_is_proportional_to_priority_and_seeded():
    def buffer(seed: int) -> PrioritizedReplay[Ep]:
        replay = _prio(seed=seed)
        replay.add_group("t", [Ep("A", 0, 2), Ep("B", 4, 4)], [1.0, 1.0], version=8)
        return replay

    w_a = math.exp(-1) * 2 ** -0.5  # the task factor cancels inside a task
    w_b = math.exp(-0.5) * 0.5
    # expected draws: walk the entries in insertion order with u = Random(seed).random() * (w_a + w_b)
    rng = random.Random(11)
    expected = ["A" if rng.random() * (w_a + w_b) < w_a else "B" for _ in range(50)]
    replay = buffer(11)
    got = [replay.inject("t", [Ep("f")] * 4, [0.0] * 4, version=8).trajectories[0].name for _ in range(50)]
    assert got == expected
    assert 0 < got.count("A") < 50
    # frequency: P(A) = w_a / (w_a + w_b) = 0.4617; 4000 draws, sd = sqrt(4000 * 0.46 * 0.54) = 31.5
    replay = buffer(0)
    names = [replay.inject("t", [Ep("f")] * 4, [0.0] * 4, version=8).trajectories[0].name for _ in range(4000)]
    assert abs(names.count("A") - 4000 * w_a / (w_a + w_b)) < 5 * 31.5
    assert replay.stats()["injections"] == 4050 - 50  # this buffer's own count


def test_injection_replaces_the_lowest_reward_rollout():
    replay = _prio()
    replay.add_group("t", [Ep("good")], [1.0])
    # all failed; rollout 2's reply did not parse (reward -0.5): it is the one replaced
    out = replay.inject("t", [Ep("r0"), Ep("r1"), Ep("r2"), Ep("r3")], [0.0] * 4, rewards=[0.0, 0.0, -0.5, 0.0])
    assert out.index == 2 and out.trajectories[2].name == "good" and out.scores == [0.0, 0.0, 1.0, 0.0]
    # equal rewards: the first rollout (as ARPO)
    out = replay.inject("t", [Ep("r0"), Ep("r1")], [0.0, 0.0])
    assert out.index == 0


def test_low_success_injection_is_optional():
    group = [Ep("s"), Ep("r1"), Ep("r2"), Ep("r3")]
    scores = [1.0, 0.0, 0.0, 0.0]  # success rate 1/4
    rewards = [1.0, 0.0, -0.5, 0.0]
    off = _prio()
    off.add_group("t", [Ep("good")], [1.0])
    assert not off.inject("t", group, scores, rewards=rewards).injected  # inject_below 0: all-failed only
    on = _prio(inject_below=0.3)
    on.add_group("t", [Ep("good")], [1.0])
    out = on.inject("t", group, scores, rewards=rewards)
    assert out.index == 2 and out.trajectories[0].name == "s"  # the success stays, the worst rollout goes
    assert not on.inject("t", group, [1.0, 1.0, 0.0, 0.0]).injected  # 1/2 is not below 0.3
    assert on.stats()["low_success_injections"] == 1 and on.stats()["injections"] == 1


def test_per_task_eviction_breaks_ties_by_age():
    replay = _prio(capacity_per_task=2)
    # equal version and length: equal priority; the oldest insertion goes first
    replay.add_group("t", [Ep("a"), Ep("b"), Ep("c")], [1.0, 1.0, 1.0])
    assert [e.name for e, _ in replay.stored("t")] == ["b", "c"]
    assert replay.stats()["evicted"] == 1


def test_per_task_eviction_prefers_to_drop_long_or_stale_successes():
    replay = _prio(capacity_per_task=2)
    replay.add_group("t", [Ep("old-short", 0, 1), Ep("new-long", 4, 9)], [1.0, 1.0], version=4)
    # at version 4: old-short exp(-0.5) * 1 = 0.607, new-long 1 * 9^-0.5 = 0.333
    replay.add_group("t", [Ep("new-short", 4, 1)], [1.0], version=4)
    assert [e.name for e, _ in replay.stored("t")] == ["old-short", "new-short"]


def test_global_bound_evicts_from_tasks_the_policy_solves():
    replay = _prio(capacity_per_task=8, max_total=2)
    replay.add_group("easy", [Ep("e0"), Ep("e1")], [1.0, 1.0])  # s = 1.0: task factor 0.05
    replay.add_group("hard", [Ep("h0"), Ep("x"), Ep("y"), Ep("z")], [1.0, 0.0, 0.0, 0.0])  # s = 0.25: 0.8
    # 3 stored > 2: the lowest priority goes; e0 and e1 tie (0.05 each), so the older e0
    assert [e.name for e, _ in replay.stored("easy")] == ["e1"]
    assert [e.name for e, _ in replay.stored("hard")] == ["h0"]
    assert replay.stats()["stored"] == 2 and replay.stats()["evicted"] == 1


def test_prioritized_success_is_not_injected_into_its_own_group():
    replay = _prio()
    group, scores = [Ep("s"), Ep("f")], [1.0, 0.0]
    assert not replay.inject("t", group, scores).injected
    replay.add_group("t", group, scores)
    out = replay.inject("t", [Ep("f1"), Ep("f2")], [0.0, 0.0])
    assert out.trajectories[0].name == "s"
    replay.add_group("t", [Ep("f1"), Ep("f2")], [0.0, 0.0])
    assert replay.stats()["stored"] == 1


def _real_traj(name: str, score: float, versions: tuple[int, ...], steps: int = 1) -> Trajectory:
    step = Step([1, 2, 3], [0], [7] * len(versions), [-0.5] * len(versions), list(versions), "t", "click(1,2)")
    outcome = Outcome.SUCCESS if is_success(score, DEFAULT_SUCCESS_THRESHOLD) else Outcome.FAILURE
    return Trajectory(name, "actor", "t", "g0", 0, outcome, score, True, [step] * steps, [bytes(range(256)) * 20])


def test_trajectory_version_and_length():
    traj = _real_traj("a", 1.0, (3, 5, 4), steps=2)
    assert trajectory_version(traj) == 3 and trajectory_length(traj) == 2


def test_prioritized_state_round_trip_through_msgpack_with_real_trajectories():
    replay: PrioritizedReplay[Trajectory] = PrioritizedReplay(seed=5)
    replay.add_group("t", [_real_traj("a", 1.0, (0, 1)), _real_traj("b", 1.0, (2,), steps=3),
                           _real_traj("c", 0.0, (2,))], [1.0, 1.0, 0.0], version=3)
    replay.inject("t", [_real_traj("f", 0.0, (3,))] * 2, [0.0, 0.0], version=4)

    blob = msgpack.packb(replay.state_dict(encode=encode_trajectory), use_bin_type=True)
    restored: PrioritizedReplay[Trajectory] = PrioritizedReplay(seed=999)
    restored.load_state_dict(msgpack.unpackb(blob, raw=False), decode=decode_trajectory)

    assert restored.stats() == replay.stats()
    assert restored.stored("t") == replay.stored("t")
    assert restored.priorities("t") == replay.priorities("t")
    assert restored.task_success("t") == replay.task_success("t")
    failed = [_real_traj("f", 0.0, (5,))] * 2
    for _ in range(10):  # the RNG continues where the original left off
        a = restored.inject("t", failed, [0.0, 0.0], version=5)
        b = replay.inject("t", failed, [0.0, 0.0], version=5)
        assert a.trajectories[0].trajectory_id == b.trajectories[0].trajectory_id
    # a new success is stored with the next counter: same eviction order in both
    for buffer in (restored, replay):
        buffer.add_group("t", [_real_traj("d", 1.0, (5,))], [1.0], version=5)
    assert [t.trajectory_id for t, _ in restored.stored("t")] == [t.trajectory_id for t, _ in replay.stored("t")]


def test_prioritized_load_trims_to_smaller_bounds_and_rejects_other_modes():
    big = _prio(capacity_per_task=8)
    big.add_group("t", [Ep(f"s{i}") for i in range(5)], [1.0] * 5)
    small = _prio(capacity_per_task=3)
    small.load_state_dict(big.state_dict())
    assert [e.name for e, _ in small.stored("t")] == ["s2", "s3", "s4"]
    with pytest.raises(ReplayError, match="arpo"):
        small.load_state_dict(SuccessReplay().state_dict())
    with pytest.raises(ReplayError, match="prioritized"):
        SuccessReplay().load_state_dict(big.state_dict())
    state = big.state_dict()
    del state["success"]
    with pytest.raises(ReplayError, match="malformed"):
        small.load_state_dict(state)


def test_make_replay_modes():
    assert make_replay("arpo").mode == "arpo"
    assert make_replay("off").mode == "off" and not make_replay("off").enabled
    prioritized = make_replay("prioritized", max_total=10, inject_below=0.25, tau=2.0)
    assert isinstance(prioritized, PrioritizedReplay)
    assert (prioritized.max_total, prioritized.inject_below, prioritized.tau) == (10, 0.25, 2.0)
    with pytest.raises(ReplayError, match="unknown replay mode"):
        make_replay("lifo")
    with pytest.raises(ReplayError):
        make_replay("prioritized", tau=0.0)


# ---------------------------------------------------------------- batcher: advantages with injected replays

TASK = Task.from_dict({"id": "t", "instruction": "do t", "config": [],
                       "evaluator": {"func": "exact_match", "result": {"type": "vm_file", "path": "/r"},
                                     "expected": {"type": "rule", "rules": {"expected": "x"}}}})


def _scheduled_group(index: int, outcomes: list[tuple[float, bool]], version: int = 0) -> Group:
    group = Group(f"g{index}", TASK, len(outcomes))
    for i, (score, format_ok) in enumerate(outcomes):
        traj = _real_traj(f"g{index}-r{i}", score, (version,))
        traj.group_id, traj.rollout_index, traj.format_ok = group.group_id, i, format_ok
        group.results[i] = traj
    return group


SEED_GROUP = [(1.0, True), (0.0, True), (0.0, True), (0.0, True)]
FAILED_WITH_BAD_FORMAT = [(0.0, True), (0.0, False), (0.0, True), (0.0, True)]  # rewards [0, -0.5, 0, 0]


def test_batcher_arpo_replay_replaces_rollout_zero_and_recomputes_advantages():
    batcher = Batcher(make_replay("arpo"), max_staleness=10, groups_per_step=1)
    batcher.add_group(_scheduled_group(0, SEED_GROUP), version=0)
    scored = batcher.add_group(_scheduled_group(1, FAILED_WITH_BAD_FORMAT), version=1)
    # rewards after injection [1, -0.5, 0, 0]: mean 0.125, sample std sqrt(1.1875 / 3) = 0.629153
    assert scored.rewards == [1.0, -0.5, 0.0, 0.0]
    assert scored.advantages == pytest.approx([0.875 / 0.629153, -0.625 / 0.629153, -0.125 / 0.629153,
                                               -0.125 / 0.629153], abs=1e-5)  # [1.390757, -0.993398, -0.198680, ..]
    assert scored.replayed == [True, False, False, False] and scored.injected
    assert scored.trajectories[0].trajectory_id == "g0-r0"


def test_batcher_prioritized_replay_replaces_the_unparsed_rollout():
    batcher = Batcher(make_replay("prioritized"), max_staleness=10, groups_per_step=2)
    batcher.add_group(_scheduled_group(0, SEED_GROUP), version=0)
    scored = batcher.add_group(_scheduled_group(1, FAILED_WITH_BAD_FORMAT, version=1), version=1)
    # the -0.5 rollout is replaced: rewards [0, 1, 0, 0], mean 0.25, sample std 0.5 -> [-0.5, 1.5, -0.5, -0.5]
    assert scored.rewards == [0.0, 1.0, 0.0, 0.0]
    assert scored.advantages == pytest.approx([-0.5, 1.5, -0.5, -0.5], abs=1e-5)
    assert scored.replayed == [False, True, False, False]
    assert scored.policy_lag == [0, 1, 0, 0] and scored.fresh_policy_lag == [0, 0, 0]
    samples = train_samples(batcher.take_batch())
    assert [s.replayed for s in samples] == [False] * 4 + [False, True, False, False]
    replayed = samples[5]
    assert replayed.behaviour_logprobs == [-0.5] and replayed.advantage == pytest.approx(1.5, abs=1e-5)


def test_batcher_off_mode_drops_the_all_failed_group():
    batcher = Batcher(make_replay("off"), max_staleness=10, groups_per_step=1)
    batcher.add_group(_scheduled_group(0, SEED_GROUP), version=0)
    assert batcher.add_group(_scheduled_group(1, [(0.0, True)] * 4), version=1) is None
    assert batcher.drops["zero_variance"] == 1
