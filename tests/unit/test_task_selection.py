"""Reference tests for learner.algo.task_selection: task pre-pass, valuable tasks, online retirement and revisits."""

from __future__ import annotations

import random

import msgpack
import pytest

from arpo_async.tasks import Task
from learner.algo.prepass import PrepassExhausted, TaskPrepass, prepass_plan, valuable_tasks
from learner.algo.task_selection import TaskSelectionError, TaskSelector, trainable_scores
from learner.rollouts.scheduler import GroupScheduler


def task(task_id: str) -> Task:
    return Task.from_dict({"id": task_id, "instruction": f"do {task_id}", "config": [],
                           "evaluator": {"func": "exact_match", "result": {"type": "vm_file", "path": "/r"},
                                         "expected": {"type": "rule", "rules": {"expected": "x"}}}})


POOL = [task(name) for name in ("a", "b", "c", "d")]
SOLVED = [1.0] * 4
FAILED = [0.0] * 4


def ids(picks: list[Task]) -> list[str]:
    return [t.id for t in picks]


# ---------------------------------------------------------------- task pre-pass


def test_prepass_plan_and_valuable_tasks():
    assert [(t.id, k) for t, k in prepass_plan(POOL, 8)] == [("a", 8), ("b", 8), ("c", 8), ("d", 8)]
    results = {"a": [0, 0, 1, 0], "b": [0, 0.1, 0.05, 0], "c": [1, 1, 1, 1], "d": [], "e": [0.05, 0.6, 0.3, 1.0]}
    assert valuable_tasks(results) == ["a", "c", "e"]  # "d" has no result, "b" no score above 0.1 (e: 3 of 4)
    assert valuable_tasks(results, drop_solved=True) == ["a", "e"]  # "c" solved 4/4
    assert valuable_tasks(results, min_success=2) == ["c", "e"]
    with pytest.raises(TaskSelectionError):
        prepass_plan(POOL, 0)
    with pytest.raises(TaskSelectionError, match="duplicate"):
        prepass_plan([task("a"), task("a")], 2)
    with pytest.raises(TaskSelectionError):
        valuable_tasks(results, min_success=0)


def test_prepass_as_a_scheduler_task_source():
    prepass = TaskPrepass(POOL[:3], k=6, group_size=4)  # ceil(6 / 4) = 2 groups per task
    picks = [prepass.pick_task() for _ in range(6)]
    assert ids(picks) == ["a", "b", "c", "a", "b", "c"]
    assert prepass.exhausted and not prepass.done
    with pytest.raises(PrepassExhausted):
        prepass.pick_task()
    for task_id, scores in [("a", FAILED), ("b", FAILED), ("c", SOLVED), ("a", [0, 1, 0, 0]), ("b", FAILED),
                            ("c", SOLVED)]:
        assert prepass.record_group(task_id, scores)
    assert not prepass.record_group("zzz", FAILED)
    assert prepass.done
    assert prepass.valuable() == ["a", "c"]
    assert prepass.valuable(drop_solved=True) == ["a"]


# ---------------------------------------------------------------- online selection


def test_round_robin_without_retirement_matches_the_scheduler_order():
    """Same seed, same pool: the selector's rounds are the GroupScheduler's own shuffled round-robin."""
    selector = TaskSelector(POOL, retire=False, seed=3)
    scheduler = GroupScheduler(POOL, group_size=2, seed=3)
    from_scheduler = [scheduler.next_rollout().task.id for _ in range(2 * 12)][::2]
    assert ids([selector.pick_task() for _ in range(12)]) == from_scheduler
    # and by hand: each round is Random(3).sample(pool, 4) taken from the end
    rng = random.Random(3)
    expected = [t for _ in range(3) for t in reversed(rng.sample(["a", "b", "c", "d"], 4))]
    assert from_scheduler == expected


def test_retire_after_a_full_window_of_successes_and_revisit_every_n():
    selector = TaskSelector(POOL, window=2, revisit_every=3, seed=0)
    selector.record_group("a", SOLVED)
    assert selector.retired == []  # window not full yet (1 of 2 groups)
    selector.record_group("a", SOLVED)
    assert selector.retired == ["a"] and selector.active == ["b", "c", "d"]
    picks = ids([selector.pick_task() for _ in range(9)])
    # picks 3, 6 and 9 are revisits of the only retired task; the others never return it
    assert [picks[2], picks[5], picks[8]] == ["a", "a", "a"]
    assert "a" not in picks[:2] + picks[3:5] + picks[6:8]
    assert selector.stats()["revisits"] == 3 and selector.stats()["retirements"] == 1


def test_a_failure_in_the_window_prevents_retirement():
    selector = TaskSelector(POOL, window=2)
    selector.record_group("a", [1.0, 1.0, 0.0, 1.0])
    selector.record_group("a", SOLVED)
    assert selector.retired == []  # the window holds a group with one failure
    selector.record_group("a", SOLVED)
    assert selector.retired == ["a"]  # that group has left the 2-group window


def test_failed_revisit_reactivates_and_successful_revisit_keeps_retired():
    selector = TaskSelector(POOL, window=1)
    selector.record_group("a", SOLVED)
    selector.record_group("b", SOLVED)
    assert selector.retired == ["a", "b"]
    selector.record_group("a", SOLVED)  # revisit solved again: stays retired
    selector.record_group("b", [1.0, 0.0, 1.0, 1.0])  # revisit with a failure: active again
    assert selector.retired == ["a"] and selector.stats()["reactivations"] == 1
    selector.record_group("b", SOLVED)
    assert selector.retired == ["a", "b"]  # a whole window of all-success groups again
    assert selector.stats()["retirements"] == 3


def test_all_retired_cycles_least_recently_picked_first():
    selector = TaskSelector(POOL[:3], window=1, revisit_every=0)
    for name in ("a", "b", "c"):
        selector.record_group(name, SOLVED)
    picks = ids([selector.pick_task() for _ in range(6)])
    assert picks == ["a", "b", "c", "a", "b", "c"]  # never picked: pool order; then least recently picked


def test_revisit_probability_is_seeded():
    selector = TaskSelector(POOL, window=1, revisit_every=0, revisit_prob=0.25, seed=9)
    selector.record_group("a", SOLVED)
    picks = ids([selector.pick_task() for _ in range(400)])
    assert 40 < picks.count("a") < 160  # expected 100, sd sqrt(400 * 0.25 * 0.75) = 8.7
    again = TaskSelector(POOL, window=1, revisit_every=0, revisit_prob=0.25, seed=9)
    again.record_group("a", SOLVED)
    assert ids([again.pick_task() for _ in range(400)]) == picks


def test_uncertainty_weights_by_hand():
    selector = TaskSelector(POOL[:3], window=4, strategy="uncertainty", retire=False, seed=4)
    selector.record_group("a", [1.0, 0.0, 0.0, 0.0])  # p = (1 + 1) / (4 + 2) = 1/3: w = 2/9
    selector.record_group("b", FAILED)  # p = 1/6: w = 5/36
    # "c" untried: p = 1/2, w = 1/4
    assert selector.success_estimate("a") == pytest.approx(1 / 3)
    assert selector.success_estimate("b") == pytest.approx(1 / 6)
    assert selector.success_estimate("c") == pytest.approx(1 / 2)
    weights = [2 / 9, 5 / 36, 1 / 4]
    rng = random.Random(4)
    expected = []
    for _ in range(30):
        u = rng.random() * sum(weights)
        expected.append("a" if u < weights[0] else "b" if u < weights[0] + weights[1] else "c")
    assert ids([selector.pick_task() for _ in range(30)]) == expected


def test_state_round_trip_continues_the_same_picks():
    selector = TaskSelector(POOL, window=1, revisit_every=5, revisit_prob=0.1, seed=2)
    selector.record_group("c", SOLVED)
    selector.record_group("a", [1.0, 0.0, 1.0, 1.0])
    for _ in range(7):
        selector.pick_task()
    state = msgpack.unpackb(msgpack.packb(selector.state_dict(), use_bin_type=True), raw=False)
    restored = TaskSelector(POOL, window=1, revisit_every=5, revisit_prob=0.1, seed=77)
    restored.load_state_dict(state)
    assert restored.retired == ["c"] and restored.stats() == selector.stats()
    assert restored.success_estimate("a") == selector.success_estimate("a")
    assert ids([restored.pick_task() for _ in range(20)]) == ids([selector.pick_task() for _ in range(20)])
    # a smaller pool: unknown ids are ignored
    smaller = TaskSelector(POOL[:2], window=1)
    smaller.load_state_dict(state)
    assert smaller.retired == [] and smaller.active == ["a", "b"]
    with pytest.raises(TaskSelectionError, match="schema"):
        smaller.load_state_dict({"schema": 0})


def test_trainable_scores_of_a_scheduler_group():
    from arpo_async.messages import Step, Trajectory

    scheduler = GroupScheduler([POOL[0]], group_size=3, max_retries=0)
    group = None
    for (outcome, score), rollout in zip([("SUCCESS", 1.0), ("ENV_ERROR", 0.0), ("FAILURE", 0.0)],
                                         [scheduler.next_rollout() for _ in range(3)]):
        step = Step([1], [], [2], [-1.0], [0], "t", "wait()")
        traj = Trajectory(f"t{rollout.rollout_index}", "x", "a", rollout.group_id, rollout.rollout_index, outcome,
                          score, True, [step], [])
        group = scheduler.on_trajectory(traj) or group
    assert trainable_scores(group) == [1.0, 0.0]


def test_scheduler_hook_shape():
    """What the GroupScheduler needs: a zero-argument callable returning a pool task, and a results sink."""
    selector = TaskSelector(POOL, window=4)
    pick_task = selector.pick_task
    assert pick_task().id in {"a", "b", "c", "d"}
    assert selector.record_group("a", SOLVED) and not selector.record_group("nope", SOLVED)
    assert selector.stats()["unknown_groups"] == 1


@pytest.mark.parametrize("kwargs", [{"window": 0}, {"revisit_every": -1}, {"revisit_prob": 1.5},
                                    {"strategy": "greedy"}, {"solved_rate": 0.0}, {"solved_rate": 1.01},
                                    {"solved_rate": float("nan")}])
def test_bad_parameters_are_rejected(kwargs):
    with pytest.raises(TaskSelectionError):
        TaskSelector(POOL, **kwargs)
    with pytest.raises(TaskSelectionError, match="empty"):
        TaskSelector([])


def test_learner_prepass_file_is_written_reused_and_checked(tmp_path):
    from arpo_async.config import LearnerConfig
    from learner.algo.prepass import load_prepass, plan_prepass, save_prepass, valuable_pool

    lc = LearnerConfig(prepass_k=2, group_size=2)
    path = tmp_path / "prepass.json"
    prepass = plan_prepass(POOL, lc, path, resuming=False)
    assert prepass is not None and prepass.planned_groups == 4
    assert plan_prepass(POOL, LearnerConfig(), path, resuming=False) is None  # prepass_k = 0: no pass
    assert plan_prepass(POOL, lc, path, resuming=True) is None  # a run that trained without one
    for t in POOL:
        prepass.pick_task()
        prepass.record_group(t.id, [1.0, 0.0] if t.id in ("b", "d") else [0.0, 0.0])
    assert save_prepass(path, prepass, lc) == ["b", "d"]
    assert load_prepass(path) == ["b", "d"]
    assert plan_prepass(POOL, lc, path, resuming=False) is None  # a restart reuses the finished pass
    assert [t.id for t in valuable_pool(POOL, ["d", "b"])] == ["b", "d"]
    with pytest.raises(ValueError, match="none of the task pre-pass's valuable tasks"):
        valuable_pool(POOL, ["zz"])


def test_learner_prepass_with_no_valuable_task_is_a_clear_error(tmp_path):
    from arpo_async.config import LearnerConfig
    from learner.algo.prepass import save_prepass

    lc = LearnerConfig(prepass_k=2, group_size=2)
    prepass = TaskPrepass(POOL[:2], k=2, group_size=2)
    for t in POOL[:2]:
        prepass.pick_task()
        prepass.record_group(t.id, [0.0, 0.0])
    with pytest.raises(ValueError, match=r"no task with >= 1 successes in 2 rollouts .*'a': '0/2'"):
        save_prepass(tmp_path / "prepass.json", prepass, lc)
    assert not (tmp_path / "prepass.json").exists()


@pytest.mark.parametrize("text", ["{not json", '{"k": 2}', '{"valuable": []}', '{"valuable": "b"}', "[1]",
                                  '{"valuable": [1, 2]}'])
def test_a_damaged_prepass_file_is_a_clear_error(tmp_path, text):
    from learner.algo.prepass import load_prepass

    path = tmp_path / "prepass.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="prepass.json.*remove it to run the pass again"):
        load_prepass(path)


def test_an_older_run_folders_baseline_json_is_read_on_resume(tmp_path):
    """Issue 52 item 3: a run folder written when the pre-pass was the "baseline pass" holds baseline.json; resuming
    it trains on the tasks that file kept and runs no new pass (on c7b7a74 the new file name is not there at all)."""
    import json

    from arpo_async.config import LearnerConfig
    from learner.algo.prepass import OLD_PREPASS_FILE, PREPASS_FILE, plan_tasks, prepass_path

    lc = LearnerConfig(prepass_k=2, group_size=2)
    assert prepass_path(tmp_path) == tmp_path / PREPASS_FILE == tmp_path / "prepass.json"  # a new run
    (tmp_path / OLD_PREPASS_FILE).write_text(json.dumps({"k": 2, "results": {}, "valuable": ["c", "a"]}))
    assert prepass_path(tmp_path) == tmp_path / "baseline.json"
    for resuming in (True, False):  # a checkpoint or none yet: either way the finished pass is reused
        plan = plan_tasks(POOL, lc, tmp_path, resuming=resuming)
        assert plan.prepass is None and ids(plan.pool) == ["a", "c"] and plan.selector is not None
    assert not (tmp_path / PREPASS_FILE).exists()  # nothing is written over or beside the older run's file
    (tmp_path / OLD_PREPASS_FILE).write_text('{"valuable": []}')  # a damaged old file is named as such
    with pytest.raises(ValueError, match="baseline.json.*remove it to run the pass again"):
        plan_tasks(POOL, lc, tmp_path, resuming=True)
    (tmp_path / PREPASS_FILE).write_text(json.dumps({"k": 2, "results": {}, "valuable": ["d"]}))
    assert ids(plan_tasks(POOL, lc, tmp_path, resuming=True).pool) == ["d"]  # the new file wins when both exist


def test_a_task_with_task_errors_in_a_row_is_set_aside_and_never_picked_again():
    """Issue 24 item 1: TASK_ERROR rollouts in a row set a task aside (another outcome restarts the count); it is
    named in stats, survives a checkpoint, and with every task set aside a pick raises NoTaskLeft."""
    from learner.algo.task_selection import NoTaskLeft

    selector = TaskSelector(POOL, task_error_limit=3, seed=1)
    assert not selector.record_rollout("a", True) and not selector.record_rollout("a", True)
    assert not selector.record_rollout("a", False)  # another outcome: the count starts again
    assert [selector.record_rollout("a", True) for _ in range(3)] == [False, False, True]
    assert selector.set_aside == ["a"] and selector.stats()["set_aside"] == ["a"] and "a" not in selector.active
    assert all(selector.pick_task().id != "a" for _ in range(40))
    restored = TaskSelector(POOL, task_error_limit=3)
    restored.load_state_dict(msgpack.unpackb(msgpack.packb(selector.state_dict())))
    assert restored.set_aside == ["a"]
    for other in ("b", "c", "d"):
        for _ in range(3):
            restored.record_rollout(other, True)
    with pytest.raises(NoTaskLeft, match="every task has been set aside"):
        restored.pick_task()
    never = TaskSelector(POOL, task_error_limit=0)
    assert not any(never.record_rollout("a", True) for _ in range(10)) and never.set_aside == []


def test_a_set_aside_task_is_not_revisited_when_every_other_task_is_retired():
    selector = TaskSelector(POOL[:2], window=1, task_error_limit=1, revisit_every=1)
    selector.record_rollout("a", True)
    selector.record_group("b", [1.0, 1.0])  # b retired, a set aside: revisits go to b only
    assert selector.retired == ["b"] and [selector.pick_task().id for _ in range(5)] == ["b"] * 5


# ---------------------------------------------------------------- solved tasks and the run's end (issue 49 item 1)

ONE_MISS = [1.0, 1.0, 0.0, 1.0]  # 3 of 4 succeed: the group has a reward difference


def test_defaults_retire_after_four_all_success_groups_and_the_pool_is_solved():
    """Defaults: window 4 groups, rate 1.0. Three all-success groups are not enough; the fourth retires the task,
    and with the only other task set aside after task errors the pool is solved."""
    selector = TaskSelector(POOL[:2], task_error_limit=1)
    selector.record_rollout("b", True)  # b set aside (task errors): it never counts for or against solving
    for _ in range(3):
        selector.record_group("a", SOLVED)
    assert selector.retired == [] and not selector.solved and not selector.is_solved("a")
    selector.record_group("a", SOLVED)
    assert selector.retired == ["a"] and selector.is_solved("a") and selector.solved
    assert selector.solved_reason() == ("every task is solved in its last 4 groups: training stops "
                                        "(learner.stop_when_solved = false keeps it going)")


def test_solved_rate_counts_all_success_groups_by_hand():
    """rate 0.75 of 4 groups needs 3 all-success groups; 0.8 of 4 needs 3.2, so all 4; a rollout-level success
    rate of 15/16 over the window does not make a group all-success."""
    groups = [SOLVED, SOLVED, ONE_MISS, SOLVED]  # 15 of 16 rollouts succeed; 3 of 4 groups are all-success
    three_quarters, four_fifths = TaskSelector(POOL[:1], solved_rate=0.75), TaskSelector(POOL[:1], solved_rate=0.8)
    for scores in groups:
        three_quarters.record_group("a", scores)
        four_fifths.record_group("a", scores)
    assert three_quarters.solved and not four_fifths.solved
    assert three_quarters.success_estimate("a") == pytest.approx((15 + 1) / (16 + 2))
    assert three_quarters.solved_reason().startswith(
        "every task is solved in its last 4 groups (3 of them with every rollout successful): training stops")
    three_quarters.record_group("a", ONE_MISS)  # window S, ONE_MISS, S, ONE_MISS: 2 all-success groups < 3
    assert three_quarters.active == ["a"] and not three_quarters.solved
    assert three_quarters.stats()["reactivations"] == 1


def test_a_revisit_that_keeps_the_window_solved_keeps_the_task_retired():
    selector = TaskSelector(POOL[:1], solved_rate=0.75)
    for scores in (ONE_MISS, SOLVED, SOLVED, SOLVED):
        selector.record_group("a", scores)
    assert selector.solved
    selector.record_group("a", ONE_MISS)  # window S, S, S, ONE_MISS: still 3 of 4
    assert selector.solved and selector.stats()["reactivations"] == 0


def test_groups_without_a_reward_difference_that_all_fail_never_solve_a_task():
    """A policy that always fails (or one trained against the task: reward inverted) also gives groups with no
    reward difference, but success is the evaluator's score above the threshold: never solved. Scores at the
    threshold are no success (strictly above 0.1)."""
    selector = TaskSelector(POOL[:1])
    for _ in range(10):
        selector.record_group("a", FAILED)
        selector.record_group("a", [0.1] * 4)
    assert not selector.solved and selector.retired == [] and selector.stats()["retirements"] == 0


def test_a_group_without_a_trainable_rollout_is_no_evidence():
    selector = TaskSelector(POOL[:1], window=2)
    selector.record_group("a", SOLVED)
    assert selector.record_group("a", [])  # every rollout ENV_ERROR or ABORTED: trainable_scores is empty
    assert not selector.solved and selector.success_estimate("a") == pytest.approx(5 / 6)
    selector.record_group("a", SOLVED)
    assert selector.solved


def test_retirement_off_or_every_task_set_aside_is_never_solved():
    off = TaskSelector(POOL[:1], retire=False, window=1)
    off.record_group("a", SOLVED)
    assert off.is_solved("a") and not off.solved and off.active == ["a"]
    broken = TaskSelector(POOL[:1], task_error_limit=1)
    broken.record_rollout("a", True)
    assert not broken.solved  # nothing left at all is NoTaskLeft (an error), never "solved"


def test_two_tasks_are_solved_only_when_both_are_and_a_failed_revisit_unsolves():
    selector = TaskSelector(POOL[:2], window=1, revisit_every=2, seed=5)
    selector.record_group("a", SOLVED)
    assert selector.retired == ["a"] and not selector.solved
    picks = ids([selector.pick_task() for _ in range(4)])
    assert picks == ["b", "a", "b", "a"]  # every second pick revisits a
    selector.record_group("b", SOLVED)
    assert selector.solved
    selector.record_group("a", ONE_MISS)  # a revisit of a fails
    assert not selector.solved and selector.active == ["a"]


def test_a_schema_1_state_loads_without_its_rollout_windows():
    selector = TaskSelector(POOL[:2])
    state = {"schema": 1, "rng": list(random.Random(1).getstate()), "order": ["b"],
             "windows": {"a": [1, 1, 1, 1, 1, 1, 1, 1]}, "retired": ["a"], "last_pick": {"a": 3},
             "counts": {"picks": 3, "retirements": 1}}
    state["rng"][1] = list(state["rng"][1])
    selector.load_state_dict(state)
    assert selector.retired == ["a"] and selector.success_estimate("a") == 0.5  # the window fills again
    bad = selector.state_dict() | {"windows": {"a": [[5, 3]]}}  # more successes than rollouts
    with pytest.raises(TaskSelectionError, match="malformed"):
        TaskSelector(POOL[:2]).load_state_dict(bad)


def test_a_frozen_selector_keeps_the_tasks_that_stopped_the_run_solved():
    # The run stops as solved, then groups still in flight finish during the final evaluation and shutdown: a failed
    # one used to reactivate the task, so status.json said "solved: []" beside the solved line.
    selector = TaskSelector(POOL, window=2, seed=0)
    selector.record_group("a", SOLVED)
    selector.record_group("a", SOLVED)
    assert selector.retired == ["a"]
    selector.freeze()
    selector.record_group("a", [0.0] * len(SOLVED))
    selector.record_group("b", SOLVED)
    selector.record_group("b", SOLVED)
    assert selector.retired == ["a"] and selector.stats()["reactivations"] == 0
