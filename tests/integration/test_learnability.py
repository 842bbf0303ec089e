"""Learnability: the product's recipe makes the embedded tiny policy learn, and the test fails when it does not.

In one process, as bench/probe_learning.py does: one real desktop runs each task's setup and gives its screenshot
and the target button's box; the real arpo-serve `Engine` samples with the actors' action grammar (compact prompt,
fixed-width coordinates, forced text emitted as canonical tokens); a reply succeeds when its click lands in the
target's box (what the app and the task's evaluator report); the learner's real `Batcher` and `Trainer` train on
the groups with the forced tokens left out of the loss. The whole run is seeded.

A single task must rise from at most 30% to at least 70% within 40 optimizer steps, for a built-in colour task
and for a task of another family (tests/data/tasks/shapes: other labels, no colours, another window title and
phrasing). The same run with every advantage's sign flipped trains away from success and must not rise, so the
test can fail: it fails when the advantage, the loss, the weights or the reward path stop carrying signal.
"""

from __future__ import annotations

import asyncio
import statistics
from pathlib import Path

import pytest

from arpo_async.config import load_config
from arpo_async.model.init_model import create_tiny_model
from bench.bench_learning import TASK_SETUP, task_selection
from bench.probe_learning import capture_scenes, run_arm

pytestmark = pytest.mark.docker

STEPS = 40
SHAPES = str(Path(__file__).resolve().parent.parent / "data" / "tasks" / "shapes")


def _setup(task: str):
    """The config (bench_learning's task setup, seed 0) and the captured scene of ``task``."""
    family, selection = (SHAPES, ['learner.task_ids=["shapes-star"]']) if task == "shapes-star" else (task, [])
    config = load_config(None, TASK_SETUP + task_selection(family)[1] + selection + ["learner.seed=0"])
    scenes = asyncio.run(capture_scenes(config))
    assert [s.task.id for s in scenes] == [task]
    return config, scenes


def _learn(setup, model: Path, sign: float, lines: list[str]) -> list[float]:
    config, scenes = setup
    records = run_arm("a", scenes, config, model, STEPS, lag=1, advantage_sign=sign, log=lines.append)
    return [r["success"] for r in records]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("learnability") / "tiny")


@pytest.mark.parametrize("task", ["grid4-green", "shapes-star"])
def test_a_single_task_is_learnt_within_40_steps_and_not_with_the_sign_flipped(desktop_image, model, task):
    lines: list[str] = []
    setup = _setup(task)
    learnt = _learn(setup, model, 1.0, lines)
    start, end = statistics.mean(learnt[:3]), statistics.mean(learnt[-5:])
    assert start <= 0.30, "\n".join(lines)
    assert end >= 0.70, "\n".join(lines)
    flipped = _learn(setup, model, -1.0, lines)
    assert statistics.mean(flipped[-5:]) <= 0.30, "\n".join(lines)
    assert statistics.mean(flipped[-5:]) < end - 0.4
