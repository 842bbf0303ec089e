"""Lockstep schedule: the scheduler's group budget, LockstepAdmission, and scheduler state for checkpoints.

Lockstep = ARPO's loop: one rollout batch of groups_per_step groups x G rollouts is handed out, nothing else
until all of it came back; re-issues of that batch's slots are still handed out.
"""

import pytest

from arpo_async.config import ConfigError, load_config
from arpo_async.messages import Step, Trajectory
from arpo_async.tasks import Task
from learner.rollouts.scheduler import GroupScheduler
from learner.rollouts.staleness import LockstepAdmission, StalenessManager


def task(task_id: str) -> Task:
    return Task.from_dict({"id": task_id, "instruction": f"do {task_id}", "config": [],
                           "evaluator": {"func": "exact_match", "result": {"type": "vm_file", "path": "/r"},
                                         "expected": {"type": "rule", "rules": {"expected": "x"}}}})


def traj(rollout, outcome="FAILURE", score=0.0) -> Trajectory:
    step = Step([1, 2], [0], [5], [-1.0], [0], "t", "wait()")
    return Trajectory(f"t-{rollout.group_id}-{rollout.rollout_index}", "a", rollout.task.id, rollout.group_id,
                      rollout.rollout_index, outcome, score, True, [step], [b"png"])


def drain(s: GroupScheduler) -> list:
    out = []
    while s.has_work:
        out.append(s.next_rollout())
    return out


def test_group_budget_hands_out_exactly_one_rollout_batch():
    s = GroupScheduler([task("a"), task("b"), task("c")], group_size=2, group_budget=0)
    assert not s.has_work and s.idle
    with pytest.raises(RuntimeError):
        s.next_rollout()
    s.add_group_budget(2)
    batch = drain(s)
    assert len(batch) == 4 and len({r.group_id for r in batch}) == 2  # 2 groups x G=2, then nothing
    assert not s.idle  # handed out, not back
    completed = [s.on_trajectory(traj(r)) is not None for r in batch[:3]]
    assert completed == [False, True, False] and not s.idle and not s.has_work
    assert s.on_trajectory(traj(batch[3])) is not None
    assert s.idle and not s.has_work


def test_reissues_of_the_batch_are_handed_out_after_the_budget_is_spent():
    s = GroupScheduler([task("a")], group_size=2, group_budget=1, max_retries=1)
    r0, r1 = drain(s)
    assert s.on_trajectory(traj(r0, "ENV_ERROR")) is None
    assert s.has_work  # the re-issue, not a new group
    again = s.next_rollout()
    assert (again.group_id, again.rollout_index) == (r0.group_id, 0) and not s.has_work
    s.on_trajectory(traj(r1, "SUCCESS", 1.0))
    assert s.on_trajectory(traj(again, "SUCCESS", 1.0)) is not None and s.idle


def test_expired_slot_of_a_completed_group_is_not_work():
    s = GroupScheduler([task("a")], group_size=2, group_budget=1, rollout_timeout_s=10)
    r0, r1 = drain(s)
    assert s.expire(now=float("inf")) == 2
    assert s.has_work
    again = [s.next_rollout(), s.next_rollout()]
    for r in again:
        s.on_trajectory(traj(r))
    assert s.idle and not s.has_work


def test_unbudgeted_scheduler_always_has_work_and_refuses_a_budget():
    s = GroupScheduler([task("a")], group_size=2)
    assert s.has_work and not s.idle
    with pytest.raises(ValueError):
        s.add_group_budget(1)


def test_lockstep_admission_hand_computed():
    a = LockstepAdmission(batch_size=4)  # groups_per_step 2 x G 2
    for _ in range(4):
        assert a.can_admit(version=7)
        a.on_start()
    assert a.capacity(7) == 0 and not a.can_admit(0)  # never more than one batch in flight
    a.on_finish(accepted=True)
    a.on_finish(accepted=False)
    assert (a.running, a.accepted, a.capacity(7)) == (2, 1, 2)
    a.on_discard(5)
    assert a.accepted == 0
    with pytest.raises(RuntimeError):
        LockstepAdmission(1).on_finish(accepted=True)
    with pytest.raises(ValueError):
        LockstepAdmission(0)


def test_lockstep_admission_has_the_staleness_managers_interface():
    for name in ("can_admit", "capacity", "on_start", "on_finish", "on_discard", "accepted", "running"):
        assert hasattr(LockstepAdmission(2), name) and hasattr(StalenessManager(2, 0), name)


def test_group_ids_carry_the_learner_prefix():
    s = GroupScheduler([task("a")], group_size=2, id_prefix="abc123-")
    assert s.next_rollout().group_id == "abc123-g0-a"


def test_scheduler_state_round_trip_continues_the_same_task_order():
    tasks = [task(x) for x in "abcdef"]
    ref = GroupScheduler(tasks, group_size=2, seed=3)
    first = [ref.next_rollout() for _ in range(4)]  # 2 groups: tasks from the first shuffled round
    for r in first:
        ref.on_trajectory(traj(r, "SUCCESS", 1.0))
    state = ref.state_dict()
    expected = [ref.next_rollout().task.id for _ in range(20)][::2]
    fresh = GroupScheduler(tasks, group_size=2, seed=99, id_prefix="new-")
    fresh.load_state_dict(state)
    resumed = [fresh.next_rollout() for _ in range(20)]
    assert [r.task.id for r in resumed][::2] == expected
    assert resumed[0].group_id == f"new-g2-{expected[0]}"  # the group counter continues
    assert fresh.task_stats[first[0].task.id]["successes"] == 2
    assert sum(c["completed"] for c in fresh.task_stats.values()) == 2
    with pytest.raises(ValueError):
        fresh.load_state_dict({"schema": 1, "rng": "nonsense"})


def test_pending_trainable_counts_results_of_open_groups():
    s = GroupScheduler([task("a")], group_size=3)
    r = [s.next_rollout() for _ in range(3)]
    s.on_trajectory(traj(r[0], "SUCCESS", 1.0))
    s.on_trajectory(traj(r[1], "FAILURE"))
    assert s.pending_trainable() == 2
    s.on_trajectory(traj(r[2]))
    assert s.pending_trainable() == 0


@pytest.mark.parametrize("override, key", [('learner.schedule="sync"', "learner.schedule"),
                                           ("learner.updates_per_batch=0", "learner.updates_per_batch"),
                                           ("learner.checkpoint_every=-1", "learner.checkpoint_every"),
                                           ("learner.keep_checkpoints=0", "learner.keep_checkpoints")])
def test_schedule_and_checkpoint_settings_are_validated(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, [override])
    assert load_config(None, ['learner.schedule="lockstep"', "learner.updates_per_batch=2"]).learner.schedule == "lockstep"
