"""A second button-grid family from a folder of task files (tests/data/tasks/shapes), on a real desktop.

The shapes family is grid4 with everything a recipe could be tuned to changed: other labels (Circle, Square,
Star, Arrow), plain buttons (no colours), another window title and another phrasing of the instruction. A
learning test trains on it (``learner.tasks``) to check the recipe is not fitted to grid4's four colours. Here
the folder is checked to load as the learner loads it, and one task is proven to score by where the click
lands: setup, the app's layout file, a click as the actors send it (xdotool through the controller), the
task's evaluator.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.desktop.controller_client import ControllerClient
from actors.evaluation import evaluate, run_setup
from actors.uitars.actions import Action
from actors.uitars.xdotool import to_commands
from arpo_async.config import load_config
from arpo_async.tasks import Task, load_tasks
from learner.main import select_tasks
from tests.support import until

SHAPES_DIR = Path(__file__).resolve().parent.parent / "data" / "tasks" / "shapes"
LABELS = ["Circle", "Square", "Star", "Arrow"]
LAYOUT = "/tmp/arpo/layout.json"
RESULT = "/tmp/arpo/result.txt"


def expected_label(task: Task) -> str | None:
    """The string ``task``'s single-metric evaluator expects by rule (``expected.rules.expected``: the label a
    button-grid task must click); None when the evaluator has no such rule (a list of metrics, a getter, ...)."""
    expected = task.evaluator.get("expected")
    rules = expected.get("rules") if isinstance(expected, dict) else None
    value = rules.get("expected") if isinstance(rules, dict) else None
    return value if isinstance(value, str) else None


def shapes() -> dict:
    return {t.id: t for t in load_tasks(SHAPES_DIR)}


def test_shapes_folder_loads_as_a_four_button_family_unlike_grid4():
    tasks = shapes()
    assert sorted(tasks) == sorted(f"shapes-{label.lower()}" for label in LABELS)
    assert {t.family for t in tasks.values()} == {"shapes"}
    assert {expected_label(t) for t in tasks.values()} == set(LABELS)
    # one app, one layout: only the target differs between tasks, so chance is 1/4 as in grid4
    launches = {json.dumps([s for s in t.config if s["type"] == "launch"]) for t in tasks.values()}
    assert len(launches) == 1
    argv = json.loads(launches.pop())[0]["parameters"]["command"]
    assert argv[-4:] == LABELS and "--colours" not in argv
    assert argv[argv.index("--title") + 1] == "Shape Picker"
    assert all(t.instruction == f"Press the button labelled {expected_label(t)}." for t in tasks.values())
    # the learner's own pick: learner.tasks names the folder, no task_ids filter
    config = load_config(None, [f"learner.tasks={json.dumps(str(SHAPES_DIR))}"])
    assert sorted(t.id for t in select_tasks(config.learner)) == sorted(tasks)
    # nothing of grid4 is shared but the app: not its labels, title or phrasing
    grid4 = [t for t in load_tasks() if t.family == "grid4"]
    assert not {expected_label(t) for t in grid4} & set(LABELS)
    assert not {t.instruction for t in grid4} & {t.instruction for t in tasks.values()}


def test_expected_label_is_the_string_a_single_metric_expects_by_rule():
    """A button-grid task's target is the label its evaluator expects; expected_label reads it by rule."""
    [star] = [t for t in shapes().values() if t.id == "shapes-star"]
    assert expected_label(star) == "Star"
    rule = {"type": "rule", "rules": {"expected": "Red"}}
    result = {"type": "vm_command_line", "command": ["cat", "/tmp/r"]}

    def task(evaluator: dict) -> Task:
        return Task.from_dict({"id": "demo-1", "instruction": "Click Red.", "config": [], "evaluator": evaluator})

    assert expected_label(task({"func": "exact_match", "result": result, "expected": rule})) == "Red"
    assert expected_label(task({"func": ["exact_match", "exact_match"], "result": [result] * 2,
                                "expected": [rule] * 2})) is None  # a list of metrics names no single label
    assert expected_label(task({"func": "infeasible"})) is None
    number = {"type": "rule", "rules": {"expected": 3}}
    assert expected_label(task({"func": "exact_match", "result": result, "expected": number})) is None


async def read_layout(c: ControllerClient, timeout: float = 10.0) -> dict:
    """The app's layout file (as tests/click_tree.py reads it) once it holds every button."""
    async def layout() -> dict:
        answer = await c.execute(["cat", LAYOUT])
        return json.loads(answer["output"]) if answer.get("returncode") == 0 else {}

    return await until(layout, timeout, "the app's layout of every button", ok=lambda found: set(LABELS) <= set(found))


async def click_as_actor(c: ControllerClient, x: float, y: float) -> None:
    """A UI-TARS click at screen pixel (x, y), run as the actors run it: xdotool argv lists via execute."""
    for command in to_commands(Action(kind="click", point=(x, y))):
        result = await c.execute(command, timeout=20)
        assert result["status"] == "success" and result["returncode"] == 0, (command, result)


async def wait_result(c: ControllerClient, label: str, timeout: float = 10.0) -> None:
    """Until the app has written ``label`` (its click handler runs on the Tk loop's own time)."""
    await until(lambda: c.get_file(RESULT), timeout, f"the app to write {label!r}", ok=lambda v: v == label.encode())


@pytest.mark.docker
@pytest.mark.timeout(120)
async def test_shapes_task_scores_one_on_its_label_and_zero_on_another(fleet):
    task = shapes()["shapes-star"]
    c = (await fleet.start()).controller
    await run_setup(c, task.config)
    layout = await read_layout(c)
    boxes = [layout[label] for label in LABELS]
    assert all(b["w"] > 50 and b["h"] > 50 for b in boxes), layout
    assert len({(b["cx"], b["cy"]) for b in boxes}) == 4, layout  # 2 columns x 2 rows, no overlap
    assert await evaluate(c, task, last_action=None) == 0.0  # untouched

    star = layout["Star"]
    await click_as_actor(c, star["cx"], star["cy"])
    await wait_result(c, "Star")
    assert await evaluate(c, task, last_action="DONE") == 1.0

    circle = layout["Circle"]
    await click_as_actor(c, circle["cx"], circle["cy"])
    await wait_result(c, "Circle")
    assert await evaluate(c, task, last_action="DONE") == 0.0
