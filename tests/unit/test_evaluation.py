"""Evaluator semantics (OSWorld's DesktopEnv.evaluate) with the desktop-free ``rule`` getter, and metrics.

The ControllerClient here points at a socket that does not exist: these evaluators only use the ``rule``
getter and have no postconfig, so a call reaching the desktop would raise DesktopError and fail the test.
"""
from __future__ import annotations

import pytest

from actors.desktop.controller_client import ControllerClient, DesktopError
from actors.evaluation import EvaluationError, TaskSetupError, evaluate, run_setup
from actors.osworld.native_metrics import (
    check_include_exclude,
    check_list,
    compare_text_file,
    exact_match,
    file_contains,
    fuzzy_match,
    literal_match,
)
from arpo_async.tasks import Task


@pytest.fixture
async def nowhere():
    c = ControllerClient("/nonexistent/arpo/controller.sock", timeout=2)
    yield c
    await c.close()


def rule(value) -> dict:
    return {"type": "rule", "rules": value}


def task(func, result, expected=None, conj=None, options=None) -> Task:
    ev: dict = {"func": func, "result": result}
    if expected is not None:
        ev["expected"] = expected
    if conj is not None:
        ev["conj"] = conj
    if options is not None:
        ev["options"] = options
    return Task.from_dict({"id": "t-1", "instruction": "x", "config": [], "evaluator": ev})


async def test_single_metric_and_fail_action(nowhere):
    t = task("exact_match", rule("Red"), rule({"expected": "Red"}))
    assert await evaluate(nowhere, t, None) == 1.0
    assert await evaluate(nowhere, t, "DONE") == 1.0
    assert await evaluate(nowhere, t, "FAIL") == 0.0
    wrong = task("exact_match", rule("Blue"), rule({"expected": "Red"}))
    assert await evaluate(nowhere, wrong, "DONE") == 0.0


async def test_infeasible_scores_by_last_action(nowhere):
    t = Task.from_dict({"id": "i-1", "instruction": "x", "config": [], "evaluator": {"func": "infeasible"}})
    assert await evaluate(nowhere, t, "FAIL") == 1.0
    assert await evaluate(nowhere, t, " fail ") == 1.0
    assert await evaluate(nowhere, t, "DONE") == 0.0
    assert await evaluate(nowhere, t, None) == 0.0


@pytest.mark.parametrize("conj, results, want", [
    ("and", ["a", "a", "a"], 1.0),
    ("and", ["a", "b", "a"], 0.0),  # a zero ends it at once
    ("or", ["b", "a", "b"], 1.0),   # a one ends it at once
    ("or", ["b", "b", "b"], 0.0),
])
async def test_list_funcs_combine_with_conj(nowhere, conj, results, want):
    t = task(["exact_match"] * 3, [rule(r) for r in results], [rule({"expected": "a"})] * 3, conj=conj)
    assert await evaluate(nowhere, t, None) == want


async def test_partial_scores_average_under_and_and_max_under_or(nowhere):
    res = [rule("abcd"), rule("abcd")]
    exp = [rule({"expected": "abcd"}), rule({"expected": "abxy"})]
    assert await evaluate(nowhere, task(["fuzzy_match"] * 2, res, exp, conj="and"), None) == pytest.approx(0.75)
    assert await evaluate(nowhere, task(["fuzzy_match"] * 2, [rule("abcz"), rule("abzz")], exp, conj="or"),
                          None) == pytest.approx(0.75)


async def test_metric_without_expected_gets_options(nowhere):
    t = task("literal_match", rule("HELLO"), rule("hello"), options={"ignore_case": True})
    assert await evaluate(nowhere, t, None) == 1.0


async def test_unknown_names_are_clear_errors(nowhere):
    with pytest.raises(EvaluationError, match="unknown metric 'compare_holograms'"):
        await evaluate(nowhere, task("compare_holograms", rule("x")), None)
    with pytest.raises(EvaluationError, match="unknown getter 'hologram_file'"):
        await evaluate(nowhere, task("exact_match", {"type": "hologram_file"}, rule({"expected": 1})), None)
    with pytest.raises(TaskSetupError, match="unknown type 'teleport'"):
        await run_setup(nowhere, [{"type": "teleport", "parameters": {}}])


async def test_an_unreachable_desktop_is_a_desktop_error(nowhere):
    with pytest.raises(DesktopError, match="nonexistent"):
        await run_setup(nowhere, [{"type": "execute", "parameters": {"command": ["true"]}}])


def test_metrics_follow_osworld(tmp_path):
    assert exact_match("x", {"expected": "x"}) == 1.0
    assert check_include_exclude("Milk\nEggs\n", {"include": ["Milk", "Eggs"], "exclude": ["Bread"]}) == 1.0
    assert check_include_exclude("Milk\nBread\n", {"include": ["Milk"], "exclude": ["Bread"]}) == 0.0
    assert check_include_exclude(None, {"include": []}) == 0.0
    assert literal_match(["A", "b"], ["a", "B"], type="list", ignore_case=True) == 1.0
    assert fuzzy_match("abc", {"expected": "abc"}) == 1.0 and fuzzy_match(None, {"expected": "a"}) == 0.0
    f = tmp_path / "f.txt"
    f.write_text("hello arpo\nsecond line\n")
    g = tmp_path / "g.txt"
    g.write_text("hello   arpo second line")
    assert file_contains(str(f), {"expected": ["hello arpo"]}) == 1.0
    assert file_contains(str(f), {"expected": "goodbye"}) == 0.0
    assert file_contains(None, {"expected": "x"}) == 0.0
    assert check_list(str(f), {"expect": ["^hello"], "unexpect": ["^third"]}) == 1.0
    assert check_list(str(f), {"expect": ["^third"]}) == 0.0
    assert compare_text_file(str(f), str(g)) == 0.0
    assert compare_text_file(str(f), str(g), ignore_blanks=True) == 1.0
