"""Task sets as researchers name them (osworld-369, osworld-361, arpo-128), the 15/50/100 step budgets, and a task
listed twice in a split running once (arpo_async.benchmark_sets, arpo_async.task_sets)."""
from __future__ import annotations

import json
import re

import pytest

from arpo_async.benchmark_sets import NAMED_SPLITS, STEP_BUDGETS, step_budget
from arpo_async.task_sets import duplicate_listings, duplicates_line, load_split, load_task_set
from arpo_async.tasks import BUILTIN_DIR, TaskFormatError
from tests.support import osworld_examples

OSWORLD_EXAMPLES = osworld_examples()
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
GOOGLE_DRIVE = {  # OSWorld's multi_apps tasks with a `googledrive` config step (evaluation_examples/examples)
    "0c825995-5b70-4526-b663-113f4c999dd2", "22a4636f-8179-4357-8e87-d1743ece1f81",
    "46407397-a7d5-4c6b-92c6-dbe038b1457b", "4e9f0faf-2ecc-4ae8-a804-28c9a75d1ddc",
    "78aed49a-a710-4321-a793-b611a7c5b56b", "897e3b53-5d4d-444b-85cb-2cdc8a97d903",
    "a0b9dc9c-fc07-4a88-8c5d-5e3ecad91bcb", "b52b40a5-ad70-4c53-b5b0-5650a8387052"}
OSWORLD_DOMAINS = ["chrome", "gimp", "libreoffice_calc", "libreoffice_impress", "libreoffice_writer", "multi_apps",
                   "os", "thunderbird", "vlc", "vs_code"]


def ids(name: str) -> list[tuple[str, str]]:
    """(domain, task id) of every listing of split ``name``, in its order."""
    return [(domain, task_id) for domain, listed in load_split(name).items() for task_id in listed]


@pytest.mark.parametrize("name", list(NAMED_SPLITS))
def test_a_named_split_lists_its_count_of_osworld_tasks_each_once(name):
    split = NAMED_SPLITS[name]
    listings = ids(name)
    assert len(listings) == split.tasks == int(name.rsplit("-", 1)[1])
    assert len({task_id for _, task_id in listings}) == split.tasks  # no id twice, not even under two domains
    assert all(UUID.match(task_id) for _, task_id in listings)
    assert list(load_split(name)) == OSWORLD_DOMAINS  # OSWorld's test_all.json form and domains
    assert split.licence == "Apache-2.0" and split.source.startswith("https://github.com/")


def test_osworld_361_is_369_less_the_google_drive_tasks_and_arpo_128_is_within_both():
    all_tasks, no_drive, arpo = ids("osworld-369"), ids("osworld-361"), ids("arpo-128")
    assert [t for t in all_tasks if t[1] not in GOOGLE_DRIVE] == no_drive  # same order, same domains
    assert {t for t in all_tasks if t[1] in GOOGLE_DRIVE} == {("multi_apps", i) for i in GOOGLE_DRIVE}
    assert set(arpo) <= set(no_drive)
    assert {d: len(v) for d, v in load_split("arpo-128").items()} == {  # ARPO's file, per domain
        "chrome": 18, "gimp": 19, "libreoffice_calc": 12, "libreoffice_impress": 13, "libreoffice_writer": 11,
        "multi_apps": 11, "os": 12, "thunderbird": 7, "vlc": 6, "vs_code": 19}


@pytest.mark.skipif(OSWORLD_EXAMPLES is None, reason="$OSWORLD_EXAMPLES names no folder of OSWorld's task files")
@pytest.mark.parametrize("name", list(NAMED_SPLITS))
def test_a_named_split_cuts_osworlds_own_task_folder_whole(name):
    entries = load_task_set(OSWORLD_EXAMPLES, name)
    assert len(entries) == NAMED_SPLITS[name].tasks
    assert not [e for e in entries if e.error.startswith("not in")]  # every id is a file under its domain
    assert not [e for e in entries if e.also_listed_as]
    drive = {p.stem for p in OSWORLD_EXAMPLES.rglob("*.json") if '"googledrive"' in p.read_text(encoding="utf-8")}
    assert drive == GOOGLE_DRIVE
    for file, named in (("test_all.json", "osworld-369"), ("test_nogdrive.json", "osworld-361")):
        if (OSWORLD_EXAMPLES.parent / file).is_file():  # a clone of OSWorld: its own lists
            assert json.loads((OSWORLD_EXAMPLES.parent / file).read_text()) == load_split(named)


def test_a_named_split_of_osworlds_tasks_without_their_folder_is_refused_with_what_to_give():
    with pytest.raises(TaskFormatError, match="osworld-361 lists OSWorld's tasks.*--tasks"):
        load_task_set(None, "osworld-361")  # not 361 "not in the built-in suite" errors
    with pytest.raises(TaskFormatError, match="arpo-128: a split of OSWorld's task files, not a task folder"):
        load_task_set("arpo-128")
    with pytest.raises(TaskFormatError, match="osworld-360: no such split.*osworld-369, osworld-361, arpo-128"):
        load_task_set(None, "osworld-360")


def test_a_built_in_task_listed_twice_and_under_two_domains_runs_once_under_its_first(tmp_path):
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"grid4": ["grid4-green", "grid4-red", "grid4-green"], "menu": ["grid4-green"]}))
    entries = load_task_set(None, split)
    assert [(e.domain, e.task_id) for e in entries] == [("grid4", "grid4-green"), ("grid4", "grid4-red")]
    assert entries[0].also_listed_as == ("grid4", "menu") and entries[1].also_listed_as == ()
    assert entries[0].task is not None and entries[0].task.id == "grid4-green"
    listings = duplicate_listings(entries)
    assert listings == [{"task_id": "grid4-green", "domain": "grid4", "also_listed_as": ["grid4", "menu"]}]
    assert duplicates_line(listings) == ("1 task(s) listed more than once run once each, as the first listing: "
                                         "grid4/grid4-green (also listed under grid4, menu)")


def test_a_task_listed_first_under_a_domain_that_lacks_it_runs_from_the_domain_that_has_it(tmp_path):
    tasks = tmp_path / "tasks"
    (tasks / "apps").mkdir(parents=True)
    (tasks / "other").mkdir()
    green = json.loads((BUILTIN_DIR / "grid4-green.json").read_text())
    (tasks / "apps" / "t1.json").write_text(json.dumps({**green, "id": "t1"}))
    (tasks / "other" / "t1.json").write_text(json.dumps({**green, "id": "t1"}))  # the same id in two folders
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"absent": ["t1", "gone", "gone"], "apps": ["t1"]}))
    entries = load_task_set(tasks, split)
    assert [(e.domain, e.task_id, e.task is not None, e.also_listed_as) for e in entries] == [
        ("apps", "t1", True, ("absent",)), ("absent", "gone", False, ("absent",))]  # nothing lost, nothing twice
    assert "not in" in entries[1].error
    whole = load_task_set(tasks)  # no split: the folder's two files of one id are one task, the first domain's
    assert [(e.domain, e.task_id, e.also_listed_as) for e in whole] == [("apps", "t1", ("other",))]


@pytest.mark.parametrize("steps", [15, 50, 100])
def test_the_leaderboards_step_budgets_are_presets_a_report_names(steps):
    assert step_budget(steps) == {"max_steps": steps, "preset": f"OSWorld {steps}-step"}
    assert STEP_BUDGETS[steps] == f"OSWorld {steps}-step"


def test_another_step_budget_is_recorded_without_a_preset():
    assert step_budget(30) == {"max_steps": 30, "preset": None}
    assert set(STEP_BUDGETS) == {15, 50, 100}


def test_arpo_tasks_splits_lists_every_split_by_name_with_its_count(capsys):
    from arpo_cli.cli import main

    assert main(["tasks", "splits"]) == 0
    rows = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()}
    assert {name: rows[name] for name in NAMED_SPLITS} == {"osworld-369": "369", "osworld-361": "361",
                                                           "arpo-128": "128"}
    assert rows["grid4-test"] == "4"
