"""The advantage seam (learner.algo.advantages, ``learner.advantage_function``): GRPO's rule by default, a function
named as "module:function" in its place, and clear errors for a bad name or a bad result. The per-group stages run
through the real Batcher, as the training loop runs them; a custom function runs off the event loop, under a
deadline, on a copy of the rewards, and only bounded real numbers are taken from it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from arpo_async.config import load_config

from arpo_async.messages import Step, Trajectory
from arpo_async.tasks import Task
from learner.algo.advantages import (ADVANTAGE_BOUND, AdvantageFunctionError, advantages_off_loop,
                                     checked_advantages, grpo_advantages, load_advantage_function)
from learner.algo.batcher import Batcher
from learner.algo.grpo import group_advantages
from learner.algo.replay import make_replay
from learner.main import main as learner_main
from learner.rollouts.scheduler import Group
from learner.rollouts.rounds import GroupQueue
from learner.state import RunState
from learner.train.checkpoint import Checkpointer
from learner.train.loop import TrainingLoop
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


# Issue 48 item 7: the function is trusted code (it loads whatever is importable), but the learner still guards its
# own loop and data: the call runs off the event loop under a deadline, gets a copy of the rewards, and a result that
# is not one bounded real number per trajectory stops the learner naming the function. b190f2c: a sleeping function
# froze the event loop, the rewards array came back changed, and 1e308, strings and bools were taken.

BAD_RESULTS = {
    "1e308": lambda rewards, task_id: rewards * 0 + 1e308,
    "just over the bound": lambda rewards, task_id: rewards * 0 + 1e6 * (1 + 1e-9),
    "minus 1e7": lambda rewards, task_id: rewards * 0 - 1e7,
    "strings": lambda rewards, task_id: ["1"] * len(rewards),
    "bools": lambda rewards, task_id: [True, False, True],
    "objects": lambda rewards, task_id: [1.0, None, 2.0],
    "complex": lambda rewards, task_id: rewards + 1j,
    "a column": lambda rewards, task_id: rewards.reshape(-1, 1),
    "a scalar": lambda rewards, task_id: 0.5,
    "None": lambda rewards, task_id: None,
    "inf": lambda rewards, task_id: rewards * 0 + np.inf,
    "nan": lambda rewards, task_id: rewards * np.nan,
}


@pytest.mark.parametrize("name", list(BAD_RESULTS))
def test_a_result_that_is_not_one_bounded_number_per_trajectory_stops_the_stage(name):
    function = BAD_RESULTS[name]
    with pytest.raises(AdvantageFunctionError, match=f"advantage function .*task {TASK.id!r}"):
        batcher(function).add_group(group([1.0, 0.0, 0.0]), 0)
    with pytest.raises(AdvantageFunctionError, match=f"advantage function .*task {TASK.id!r}"):  # off the loop too
        asyncio.run(batcher(function).add_group_async(group([1.0, 0.0, 0.0]), 0))


def test_the_bound_itself_and_integers_are_taken():
    at_bound = lambda rewards, task_id: [ADVANTAGE_BOUND, -ADVANTAGE_BOUND, 0]  # noqa: E731
    assert batcher(at_bound).add_group(group([1.0, 0.0, 0.0]), 0).advantages == [1e6, -1e6, 0.0]
    scored = asyncio.run(batcher(lambda rewards, task_id: [2, -1, -1]).add_group_async(group([1.0, 0.0, 0.0]), 0))
    assert scored.advantages == [2.0, -1.0, -1.0]


def test_the_function_gets_a_copy_of_the_rewards():
    def vandal(rewards, task_id):
        rewards[:] = 1e308  # in place
        return np.array([1.0, -1.0, 0.0])

    rewards = np.array([1.0, 0.0, 0.5])
    assert checked_advantages(vandal, rewards, TASK.id) == [1.0, -1.0, 0.0]
    assert rewards.tolist() == [1.0, 0.0, 0.5]
    assert asyncio.run(advantages_off_loop(vandal, rewards, TASK.id)) == [1.0, -1.0, 0.0]
    assert rewards.tolist() == [1.0, 0.0, 0.5]
    stages = batcher(vandal)
    assert asyncio.run(stages.add_group_async(group([1.0, 0.0, 0.5]), 0)).rewards == [1.0, 0.0, 0.5]


def test_a_custom_function_off_the_loop_gives_what_it_gives_in_the_stage():
    sync = batcher(recording_advantages).add_group(group([1.0, 0.0, 0.0, 0.0]), 0)
    off = asyncio.run(batcher(recording_advantages).add_group_async(group([1.0, 0.0, 0.0, 0.0]), 0))
    assert off.advantages == sync.advantages == pytest.approx([0.75, -0.25, -0.25, -0.25])


async def test_a_stuck_function_leaves_the_event_loop_running_and_stops_the_loop_at_its_deadline(tmp_path):
    """The training loop's collect stage (learner.train.loop) with a function that blocks: the event loop keeps
    turning while it runs in its own thread, and past the deadline the stage stops with an error naming it."""
    release = threading.Event()

    def stuck(rewards, task_id):
        release.wait(60)  # b190f2c: called on the event loop, which then stood still this long
        return rewards - rewards.mean()

    def exits(rewards, task_id):
        raise SystemExit(3)  # never ends the learner's loop by itself: it is reported like any error

    turns = 0

    async def turn():
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0.01)

    turner = asyncio.create_task(turn())
    try:
        for function, message, slow in ((stuck, "'.*stuck' did not return within 1 s for task 'grid4-red'", True),
                                        (exits, "'.*exits' failed or returned no numbers .*SystemExit: 3", False)):
            training = TrainingLoop(None, GroupQueue(), Batcher(make_replay("off"), max_staleness=1, groups_per_step=1,
                                                                advantage_function=function, advantage_timeout_s=1.0),
                                    RunState(), None, None, Checkpointer(tmp_path / "ck"),
                                    load_config(None, []).learner, on_discard=lambda count: None)
            training.groups.put_nowait(group([1.0, 0.0, 0.0]))
            before = turns
            with pytest.raises(AdvantageFunctionError, match=message):
                await asyncio.wait_for(training.collect(), 30)
            assert turns > before or not slow  # the event loop turned while the stuck function ran
    finally:
        release.set()
        turner.cancel()


def test_a_function_that_never_returns_does_not_hold_the_process_at_exit(tmp_path):
    """The learner stops on the deadline error; the function's thread (a daemon, not the default executor's) does
    not keep the process from exiting."""
    script = ("import asyncio, time, numpy as np\n"
              "from learner.algo.advantages import advantages_off_loop\n"
              "def forever(rewards, task_id):\n"
              "    while True: time.sleep(1)\n"
              "asyncio.run(advantages_off_loop(forever, np.array([1.0, 0.0]), 'grid4-red', timeout_s=0.5))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 1 and "AdvantageFunctionError: advantage function 'forever' did not return within" \
        in done.stderr, done.stderr[-2000:]
