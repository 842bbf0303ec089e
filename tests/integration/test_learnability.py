"""Learnability: the product's recipe makes the embedded tiny policy learn, and the test fails when it does not.

In one process, with the learning probe (tests/learning_probe.py, also bench/probe_learning.py's): real desktops
capture each task's click tree (the screenshot after its setup, the app's button boxes, and the task's evaluator
score after a click on each button); the real arpo-serve `Engine` samples with the actors' action grammar (compact
prompt, fixed-width coordinates, forced text emitted as canonical tokens); a reply succeeds when its click lands in
the box of the button the evaluator scores 1 (a click on no button changes nothing and scores 0); the training
loop's own stages (learner.train.loop) train on the groups: score, replay and advantages (the real `Batcher`), the
samples (the forced tokens left out of the loss), ``updates_per_batch`` optimizer steps per batch, the `Trainer`. The
settings are the learning benchmarks' arm a (tests/learning_arms.py: its task setup and the arm's overrides). The whole
run is seeded.

A single task must rise from at most 30% to at least 70% within 40 rollout batches, for a built-in colour task
and for a task of another family (tests/data/tasks/shapes: other labels, no colours, another window title and
phrasing). The same run with the reward inverted (a click in the target's box scores 0, anywhere else 1) trains
away from the target and must not rise, so the test can fail: it fails when the advantage, the loss, the weights
or the reward path stop carrying signal. Nor may it ever count as solved by the learner's task selector (success is
the task's own score, never the reward), so a real run with its reward inverted never stops as solved.
"""

from __future__ import annotations

import asyncio
import statistics
from pathlib import Path

import pytest

from arpo_async.config import load_config
from arpo_async.model.init_model import create_tiny_model
from learner.algo.task_selection import TaskSelector
from tests.learning_arms import ARMS, TASK_SETUP, task_selection
from tests.learning_probe import capture_scenes, run_arm

pytestmark = pytest.mark.docker

ARM = "a"
STEPS = 40
SHAPES = str(Path(__file__).resolve().parent.parent / "data" / "tasks" / "shapes")


def _setup(task: str):
    """The config (the task setup and arm a of tests/learning_arms.py, seed 0) and the captured scene of ``task``."""
    family, selection = (SHAPES, ['learner.task_ids=["shapes-star"]']) if task == "shapes-star" else (task, [])
    config = load_config(None, TASK_SETUP + ARMS[ARM][1] + task_selection(family)[1] + selection + ["learner.seed=0"])
    scenes = asyncio.run(capture_scenes(config))
    assert [s.task.id for s in scenes] == [task]
    return config, scenes


def _learn(setup, model: Path, inverted: bool, lines: list[str], solved: list[int] | None = None) -> list[float]:
    """Success (the target clicked) per rollout batch. ``solved`` receives the batches after which the learner's
    task selector (its defaults, fed each group's successes by the task's own score, as the learner feeds it)
    holds every task solved: where a real run would stop by itself (learner.stop_when_solved)."""
    config, scenes = setup
    records = run_arm(ARM, scenes, config, model, STEPS, lag=1, inverted_reward=inverted, log=lines.append)
    lc = config.learner
    selector = TaskSelector([s.task for s in scenes], window=lc.task_solved_groups, solved_rate=lc.task_solved_rate)
    for record in records:
        for task_id, successes in record["group_success"]:
            selector.record_group(task_id, successes)
        if selector.solved and solved is not None:
            solved.append(record["step"])
    return [r["success"] for r in records]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("learnability") / "tiny")


@pytest.mark.parametrize("task", ["grid4-green", "shapes-star"])
def test_a_single_task_is_learnt_within_40_steps_and_not_with_the_reward_inverted(desktop_image, model, task):
    lines: list[str] = []
    setup = _setup(task)
    learnt = _learn(setup, model, False, lines)
    start, end = statistics.mean(learnt[:3]), statistics.mean(learnt[-5:])
    print(f"{task}: start {start:.2f} end {end:.2f}")
    assert start <= 0.30, "\n".join(lines)
    assert end >= 0.70, "\n".join(lines)
    solved: list[int] = []
    flipped = _learn(setup, model, True, lines, solved)
    print(f"{task}: inverted reward, end {statistics.mean(flipped[-5:]):.2f}")
    assert solved == [], "\n".join(lines)  # trained against its task, it must never stop as solved
    assert statistics.mean(flipped[-5:]) <= 0.30, "\n".join(lines)
    assert statistics.mean(flipped[-5:]) < end - 0.4, "\n".join(lines)
