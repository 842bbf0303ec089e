"""The built-in train/test splits: each family's test tasks are held out (labels, phrasings or layouts the train
tasks never show), the splits load whole, and no shipped config trains on a test task."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from arpo_async.config import load_config
from arpo_async.task_sets import SPLITS_DIR, builtin_split_names, load_task_set
from arpo_async.tasks import Task, load_tasks

ROOT = Path(__file__).resolve().parents[2]
TASKS = {t.id: t for t in load_tasks()}
FAMILIES = Counter(t.family for t in TASKS.values())
SPLITS = builtin_split_names()


def split_tasks(name: str) -> list[Task]:
    """The tasks of built-in split ``name``, each one loaded (an errored entry fails the calling test)."""
    entries = load_task_set(None, name)
    assert not [e for e in entries if e.task is None], [(e.task_id, e.error) for e in entries if e.task is None]
    return [e.task for e in entries if e.task is not None]


def launch(task: Task) -> str:
    """The task's launch steps, as canonical JSON (the app, its labels, their order and its layout options)."""
    return json.dumps([s for s in task.config if s["type"] == "launch"], sort_keys=True)


def app(task: Task) -> tuple[str, ...]:
    """The program the task launches (its first launch step's first two words: ``python3 <app>``, ``xterm -title``)."""
    return tuple(json.loads(launch(task))[0]["parameters"]["command"][:2])


def test_every_family_with_more_than_one_task_has_a_train_and_a_test_split():
    split_families = {name.rsplit("-", 1)[0] for name in SPLITS}
    for family, count in FAMILIES.items():
        if count > 1:
            assert {f"{family}-train", f"{family}-test"} <= set(SPLITS), family
    assert split_families <= set(FAMILIES)  # no split of a family that does not exist
    assert all(name.rsplit("-", 1)[1] in ("train", "test") for name in SPLITS)


@pytest.mark.parametrize("name", SPLITS)
def test_every_built_in_split_loads_whole_within_its_family(name):
    family = name.rsplit("-", 1)[0]
    data = json.loads((SPLITS_DIR / f"{name}.json").read_text(encoding="utf-8"))
    assert list(data) == [family]  # OSWorld's test_all.json form; a built-in task's domain is its family
    tasks = split_tasks(name)
    assert [t.id for t in tasks] == data[family] and tasks
    assert {t.family for t in tasks} == {family}


@pytest.mark.parametrize("family", sorted(f for f, n in FAMILIES.items() if n > 1))
def test_test_tasks_are_held_out_from_the_train_tasks(family):
    train, test = split_tasks(f"{family}-train"), split_tasks(f"{family}-test")
    assert not {t.id for t in train} & {t.id for t in test}
    # every task of the family is in exactly one of the two
    assert sorted(t.id for t in train + test) == sorted(i for i, t in TASKS.items() if t.family == family)
    train_instructions = {t.instruction for t in train}
    for t in test:
        assert t.instruction not in train_instructions, t.id  # a phrasing (or label) training never shows
        for seen in train:
            assert (t.instruction, launch(t)) != (seen.instruction, launch(seen)), (t.id, seen.id)


def test_the_test_tasks_use_the_apps_and_evaluators_of_their_family():
    """A held-out task is solvable by the same means: its app and metrics are those of a train task."""
    for family in (f for f, n in FAMILIES.items() if n > 1):
        train = split_tasks(f"{family}-train")
        apps = {app(t) for t in train}
        metrics = {tuple(sorted(set(t.funcs))) for t in train}
        for t in split_tasks(f"{family}-test"):
            assert app(t) in apps, t.id
            assert tuple(sorted(set(t.funcs))) in metrics, t.id


PICKING = [p for p in sorted([*(ROOT / "configs").glob("*.toml"), *(ROOT / "examples").glob("*.toml")])
           if load_config(p, []).learner.task_ids]
"""The shipped configs that name their tasks (``learner.task_ids``); the others train on the whole suite."""


@pytest.mark.parametrize("path", PICKING, ids=[p.name for p in PICKING])
def test_no_shipped_config_that_picks_tasks_picks_a_test_task(path):
    """A config naming its tasks (``learner.task_ids``, id prefixes such as ``grid4-`` or ``settings-apply-``)
    trains on no held-out task: test tasks' ids start with ``heldout-``, so no train prefix reaches them."""
    from learner.main import select_tasks

    learner = load_config(path, []).learner
    test_ids = {t.id for name in SPLITS if name.endswith("-test") for t in split_tasks(name)}
    assert not {t.id for t in select_tasks(learner)} & test_ids
