"""One definition of success: every counter, selector and buffer, built as a run builds it from a LearnerConfig,
gives the same verdict on a trajectory's score as arpo_async.success.is_success (score > learner.success_threshold).

A score of 0.3 is a success everywhere with the default threshold (ARPO's 0.1) and a failure everywhere with 0.5.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from actors.episode import episode_outcome
from actors.eval.report import build_report
from actors.eval.runner import record_of
from arpo_async.config import ConfigError, LearnerConfig
from arpo_async.messages import Outcome, Step, Trajectory
from arpo_async.success import DEFAULT_SUCCESS_THRESHOLD, is_success
from arpo_async.task_sets import TaskEntry
from arpo_async.tasks import Task
from learner.algo.prepass import TaskPrepass, save_prepass, task_selector
from learner.algo.batcher import Batcher
from learner.main import replay_buffer
from learner.rollouts.run_stats import WindowStats
from learner.rollouts.scheduler import Group
from learner.train.records import per_task_success

TASK = Task.from_dict({"id": "form-name", "instruction": "Type Alice, then click Save.", "config": [],
                       "evaluator": {"func": "infeasible"}})


def test_success_is_a_score_strictly_above_the_threshold():
    assert DEFAULT_SUCCESS_THRESHOLD == 0.1 == LearnerConfig().success_threshold  # ARPO's replay rule
    assert [is_success(s, 0.1) for s in (0.0, 0.05, 0.1, 0.3, 1.0)] == [False, False, False, True, True]
    assert not is_success(math.nan, 0.1)
    for bad in (-0.1, 1.0, math.inf):
        with pytest.raises(ConfigError, match="learner.success_threshold"):
            LearnerConfig(success_threshold=bad)


def evaluated(name: str, score: float, threshold: float, *, format_ok: bool = True) -> Trajectory:
    """A one-step trajectory of TASK whose outcome the actor's rule gives for ``score``."""
    step = Step([10, 99, 12], [0], [30], [-1.0], [3], "Action: finished()", "finished()")
    return Trajectory(name, "actor/0", TASK.id, "g0", 0, episode_outcome(score, format_ok, "DONE", threshold),
                      score, format_ok, [step], [b""], assigned_version=3)


def verdicts(score: float, lc: LearnerConfig, tmp_path: Path) -> dict[str, bool]:
    """Whether each component counts one trajectory scored ``score`` as a success."""
    traj = evaluated("t", score, lc.success_threshold)
    found = {"episode outcome": traj.outcome is Outcome.SUCCESS}
    # the batch's success rate (against a failed rollout whose reply did not parse, so the rewards differ)
    batcher = Batcher(replay_buffer(lc), max_staleness=1, groups_per_step=1,
                      success_threshold=lc.success_threshold)
    other = evaluated("f", 0.0, lc.success_threshold, format_ok=False)
    scored = batcher.add_group(Group("g0", TASK, 2, results={0: traj, 1: other}), version=3)
    assert scored is not None
    found["batch success"] = scored.sampled_success == 0.5
    found[f"replay {lc.replay_mode}, via the batcher"] = [t for t, _ in batcher.replay.stored(TASK.id)] == [traj]
    selector = task_selector([TASK], lc)
    selector.record_group(TASK.id, [score])
    found["task selection"] = selector.success_estimate(TASK.id) == 2 / 3  # (1 + 1) / (1 + 2), Laplace
    baseline = TaskPrepass([TASK], 1, 1)
    baseline.record_group(TASK.id, [score])
    try:
        found["task pre-pass"] = save_prepass(tmp_path / "prepass.json", baseline, lc) == [TASK.id]
    except ValueError:  # no task had a success
        found["task pre-pass"] = False
    window = WindowStats()
    window.record(TASK, traj.outcome.value)
    found["metrics success rate"] = per_task_success(window)["task_success"] == {TASK.id: 1.0}
    record = record_of(TaskEntry("forms", TASK.id, TASK), 0, traj)
    report = build_report([record], repeats=1, planned=1, meta={})
    found["eval report"] = record.success and report["overall"]["successes"] == 1
    return found


@pytest.mark.parametrize("replay_mode", ["arpo", "prioritized"])
@pytest.mark.parametrize("threshold", [None, 0.5])
@pytest.mark.parametrize("score", [0.05, 0.1, 0.3, 1.0])
def test_every_counter_selector_and_buffer_agrees(score, threshold, replay_mode, tmp_path):
    lc = LearnerConfig(replay_mode=replay_mode, prepass_k=1,
                       **({} if threshold is None else {"success_threshold": threshold}))
    expected = is_success(score, lc.success_threshold)
    assert expected == (score > (0.1 if threshold is None else 0.5))
    found = verdicts(score, lc, tmp_path)
    assert found == dict.fromkeys(found, expected)


def test_a_trajectory_scored_0_3_is_a_success_by_default_and_a_failure_at_0_5(tmp_path):
    assert all(verdicts(0.3, LearnerConfig(prepass_k=1), tmp_path).values())
    assert not any(verdicts(0.3, LearnerConfig(prepass_k=1, success_threshold=0.5), tmp_path).values())
