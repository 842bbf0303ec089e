"""Task sets: the training pool (:func:`select_tasks`, which the learner and `arpo run`'s check before it starts
any process share), and for evaluation a folder of OSWorld task files (or the built-in suite) cut by a split file.

A split is OSWorld's ``test_all.json`` form, ``{domain: [task id, ...]}`` (evaluation_examples/test_all.json in
https://github.com/xlang-ai/OSWorld). A task's domain is the folder its file sits in under the task folder
(OSWorld's ``examples/<domain>/<id>.json``); for a task directly in the folder (the built-in suite) it is the
task's family (:attr:`arpo_async.tasks.Task.family`).

Nothing is dropped: a task file that does not load (malformed, or a setup step, getter or metric we cannot run)
and a split entry whose task is not in the folder each become a :class:`TaskEntry` with ``task=None`` and the
reason in ``error``, so an evaluation counts it as a failure in its denominator (dropping such tasks is a known
way benchmark scores get inflated).

The built-in splits live in ``arpo_async/splits/<family>-train.json`` and ``<family>-test.json``; a split may be
named by that stem (``grid4-test``) instead of a path, or by the name of a task set researchers use, cut from a
folder of OSWorld's task files (``osworld-369``, ``osworld-361``, ``arpo-128``: :mod:`arpo_async.benchmark_sets`).

A task is its id: a task listed twice (the same id twice in a domain's list, or under two domains) is one entry,
run once; the first listing that can run is kept (else the first), at the place of the first listing, and the
entry's ``also_listed_as`` names the domains of the other listings (``arpo eval`` says so on stderr and in
report.json's ``deduplicated``). OSWorld's ids are unique across its domains (UUIDs), so its splits lose nothing.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, replace
from pathlib import Path

from arpo_async.benchmark_sets import NAMED_SPLITS
from arpo_async.config import LearnerConfig
from arpo_async.tasks import BUILTIN_DIR, Task, TaskFormatError, load_task_file, load_tasks, read_task_json

SPLITS_DIR = Path(__file__).resolve().parent / "splits"
"""The built-in families' train and test splits (``<family>-train.json``, ``<family>-test.json``)."""


@dataclass(frozen=True)
class TaskEntry:
    """One task of a task set.

    Attributes:
        domain: its domain (folder under the task folder, else its family).
        task_id: the task file's stem, which is how OSWorld's runner and splits name an example (in OSWorld's own
            data a few files' ``id`` fields differ from their names; the built-in files' never do).
        task: the loaded task, or None when it cannot run (then ``error`` says why).
        error: why the task cannot run ("" when it can).
        also_listed_as: the domains of the split's other listings of this task id, in split order (empty when it
            is listed once): it runs once, as ``domain/task_id``.
    """

    domain: str
    task_id: str
    task: Task | None
    error: str = ""
    also_listed_as: tuple[str, ...] = ()


def builtin_split_names() -> list[str]:
    """The names of the built-in splits (``grid4-train``, ``grid4-test``, ...), sorted."""
    return sorted(p.stem for p in SPLITS_DIR.glob("*.json")) if SPLITS_DIR.is_dir() else []


def resolve_split_path(split: str | Path) -> Path:
    """The file of ``split``: a path to a split file, the name of a built-in split, or the name of a named task set
    (:data:`arpo_async.benchmark_sets.NAMED_SPLITS`).

    Raises:
        TaskFormatError: none of these (the message lists the names).
    """
    path = Path(split)
    if path.is_file():
        return path
    builtin = SPLITS_DIR / f"{split}.json"
    if builtin.is_file():
        return builtin
    if str(split) in NAMED_SPLITS:
        return NAMED_SPLITS[str(split)].path
    raise TaskFormatError(f"{split}: no such split file, nor a built-in split (built-in: "
                          f"{', '.join(builtin_split_names()) or 'none'}; of OSWorld's task files: "
                          f"{', '.join(NAMED_SPLITS)})")


def load_split(split: str | Path) -> dict[str, list[str]]:
    """Read a split file (or built-in or named split): ``{domain: [task id, ...]}``, as written (an id listed twice
    stays twice: :func:`load_task_set` keeps one and says so).

    Raises:
        TaskFormatError: naming the file: not found, not strict JSON, or not an object of string lists.
    """
    path = resolve_split_path(split)
    data = read_task_json(path)
    if not isinstance(data, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and all(isinstance(i, str) for i in v) for k, v in data.items()):
        raise TaskFormatError(f"{path}: a split is a JSON object {{domain: [task id, ...]}} (OSWorld's "
                              "test_all.json form)")
    return {k: list(v) for k, v in data.items()}


def resolve_tasks_path(tasks: str | Path | None) -> tuple[Path, list[str], str]:
    """The folder (or file) of ``tasks``, the id prefixes to keep, and the family to keep.

    ``tasks`` is a task folder or file; None or ``"builtin"`` = the built-in suite; any other name = the built-in
    family of that name (``grid4``: its train and held-out tasks), else the built-in tasks whose id is that name or
    starts with it (``settings-sound-mute``, ``grid4-``).

    Raises:
        TaskFormatError: a name no built-in task matches.
    """
    if tasks is None or str(tasks) == "builtin":
        return BUILTIN_DIR, [], ""
    path = Path(tasks)
    if path.exists():
        return path, [], ""
    if str(tasks) in NAMED_SPLITS:
        raise TaskFormatError(f"{tasks}: a split of OSWorld's task files, not a task folder: give the folder of "
                              f"OSWorld's evaluation_examples/examples as the tasks and {tasks} as the split")
    name, builtin = str(tasks), load_tasks(BUILTIN_DIR)
    if any(t.family == name for t in builtin):
        return BUILTIN_DIR, [], name
    if not any(t.id == name or t.id.startswith(name) for t in builtin):
        raise TaskFormatError(f"{tasks}: no such task folder or file, nor a built-in family, task or id prefix "
                              f"(built-in families: {', '.join(sorted({t.family for t in builtin}))})")
    return BUILTIN_DIR, [name], ""


def _domain(file: Path, root: Path, task: Task | None) -> str:
    parent = file.parent.relative_to(root) if root.is_dir() else Path(".")
    if str(parent) != ".":
        return parent.as_posix()
    return task.family if task is not None else file.stem.rsplit("-", 1)[0]


def load_task_set(tasks: str | Path | None = None, split: str | Path | None = None) -> list[TaskEntry]:
    """The tasks of ``tasks`` (see :func:`resolve_tasks_path`), cut by ``split`` when given, in split order (else
    sorted by domain and id).

    Every file under the folder is loaded on its own: one that fails becomes an entry with its error. With a
    split, an id the folder lacks becomes an entry with ``error = "not in <folder>"``. A task whose ``id`` field
    repeats another's is named by its file (:func:`unique_ids`).

    Raises:
        TaskFormatError: the folder does not exist or holds no task file, the split cannot be read, or nothing
            is left.
    """
    root, prefixes, family = resolve_tasks_path(tasks)
    files = sorted(p for p in root.rglob("*.json") if p.is_file()) if root.is_dir() else [root]
    if not files:
        raise TaskFormatError(f"{root}: no *.json task files in this folder")
    entries: dict[tuple[str, str], TaskEntry] = {}
    for file in files:
        try:
            task: Task | None = load_task_file(file)
            error = ""
        except TaskFormatError as exc:
            task, error = None, str(exc)
        task_id = file.stem  # OSWorld's runner and splits name an example by its file (<domain>/<id>.json)
        if prefixes and not any(task_id == p or task_id.startswith(p) for p in prefixes):
            continue
        if family and (task is None or task.family != family):
            continue
        domain = _domain(file, root, task)
        entries[(domain, task_id)] = TaskEntry(domain, task_id, task, error)
    entries = unique_ids(entries)
    if split is not None and root == BUILTIN_DIR and str(split) in NAMED_SPLITS:
        raise TaskFormatError(f"split {split} lists OSWorld's tasks, not built-in ones: give the folder of OSWorld's "
                              "evaluation_examples/examples as the tasks (--tasks, eval.tasks)")
    if split is not None:
        chosen = []
        by_id = {tid: entry for (_, tid), entry in entries.items()}
        for domain, ids in load_split(split).items():
            for task_id in ids:
                entry = entries.get((domain, task_id))
                if entry is None and task_id in by_id and root == BUILTIN_DIR:
                    entry = TaskEntry(domain, task_id, by_id[task_id].task, by_id[task_id].error)
                chosen.append(entry or TaskEntry(domain, task_id, None, f"not in {root} (domain {domain})"))
        result = dedupe(chosen)
    else:
        result = dedupe(sorted(entries.values(), key=lambda e: (e.domain, e.task_id)))
    if not result:
        raise TaskFormatError(f"no task left in {tasks or 'the built-in suite'}"
                              + (f" after split {split}" if split is not None else ""))
    return result


def dedupe(entries: list[TaskEntry]) -> list[TaskEntry]:
    """``entries`` with each task id once (module docstring): at the place of its first listing, the first listing
    that can run (else the first), with ``also_listed_as`` the domains of the others in order."""
    listings: dict[str, list[TaskEntry]] = {}
    for entry in entries:
        listings.setdefault(entry.task_id, []).append(entry)
    result = []
    for same in listings.values():
        at = next((i for i, e in enumerate(same) if e.task is not None), 0)
        others = tuple(e.domain for i, e in enumerate(same) if i != at)
        result.append(replace(same[at], also_listed_as=others) if others else same[at])
    return result


def duplicate_listings(entries: list[TaskEntry]) -> list[dict]:
    """The entries of ``entries`` listed more than once (:func:`dedupe`), as report.json's ``deduplicated`` records
    them: ``[{"task_id", "domain" (where it runs), "also_listed_as": [domain, ...]}]``."""
    return [{"task_id": e.task_id, "domain": e.domain, "also_listed_as": list(e.also_listed_as)}
            for e in entries if e.also_listed_as]


def duplicates_line(listings: list[dict]) -> str:
    """One line saying which tasks (:func:`duplicate_listings`) were listed more than once and run once."""
    named = "; ".join(f"{d['domain']}/{d['task_id']} (also listed under {', '.join(d['also_listed_as'])})"
                      for d in listings)
    return f"{len(listings)} task(s) listed more than once run once each, as the first listing: {named}"


def runnable_tasks(entries: list[TaskEntry]) -> list[Task]:
    """The loaded tasks of ``entries``.

    Raises:
        TaskFormatError: an entry cannot run (a training run's evaluation set must run whole; the message names
            each such task and why).
    """
    bad = [f"{e.domain}/{e.task_id}: {e.error}" for e in entries if e.task is None]
    if bad:
        raise TaskFormatError("tasks that cannot run: " + "; ".join(bad))
    return [e.task for e in entries if e.task is not None]


def select_tasks(config: LearnerConfig) -> list[Task]:
    """The training task pool of ``config`` (the ``[learner]`` section): ``learner.tasks`` (a task folder or
    file; empty = the built-in suite), loaded by :func:`arpo_async.tasks.load_tasks`, or with ``learner.split``
    the tasks that split lists (:func:`load_task_set`, in split order, each once, ids unique), then cut to the
    tasks whose id is one of ``learner.task_ids`` or starts with one.

    Raises:
        TaskFormatError: a task file that does not load (naming the file and field), a missing path, an empty
            folder, a duplicate id, a split that cannot be read or lists a task that cannot run, or a ``task_ids``
            filter that leaves no task.
    """
    if config.split:
        tasks = runnable_tasks(load_task_set(config.tasks or None, config.split))
    else:
        tasks = load_tasks(config.tasks or None)
    if config.task_ids:
        tasks = [t for t in tasks if any(t.id == p or t.id.startswith(p) for p in config.task_ids)]
    if not tasks:
        raise TaskFormatError(f"no task matches learner.task_ids={list(config.task_ids)}")
    return tasks


def unique_ids(entries: dict[tuple[str, str], TaskEntry]) -> dict[tuple[str, str], TaskEntry]:
    """``entries`` (every file of a task folder) with unique task ids: a task whose ``id`` field is another task's
    too and is not its own file's name takes its file's name, its entry's ``task_id`` (``raw["id"]`` too, the id the
    actors rebuild it with and its files are found under in a mirror, <domain>/<task id>/<name>). Decided over the
    whole folder, so a task has the same id whatever split cuts it. OSWorld's runner and splits name an example by
    its file (``<domain>/<id>.json``), and 11 of OSWorld's files carry another task's ``id`` (thunderbird/a10b69e1-...,
    dfac9ee8-... and 9 more repeat chrome tasks' ids), which would make a training run take two tasks for one."""
    counts = collections.Counter(e.task.id for e in entries.values() if e.task is not None)
    result = {}
    for key, entry in entries.items():
        task = entry.task
        if task is not None and counts[task.id] > 1 and task.id != entry.task_id:
            entry = replace(entry, task=replace(task, id=entry.task_id, raw={**task.raw, "id": entry.task_id}))
        result[key] = entry
    return result
