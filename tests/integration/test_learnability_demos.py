"""Demonstrations start a task the untrained policy never solves: with two of the oracle's successes in the replay
(learner.replay_demos) the tiny policy learns menu-copy, and without them it does not move.

menu-copy ("Use the Edit menu to choose Copy.": open the Edit menu, then click its small Copy item) is the
near-zero-chance case: the untrained tiny policy solved none of 4,756 episodes of the menu family, so GRPO never
sees a reward difference and the replay never stores a success. Here, in one process with the learning probe
(tests/learning_probe.py: real desktops capture the task's click tree; the real arpo-serve Engine samples under the
actors' grammar; the training loop's own stages train), the demonstrations come through the product's path: `arpo
eval`'s evaluator with the scripted oracle (actors.oracle) records two episodes on real desktops in the run's action
format, and the learner's own `seed_demonstrations` loads them (arpo_async.demos) into the replay, which injects one
into each all-failed group. The recipe is configs/multistep.toml's (2 clicks per episode), on the one task.

Measured on the CI machine (2 cores), with the demonstrations tokenized as the sampler emits their replies
(learner.algo.forced_tokens.ForcedTokens.as_sampled): with them 0.00 (first 3 batches) -> 0.93 (last 5 of 40; 0.82
before that); without, no success and no optimizer step in 40 batches (640 episodes); 41 s in pytest.
"""

from __future__ import annotations

import asyncio
import statistics
from pathlib import Path

import pytest

from actors.eval import evaluate
from actors.oracle import OraclePolicy
from arpo_async.config import load_config
from arpo_async.model.init_model import create_tiny_model
from arpo_async.model.inputs import PromptEncoder
from tests.learning_probe import capture_scenes, run_arm

pytestmark = pytest.mark.docker

CONFIG = Path(__file__).resolve().parent.parent.parent / "configs" / "multistep.toml"
TASK = "menu-copy"
STEPS = 40


def test_two_demonstrations_start_a_task_the_policy_never_solves(desktop_image, tmp_path):
    base = ["learner.seed=1", f'learner.task_ids=["{TASK}"]', "learner.groups_per_step=2",
            f"actors.image={desktop_image!r}"]
    config = load_config(CONFIG, base)
    scenes = asyncio.run(capture_scenes(config))
    assert scenes[0].solutions() == [("Edit", "Edit/Copy")]  # two clicks, nothing shorter
    model = create_tiny_model(tmp_path / "tiny")
    demos = tmp_path / "demos"
    report = asyncio.run(evaluate(OraclePolicy([scenes[0].task], PromptEncoder(model), config.actors), TASK,
                                  repeats=2, desktops=2, max_steps=2, out=demos,
                                  config=load_config(CONFIG, [*base, f"model={str(model)!r}"]),
                                  encoder=PromptEncoder(model)))
    assert report["overall"]["successes"] == 2
    lines: list[str] = []

    def learn(with_demos: bool) -> list[dict]:
        overrides = [*base, f"learner.replay_demos={str(demos)!r}"] if with_demos else base
        return run_arm("demos" if with_demos else "none", scenes, load_config(CONFIG, overrides), model, STEPS,
                       lag=1, log=lines.append)

    records = learn(True)
    success = [r["success"] for r in records]
    end = statistics.mean(success[-5:])
    print(f"{TASK} with 2 demonstrations: first 3 {statistics.mean(success[:3]):.2f}, last 5 {end:.2f}")
    assert sum(r["injected"] for r in records[:3]) >= 3, "\n".join(lines)  # the demonstrations were replayed
    assert end >= 0.6, "\n".join(lines)
    without = learn(False)
    assert sum(r["success"] for r in without) == 0 and not any(r["trained"] for r in without), "\n".join(lines)
