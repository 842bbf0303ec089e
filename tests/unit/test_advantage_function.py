"""The advantage seam (learner.algo.advantages, ``learner.advantage_function``): GRPO's rule by default, a function
named as "module:function" in its place, and clear errors for a bad name or a bad result. The per-group stages run
through the real Batcher, as the training loop runs them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from arpo_async.messages import Step, Trajectory
from arpo_async.tasks import Task
from learner.algo.advantages import AdvantageFunctionError, grpo_advantages, load_advantage_function
from learner.algo.batcher import Batcher
from learner.algo.grpo import group_advantages
from learner.algo.replay import make_replay
from learner.main import main as learner_main
from learner.rollouts.scheduler import Group
from tests.support import ADVANTAGE_LOG_ENV, recording_advantages

TASK = Task.from_dict({"id": "grid4-red", "instruction": "click red", "config": [],
                       "evaluator": {"func": "exact_match", "result": {"type": "vm_file", "path": "/r"},
                                     "expected": {"type": "rule", "rules": {"expected": "red"}}}})


def group(scores: list[float]) -> Group:
    """A complete group of ``TASK`` whose trajectories scored ``scores`` (all well formatted, version 0)."""
    trajectories = {k: Trajectory(f"t{k}", "a", TASK.id, "g0", k, "SUCCESS" if score > 0.1 else "FAILURE", score,
                                  True, [Step([1, 2], [0], [5, 6], [-1.0, -1.0], [0, 0], "t", "click")], [b"png"])
                    for k, score in enumerate(scores)}
    return Group("g0", TASK, len(scores), results=trajectories)


def batcher(function) -> Batcher:
    return Batcher(make_replay("off"), max_staleness=0, groups_per_step=1, advantage_function=function)


def test_the_default_is_grpos_rule():
    assert load_advantage_function("") is grpo_advantages
    scored = batcher(load_advantage_function("")).add_group(group([1.0, 0.0, 0.0, 0.0]), 0)
    assert scored.rewards == [1.0, 0.0, 0.0, 0.0]  # every reply parsed: no format penalty
    assert scored.advantages == pytest.approx(group_advantages([1.0, 0.0, 0.0, 0.0]).tolist())
    assert scored.advantages == pytest.approx([1.5, -0.5, -0.5, -0.5], rel=1e-5)  # std + eps, eps = 1e-6


def test_a_named_function_replaces_the_rule_in_the_advantages_stage(tmp_path, monkeypatch):
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv(ADVANTAGE_LOG_ENV, str(log))
    function = load_advantage_function("tests.support:recording_advantages")
    assert function is recording_advantages
    stages = batcher(function)
    scored = stages.add_group(group([1.0, 0.0, 0.0, 0.0]), 0)
    assert scored.advantages == pytest.approx([0.75, -0.25, -0.25, -0.25])  # the rewards less their mean
    assert stages.add_group(group([0.0, 0.0]), 0) is None  # no reward difference: dropped before the function
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls == [{"task_id": TASK.id, "rewards": [1.0, 0.0, 0.0, 0.0]}]
    assert stages.drops["zero_variance"] == 1 and stages.ready == [scored]


@pytest.mark.parametrize("path, message", [
    ("tests.support", "must be 'package.module:function'"),
    (":recording_advantages", "must be 'package.module:function'"),
    ("tests.no_such_module:f", "does not import: ModuleNotFoundError"),
    ("tests.support:no_such_function", "has no callable 'no_such_function'"),
    ("tests.support:ADVANTAGE_LOG_ENV", "has no callable 'ADVANTAGE_LOG_ENV'"),  # a string, not a function
])
def test_a_bad_name_is_refused_with_what_is_wrong(path, message):
    with pytest.raises(ValueError, match=message):
        load_advantage_function(path)


@pytest.mark.parametrize("result", [
    lambda rewards, task_id: rewards[:-1],  # one short
    lambda rewards, task_id: rewards * np.nan,  # not finite
    lambda rewards, task_id: "high",  # no numbers
    lambda rewards, task_id: 1 // 0,  # raises ZeroDivisionError: stops too, never drops the group quietly
])
def test_a_bad_result_stops_the_stage_naming_the_function_and_the_task(result):
    with pytest.raises(AdvantageFunctionError, match=f"advantage function .*task {TASK.id!r}"):
        batcher(result).add_group(group([1.0, 0.0, 0.0]), 0)


def test_the_learner_refuses_a_bad_name_before_it_loads_the_model(tmp_path, caplog):
    code = learner_main(["--set", f'run_dir="{tmp_path / "run"}"', "--set", 'model="/no/such/model"',
                         "--set", 'learner.advantage_function="tests.support:no_such_function"'])
    assert code == 2
    assert "has no callable 'no_such_function'" in caplog.text
