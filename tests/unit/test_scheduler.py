"""Group scheduler and batcher: groups of G, re-issues, deadlines, replay injection, zero-variance drops."""

import pytest

from arpo_async.messages import Step, Trajectory
from arpo_async.tasks import Task
from learner.algo.batcher import Batcher, policy_lag
from learner.algo.samples import train_samples
from learner.algo.replay import SuccessReplay
from learner.rollouts.scheduler import GroupScheduler


def task(task_id: str) -> Task:
    return Task.from_dict({"id": task_id, "instruction": f"do {task_id}", "config": [],
                           "evaluator": {"func": "exact_match", "result": {"type": "vm_file", "path": "/r"},
                                         "expected": {"type": "rule", "rules": {"expected": "x"}}}})


def traj(rollout, outcome="FAILURE", score=0.0, versions=(0,), index=0, tid=None) -> Trajectory:
    step = Step([1, 2], [0], [5] * len(versions), [-1.0] * len(versions), list(versions), "t", "wait()")
    return Trajectory(tid or f"t{rollout.group_id}-{rollout.rollout_index}-{index}", "a", rollout.task.id,
                      rollout.group_id, rollout.rollout_index, outcome, score, True, [step], [b"png"])


def test_groups_of_g_round_robin_over_tasks():
    s = GroupScheduler([task("a"), task("b")], group_size=3, seed=1)
    rollouts = [s.next_rollout() for _ in range(6)]
    assert [r.rollout_index for r in rollouts] == [0, 1, 2, 0, 1, 2]
    assert len({r.group_id for r in rollouts[:3]}) == 1
    assert {rollouts[0].task.id, rollouts[3].task.id} == {"a", "b"}  # each task once per round
    assert s.running == 6


def test_group_completes_and_env_errors_are_reissued_first():
    s = GroupScheduler([task("a")], group_size=2, max_retries=1)
    r0, r1 = s.next_rollout(), s.next_rollout()
    assert s.on_trajectory(traj(r0, "ENV_ERROR")) is None
    again = s.next_rollout()
    assert (again.group_id, again.rollout_index) == (r0.group_id, 0)  # the re-issue comes before a new group
    assert s.on_trajectory(traj(r1, "SUCCESS", 1.0)) is None
    assert s.on_trajectory(traj(again, "ENV_ERROR", index=1)) is not None  # retries spent: the slot is final
    with pytest.raises(KeyError):
        s.on_trajectory(traj(r1, "SUCCESS", 1.0, index=2))  # slot no longer running


def test_expired_rollouts_are_reissued():
    s = GroupScheduler([task("a")], group_size=2, rollout_timeout_s=10)
    r0 = s.next_rollout(now=0.0)
    assert s.expire(now=5.0) == 0
    assert s.expire(now=10.0) == 1 and s.running == 0
    again = s.next_rollout(now=11.0)
    assert (again.group_id, again.rollout_index) == (r0.group_id, r0.rollout_index)


def complete_group(s, outcomes_scores):
    rollouts = [s.next_rollout() for _ in outcomes_scores]
    group = None
    for r, (outcome, score) in zip(rollouts, outcomes_scores):
        group = s.on_trajectory(traj(r, outcome, score)) or group
    return group


def test_batcher_injects_replay_into_all_failed_group_and_drops_zero_variance():
    s = GroupScheduler([task("a")], group_size=4)
    b = Batcher(SuccessReplay(seed=0), max_staleness=1, groups_per_step=1)
    first = b.add_group(complete_group(s, [("SUCCESS", 1.0)] + [("FAILURE", 0.0)] * 3), version=0)
    assert first is not None and not first.injected
    assert first.advantages == pytest.approx([1.5, -0.5, -0.5, -0.5], rel=1e-5)  # sample std (ddof=1), as ARPO/EasyR1
    assert b.take_batch() == [first] and b.take_batch() is None
    second = b.add_group(complete_group(s, [("FAILURE", 0.0)] * 4), version=0)
    assert second.injected and second.trajectories[0].outcome == "SUCCESS"
    assert second.sampled_success == 0.0
    off = Batcher(SuccessReplay(enabled=False), max_staleness=1, groups_per_step=1)
    assert off.add_group(complete_group(s, [("FAILURE", 0.0)] * 4), version=0) is None
    assert off.drops["zero_variance"] == 1


def test_batcher_drops_stale_and_env_errors():
    s = GroupScheduler([task("a")], group_size=3, max_retries=0)
    rollouts = [s.next_rollout() for _ in range(3)]
    group = None
    for r, versions, outcome in zip(rollouts, [(0,), (2,), (2,)], ["SUCCESS", "FAILURE", "ENV_ERROR"]):
        t = traj(r, outcome, 1.0 if outcome == "SUCCESS" else 0.0, versions=versions)
        group = s.on_trajectory(t) or group
    b = Batcher(SuccessReplay(), max_staleness=1, groups_per_step=1)
    assert b.add_group(group, version=2) is None  # lag 2 > eta 1 drops one, ENV_ERROR another -> too small
    assert b.drops == {"stale": 1, "env_error": 1, "group_too_small": 1}


def test_policy_lag_and_train_samples():
    s = GroupScheduler([task("a")], group_size=2)
    r0, r1 = s.next_rollout(), s.next_rollout()
    t0, t1 = traj(r0, "SUCCESS", 1.0, versions=(1, 2)), traj(r1, "FAILURE", 0.0, versions=(2, 2))
    assert policy_lag(t0, 3) == 2
    s.on_trajectory(t0)
    group = s.on_trajectory(t1)
    b = Batcher(SuccessReplay(), max_staleness=4, groups_per_step=1)
    scored = b.add_group(group, version=3)
    samples = train_samples([scored])
    assert [x.advantage for x in samples] == pytest.approx(scored.advantages)
    assert samples[0].images == [b"png"] and samples[0].output_ids.tolist() == [5, 5]
    assert samples[0].behaviour_logprobs.tolist() == [-1.0, -1.0]


def test_stratified_batches_take_the_oldest_group_of_each_task_first():
    s = GroupScheduler([task("a"), task("b"), task("c")], group_size=2, seed=0)
    mixed = [("SUCCESS", 1.0), ("FAILURE", 0.0)]
    groups = [complete_group(s, mixed) for _ in range(6)]  # round-robin: each task twice
    order = [g.task.id for g in groups]
    plain = Batcher(SuccessReplay(enabled=False), max_staleness=1, groups_per_step=2)
    strat = Batcher(SuccessReplay(enabled=False), max_staleness=1, groups_per_step=2, stratified=True)
    # present them with one task twice at the front: a, a, b, b, c, c
    ordered = sorted(groups, key=lambda g: order.index(g.task.id))
    for b in (plain, strat):
        for g in ordered:
            b.add_group(g, version=0)
    assert [g.task_id for g in plain.take_batch()] == [ordered[0].task.id] * 2
    a, b, c = ordered[0].task.id, ordered[2].task.id, ordered[4].task.id
    batches = [[g.task_id for g in strat.take_batch()] for _ in range(3)]
    assert batches == [[a, b], [a, b], [c, c]]  # distinct while two tasks are ready, then the oldest left
    assert strat.take_batch() is None and strat.ready == []


def test_stratified_batches_fill_with_the_oldest_when_too_few_tasks_are_ready():
    s = GroupScheduler([task("a")], group_size=2)
    b = Batcher(SuccessReplay(enabled=False), max_staleness=1, groups_per_step=2, stratified=True)
    for _ in range(3):
        b.add_group(complete_group(s, [("SUCCESS", 1.0), ("FAILURE", 0.0)]), version=0)
    oldest = list(b.ready)
    assert b.take_batch() == oldest[:2] and b.ready == oldest[2:]


def test_samples_of_a_received_trajectory_keep_its_arrays_and_pickle_for_other_ranks():
    """What the learner received (arrays viewing the message, screenshots viewing their frames) reaches the
    TrainSample as it is, and pickles (torch.distributed sends samples to the other ranks as objects)."""
    import pickle

    from arpo_async import codec

    s = GroupScheduler([task("a")], group_size=2)
    r0, r1 = s.next_rollout(), s.next_rollout()
    received = []
    for r, outcome, score in ((r0, "SUCCESS", 1.0), (r1, "FAILURE", 0.0)):
        sent = traj(r, outcome, score, versions=(1, 2))
        sent.screenshots = [bytes(range(256)) * 20]  # a blob: its own frame
        received.append(codec.decode(codec.encode(sent), max_bytes=1 << 24))
    s.on_trajectory(received[0])
    group = s.on_trajectory(received[1])
    samples = train_samples([Batcher(SuccessReplay(), max_staleness=4, groups_per_step=1).add_group(group, 3)])
    step = received[0].steps[0]
    assert samples[0].prompt_ids is step.prompt_ids and samples[0].behaviour_logprobs is step.logprobs
    assert type(samples[0].images[0]) is memoryview
    copy = pickle.loads(pickle.dumps(samples[0]))
    assert copy.images == [bytes(range(256)) * 20] and type(copy.images[0]) is bytes
    assert copy.prompt_ids.tolist() == step.prompt_ids.tolist() and copy.advantage == samples[0].advantage
