"""The 3-step family learns and holds: configs/multistep3.toml's recipe, in one process on its real click tree.

As tests/integration/test_learnability_multistep.py, with the learning probe (tests/learning_probe.py): real
desktops capture the click trees of the settings-apply family ("Open the Sound section, turn on Beep, then click
Apply." and Display / Large text: 3 clicks in order, nothing shorter scores); episodes of 3 steps are played on
them with the actors' step loop; the real arpo-serve ``Engine`` samples one version behind the trained weights;
the training loop's own stages train, with the config's recipe, its adaptive learning rate (learner.target_kl)
and its bound on each batch's update (learner.max_kl) included. Seeded (learner.seed=0).

The family's success, as a trailing mean of 10 rollout batches, must reach 0.6 within 150 batches and, once past
0.5, never fall below 0.4. Measured here (probe, seed 0, the config's recipe): past 0.6 after 99 batches, 0.82
over the last 10, 4 min 52 s on a quiet 2-core machine (the line search scores some batches more than once, so
the test has a budget of 20 minutes of its own: the suite's 10 would not hold beside other work); with target_kl
alone 0.6 after 71 batches and 0.91 at the end; with the learning rate fixed (learner.target_kl = 0) the same seed
passed 0.6 after 87 batches, peaked at 0.84 and ended at 0.54 (docs/benchmarks.md has the 3 seeds).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from arpo_async.config import load_config
from arpo_async.model.init_model import create_tiny_model
from tests.learning_probe import capture_scenes, run_arm

pytestmark = pytest.mark.docker

CONFIG = Path(__file__).resolve().parent.parent.parent / "configs" / "multistep3.toml"
BATCHES = 150


def trailing(values: list[float], window: int = 10) -> list[float]:
    """Trailing means over ``window`` values, from the ``window``-th value on."""
    return [sum(values[i - window + 1: i + 1]) / window for i in range(window - 1, len(values))]


@pytest.mark.timeout(1200)
def test_the_three_step_family_reaches_0_6_and_holds_above_0_4(desktop_image, tmp_path):
    config = load_config(CONFIG, ["learner.seed=0"])
    assert config.actors.max_steps == 3 and config.learner.target_kl > 0
    scenes = asyncio.run(capture_scenes(config))
    assert sorted(s.task.id for s in scenes) == ["settings-apply-display-large-text", "settings-apply-sound-beep"]
    lines: list[str] = []
    records = run_arm("multistep3", scenes, config, create_tiny_model(tmp_path / "tiny"), BATCHES, lag=1,
                      log=lines.append)
    family = trailing([r["success"] for r in records])
    passed = next((i for i, v in enumerate(family) if v >= 0.5), None)
    print(f"settings-apply: first 0.6 at batch {next((i + 9 for i, v in enumerate(family) if v >= 0.6), None)}, "
          f"last 10 {family[-1]:.2f}")
    assert max(family) >= 0.6, "\n".join(lines)
    assert passed is not None and min(family[passed:]) >= 0.4, "\n".join(lines)
