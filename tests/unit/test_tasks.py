"""Task loader: OSWorld task JSON validation, clear errors for malformed files, the built-in suite."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from actors.evaluation import GETTERS, METRICS, SETUP_STEPS
from arpo_async.tasks import Task, TaskFormatError, load_task_file, load_tasks


def minimal(**over) -> dict:
    d = {"id": "demo-1", "instruction": "Click the Red button.",
         "config": [{"type": "launch", "parameters": {"command": ["xterm"], "shell": False}}],
         "evaluator": {"func": "exact_match",
                       "result": {"type": "vm_command_line", "command": ["cat", "/tmp/r"]},
                       "expected": {"type": "rule", "rules": {"expected": "Red"}}}}
    d.update(over)
    return d


def write(folder: Path, name: str, data) -> Path:
    p = folder / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


def test_builtin_suite_has_the_required_families():
    tasks = load_tasks()
    assert len(tasks) >= 12
    families = Counter(t.family for t in tasks)
    assert families["grid4"] == 4 and families["grid8"] >= 2
    for fam in ("form", "terminal", "checklist", "menu"):
        assert families[fam] >= 1, fam
    # the 4-button family: same app and labels, a different target per task, so chance is 1/4
    grid4 = [t for t in tasks if t.family == "grid4"]
    launches = {json.dumps([s for s in t.config if s["type"] == "launch"]) for t in grid4}
    assert len(launches) == 1
    targets = {t.evaluator["expected"]["rules"]["expected"] for t in grid4}
    assert targets == {"Red", "Green", "Blue", "Yellow"}


def test_builtin_tasks_use_only_supported_steps_getters_and_metrics():
    for t in load_tasks():
        steps = list(t.config) + list(t.evaluator.get("postconfig", []))
        assert {s["type"] for s in steps} <= set(SETUP_STEPS), t.id
        for f in t.funcs:
            assert f in METRICS, (t.id, f)
        for key in ("result", "expected"):
            specs = t.evaluator.get(key)
            for g in (specs if isinstance(specs, list) else [specs]):
                assert g is None or g["type"] in GETTERS, (t.id, g)


def test_round_trip_keeps_the_raw_json_and_unknown_keys():
    d = minimal(snapshot="arpo-desktop", related_apps=["xterm"], extra={"k": [1, 2]})
    t = Task.from_dict(d)
    assert t.to_dict() == d
    assert t.to_dict() is not t.raw
    assert Task.from_dict(t.to_dict()) == t
    assert t.family == "demo" and t.related_apps == ("xterm",)
    assert Task.from_dict(minimal(family="buttons")).family == "buttons"
    assert hash(t) == hash(Task.from_dict(d))


def test_to_dict_is_a_copy():
    t = Task.from_dict(minimal())
    t.to_dict()["evaluator"]["func"] = "changed"
    assert t.evaluator["func"] == "exact_match"


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d.pop("id"), "'id'"),
    (lambda d: d.update(instruction=""), "'instruction'"),
    (lambda d: d.update(config={"type": "launch"}), "'config'"),
    (lambda d: d.update(config=[{"parameters": {}}]), "'config[0]'"),
    (lambda d: d.update(config=[{"type": "launch", "parameters": []}]), "'config[0].parameters'"),
    (lambda d: d.pop("evaluator"), "'evaluator'"),
    (lambda d: d["evaluator"].update(func=3), "'evaluator.func'"),
    (lambda d: d["evaluator"].update(conj="xor"), "'evaluator.conj'"),
    (lambda d: d["evaluator"].pop("result"), "'evaluator.result'"),
    (lambda d: d["evaluator"].update(result={"command": "ls"}), "'evaluator.result'"),
    (lambda d: d["evaluator"].update(func=["exact_match", "exact_match"]), "'evaluator.result'"),
    (lambda d: d["evaluator"].update(options=[{}]), "'evaluator.options'"),
    (lambda d: d["evaluator"].update(postconfig=[{"type": ""}]), "'evaluator.postconfig[0]'"),
    (lambda d: d["evaluator"].update(func=["infeasible", "exact_match"]), "'evaluator.func'"),
    (lambda d: d.update(family=""), "'family'"),
])
def test_malformed_task_names_file_and_field(tmp_path, mutate, field):
    d = minimal()
    mutate(d)
    p = write(tmp_path, "bad.json", d)
    with pytest.raises(TaskFormatError) as err:
        load_task_file(p)
    assert str(p) in str(err.value) and field in str(err.value)


def test_list_evaluator_and_infeasible_are_valid():
    multi = minimal()
    multi["evaluator"] = {"func": ["exact_match", "check_include_exclude"], "conj": "or",
                          "result": [{"type": "vm_command_line", "command": "ls"}] * 2,
                          "expected": [{"type": "rule", "rules": {"expected": "x"}}, None],
                          "options": [{}, None]}
    assert Task.from_dict(multi).funcs == ["exact_match", "check_include_exclude"]
    inf = Task.from_dict(minimal(evaluator={"func": "infeasible"}))
    assert inf.infeasible and inf.funcs == ["infeasible"]
    assert Task.from_dict(minimal()).expected_string == "Red"
    assert Task.from_dict(multi).expected_string is None and inf.expected_string is None
    number = minimal()
    number["evaluator"]["expected"]["rules"]["expected"] = 3
    assert Task.from_dict(number).expected_string is None  # only a string is a label


def test_invalid_json_and_missing_paths(tmp_path):
    p = write(tmp_path, "broken.json", "{not json")
    with pytest.raises(TaskFormatError, match="broken.json: invalid JSON"):
        load_tasks(p)
    with pytest.raises(TaskFormatError, match="no such task file"):
        load_tasks(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TaskFormatError, match="no \\*.json"):
        load_tasks(empty)
    with pytest.raises(TaskFormatError, match="must be a JSON object"):
        load_tasks(write(tmp_path, "list.json", [minimal()]))


def test_folder_is_loaded_recursively_and_duplicates_are_errors(tmp_path):
    write(tmp_path, "a.json", minimal(id="a-1"))
    write(tmp_path, "sub/deeper/b.json", minimal(id="b-1"))
    write(tmp_path, "notes.txt", "ignored")
    assert [t.id for t in load_tasks(tmp_path)] == ["a-1", "b-1"]
    assert [t.id for t in load_tasks(tmp_path / "a.json")] == ["a-1"]
    write(tmp_path, "sub/c.json", minimal(id="a-1"))
    with pytest.raises(TaskFormatError) as err:
        load_tasks(tmp_path)
    assert "duplicate task id 'a-1'" in str(err.value)
    assert "a.json" in str(err.value) and "c.json" in str(err.value)


def test_a_bad_file_in_a_folder_is_named(tmp_path):
    write(tmp_path, "good.json", minimal(id="g-1"))
    bad = write(tmp_path, "zz/bad.json", minimal(id=5))
    with pytest.raises(TaskFormatError, match=str(bad)):
        load_tasks(tmp_path)
