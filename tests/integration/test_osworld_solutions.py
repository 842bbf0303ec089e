"""OSWorld's reference solutions on real osworld desktops, through the real `arpo eval --oracle`: a sample of three
tasks of three domains (os: a terminal command; vlc: its config, which the evaluator reads after restarting VLC;
gimp: an infeasible task answered with call_user), copied unchanged from OSWorld's task files into
tests/data/tasks/osworld_solved/. Each scores 1 solved and 0 untouched (a policy that says ``finished`` at once), and
the oracle's episodes are demonstrations ``learner.replay_demos`` reads, step for step the stored solution. The whole
set runs in ``python -m bench.osworld_solutions``.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from actors.eval import evaluate
from actors.osworld.solutions import load_solutions
from arpo_async.config import load_config
from arpo_async.demos import load_demonstrations
from arpo_async.model.inputs import PromptEncoder
from arpo_cli.cli import main as arpo_main
from tests.support import osworld_examples

pytestmark = pytest.mark.docker

TASKS_DIR = Path(__file__).resolve().parents[1] / "data" / "tasks" / "osworld_solved"
MAX_STEPS = 6
"""More than the longest sampled solution (vlc: 4 actions with the closing finished)."""
OSWORLD_MEMORY_MB = 2048
"""As tests/conftest.py's osworld desktops: enough for VLC and GIMP."""
SAMPLE = ("28cc3b7e-b194-4bc9-8353-d04c0f4d56d2", "9195653c-f4aa-453d-aa95-787f6ccfaae9",
          "fbb548ca-c2a6-4601-9204-e39a2efc507b")
"""os, vlc, gimp (bench.osworld_solutions --smoke runs the same three)."""


async def finished_at_once(**_kw):
    """The untouched desktop's policy: ``finished`` on the first step."""
    return "Thought: done\nAction: finished(content='done')"


def _copies() -> dict[str, Path]:
    return {p.stem: p for p in TASKS_DIR.rglob("*.json")}


def test_the_sample_is_osworlds_own_files_of_three_domains_each_with_a_solution():
    copies = _copies()
    assert set(copies) == set(SAMPLE) and len({p.parent.name for p in copies.values()}) == 3
    solutions = load_solutions()
    assert all(solutions[t].domain == copies[t].parent.name for t in SAMPLE)
    examples = osworld_examples()
    if examples is None:
        pytest.skip("$OSWORLD_EXAMPLES names no folder of OSWorld's task files (the copies are checked against it)")
    for task_id, path in copies.items():
        original = examples / path.parent.name / path.name
        assert json.loads(original.read_text()) == json.loads(path.read_text()), f"{path} differs from OSWorld's"
    assert all((examples / s.domain / f"{s.task_id}.json").is_file() for s in solutions.values())


def test_oracle_solves_each_sampled_task_and_the_untouched_desktop_scores_zero(tiny_model, osworld_image, tmp_path):
    sets = ["--set", f"actors.image={osworld_image!r}", "--set", f"actors.desktop_memory_mb={OSWORLD_MEMORY_MB}"]
    out = tmp_path / "solved"
    code = arpo_main(["eval", "--oracle", "--tokenizer", str(tiny_model), "--tasks", str(TASKS_DIR), "--desktops",
                      "1", "--max-steps", str(MAX_STEPS), "--out", str(out), *sets])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["errors"] == []
    assert {name.split("/")[1]: s["score_mean"] for name, s in report["tasks_detail"].items()} == \
        dict.fromkeys(SAMPLE, 1.0)

    config = load_config(None, [f"model={str(tiny_model)!r}", f"actors.image={osworld_image!r}",
                                f"actors.desktop_memory_mb={OSWORLD_MEMORY_MB}"])
    encoder = PromptEncoder(tiny_model)
    untouched = asyncio.run(evaluate(finished_at_once, TASKS_DIR, desktops=1, max_steps=1, config=config,
                                     encoder=encoder, out=tmp_path / "untouched"))
    assert untouched["errors"] == []
    assert {name.split("/")[1]: s["score_mean"] for name, s in untouched["tasks_detail"].items()} == \
        dict.fromkeys(SAMPLE, 0.0)

    ac = config.actors
    demos = load_demonstrations(out, encoder, screen_size=ac.screen_size, history_images=ac.history_images,
                                prompt_style=ac.prompt_style)
    solutions = load_solutions()
    assert {t: [len(d.steps) for d in ds] for t, ds in demos.items()} == {t: [solutions[t].actions] for t in SAMPLE}
    os_demo = demos[SAMPLE[0]][0].steps
    assert "hotkey(key='ctrl alt t')" in os_demo[0].text and "pactl set-sink-volume" in os_demo[1].text
    assert demos[SAMPLE[2]][0].steps[-1].text.endswith("call_user()")
