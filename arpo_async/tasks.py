"""Tasks in OSWorld's task JSON format: the typed, validated view and the loader.

A task file is one JSON object (OSWorld, evaluation_examples/examples/<domain>/<id>.json):

    {"id": str, "instruction": str, "config": [{"type": str, "parameters": {...}}, ...],
     "evaluator": {"func": str | [str], "conj"?: "and"|"or", "result"?: getter | [getter],
                   "expected"?: getter | [getter], "options"?: {...} | [{...}], "postconfig"?: [step, ...]},
     "snapshot"?, "source"?, "trajectory"?, "related_apps"?: [str], ...}

where a getter is ``{"type": str, ...}``. We add one optional top-level key, ``family`` (a task family name
for per-family success rates); without it the family is the id up to its last '-'. Unknown keys are kept.
Tasks travel over the wire as their raw JSON dicts (:meth:`Task.to_dict`); :meth:`Task.from_dict` rebuilds
and re-validates them.

The built-in suite lives in ``arpo_async/tasks_builtin/*.json`` and runs in the arpo desktop image.

Hardening: a task file is read as at most :data:`MAX_TASK_FILE_BYTES` of strict UTF-8 JSON with no duplicate
keys, no NaN/Infinity (nor a number that overflows to one) and at most ``MAX_JSON_DEPTH`` levels of nesting; the
fields have size caps. The checks, their caps and their errors are :mod:`arpo_async.task_checks`'. Whatever the
bytes, loading raises only :class:`TaskFormatError`, naming the file (and the field where there is one). Files
loaded with :func:`load_task_file` / :func:`load_tasks` are also checked against the setup types, getter types and
metric funcs our evaluator implements (kept in :mod:`arpo_async.task_names`), so a task we cannot run fails when the
task set is loaded, not in an episode.
"""
from __future__ import annotations

import copy
import json
import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arpo_async.task_checks import INFEASIBLE, MAX_JSON_DEPTH, TaskFormatError, check_task

BUILTIN_DIR = Path(__file__).resolve().parent / "tasks_builtin"

MAX_TASK_FILE_BYTES = 1_000_000
"""A task file larger than this is rejected unread (OSWorld's largest example is under 10 kB)."""


@dataclass(frozen=True)
class Task:
    """One task: what to tell the agent, how to set the desktop up, and how to score the episode.

    Attributes:
        id: unique task id.
        instruction: the natural-language instruction given to the agent.
        config: setup steps ``[{"type", "parameters"}]`` run before the episode.
        evaluator: OSWorld evaluator dict (func, conj, result, expected, options, postconfig).
        raw: the task's JSON dict as given (returned by :meth:`to_dict`; do not mutate).
        family: task family for per-family statistics (``family`` key, else the id up to its last '-').
        related_apps: apps the task uses (OSWorld's ``related_apps``), informational.
        source: where the file came from (path) or "<dict>"; used in error messages only.
    """

    id: str
    instruction: str
    config: tuple[dict, ...]
    evaluator: dict
    raw: dict = field(repr=False, compare=False)
    family: str = ""
    related_apps: tuple[str, ...] = ()
    source: str = field(default="<dict>", repr=False, compare=False)

    def __hash__(self) -> int:
        return hash(self.id)

    @property
    def infeasible(self) -> bool:
        """True when success means the agent gives up (evaluator func ``infeasible``)."""
        return self.evaluator.get("func") == INFEASIBLE

    @property
    def funcs(self) -> list[str]:
        """Metric names as a list (one element when ``func`` is a string)."""
        f = self.evaluator["func"]
        return list(f) if isinstance(f, list) else [f]

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "<dict>", check_names: bool = False,
                  folder: Path | None = None) -> Task:
        """Validate an OSWorld task dict and build a Task.

        Args:
            d: the task's JSON dict.
            source: where it came from (a path), used in error messages.
            check_names: also require every setup type, getter type and metric func to be one our evaluator
                implements (:mod:`arpo_async.task_names`); :func:`load_task_file` and :func:`load_tasks` pass True.
            folder: the folder of the task file (:func:`load_task_file` passes it): every ``upload_file`` step's
                ``local_path`` (relative ones taken from it) must then lie inside it, after symlinks are
                followed, so a task cannot copy the actor host's other files into a desktop. None: not checked.

        Raises:
            TaskFormatError: naming ``source`` and the field, for each reason
                :func:`arpo_async.task_checks.check_task` lists (a value that is not JSON, a missing, mistyped or
                oversized field, an id that could walk out of a folder, an ``upload_file`` source outside
                ``folder``); with ``check_names``, its subclass UnsupportedTask for a part our evaluator lacks.
        """
        d, family = check_task(d, source, check_names=check_names, folder=folder)
        raw = copy.deepcopy(d)
        return cls(id=d["id"], instruction=d["instruction"], config=tuple(copy.deepcopy(d.get("config", []))),
                   evaluator=copy.deepcopy(d["evaluator"]), raw=raw, family=family,
                   related_apps=tuple(d.get("related_apps", [])), source=source)

    def to_dict(self) -> dict:
        """The task's OSWorld JSON dict (a copy), as sent over the wire."""
        return copy.deepcopy(self.raw)


class _Rejected(ValueError):
    """Raised from the JSON parser's hooks (duplicate key, NaN/Infinity, a number overflowing to infinity)."""


def _object_without_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _Rejected(f"duplicate key {k!r} in an object")
        out[k] = v
    return out


def _reject_constant(name: str) -> Any:
    raise _Rejected(f"{name} is not allowed (only finite numbers)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Rejected(f"number {text[:40]} is out of range")
    return value


def parse_task_json(data: bytes, source: str) -> Any:
    """Parse a task file's bytes as strict JSON: UTF-8 (no BOM), no duplicate keys, no NaN/Infinity, no number
    that overflows to infinity, nesting that the parser can take (the depth cap proper is checked by
    :meth:`Task.from_dict`).

    Raises:
        TaskFormatError: naming ``source`` and why (not UTF-8 text, invalid JSON with line and column,
            duplicate key, non-finite number, nested too deeply); never another exception.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TaskFormatError(f"{source}: not UTF-8 text (binary content?): {exc.reason} at byte "
                              f"{exc.start}") from None
    try:
        return json.loads(text, object_pairs_hook=_object_without_duplicates, parse_constant=_reject_constant,
                          parse_float=_finite_float)
    except _Rejected as exc:
        raise TaskFormatError(f"{source}: invalid JSON: {exc}") from None
    except json.JSONDecodeError as exc:
        raise TaskFormatError(f"{source}: invalid JSON: {exc}") from None
    except RecursionError:
        raise TaskFormatError(f"{source}: invalid JSON: nested too deeply (the cap is {MAX_JSON_DEPTH} "
                              f"levels)") from None
    except ValueError as exc:  # e.g. an integer literal over Python's 4300-digit limit
        raise TaskFormatError(f"{source}: invalid JSON: {exc}") from None


def read_task_json(path: str | Path) -> Any:
    """A task file's JSON value, read as :func:`load_task_file` reads it (at most MAX_TASK_FILE_BYTES, then
    :func:`parse_task_json`), not yet checked as a task.

    Raises:
        TaskFormatError: naming the path: it cannot be read or is not a regular file; it is larger than
            MAX_TASK_FILE_BYTES; or its bytes are not strict UTF-8 JSON. Never another exception.
    """
    path = Path(path)
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise TaskFormatError(f"{path}: not a regular file")
        if st.st_size > MAX_TASK_FILE_BYTES:
            raise TaskFormatError(f"{path}: {st.st_size} bytes, more than the cap of {MAX_TASK_FILE_BYTES} "
                                  f"for a task file")
        with open(path, "rb") as fh:
            data = fh.read(MAX_TASK_FILE_BYTES + 1)
    except (OSError, ValueError) as exc:  # ValueError: e.g. a NUL in the path
        if isinstance(exc, TaskFormatError):
            raise
        raise TaskFormatError(f"{path}: cannot read: {exc}") from exc
    if len(data) > MAX_TASK_FILE_BYTES:  # it grew after the stat
        raise TaskFormatError(f"{path}: more than the cap of {MAX_TASK_FILE_BYTES} bytes for a task file")
    return parse_task_json(data, str(path))


def load_task_file(path: str | Path, *, check_names: bool = True) -> Task:
    """Load and validate one task file (see :meth:`Task.from_dict`; ``check_names`` as there, on by default).

    Raises:
        TaskFormatError: naming the path: it cannot be read, is too large or is not strict JSON
            (:func:`read_task_json`), or the task is invalid (:meth:`Task.from_dict`, which also names the field).
    """
    return Task.from_dict(read_task_json(path), source=str(path), check_names=check_names, folder=Path(path).parent)


def load_tasks(path: str | Path | None = None) -> list[Task]:
    """Load tasks: None = the built-in suite; a folder = every *.json file under it (recursively, sorted by
    path); a file = that one task. Each file goes through :func:`load_task_file` (size cap, strict JSON,
    field checks, and the setup types, getter types and metric funcs our evaluator implements).

    Raises TaskFormatError for a malformed file or a task we cannot run (naming the file and field), a
    missing path, an empty folder, or a duplicate task id (naming both files).
    """
    root = BUILTIN_DIR if path is None else Path(path)
    if root.is_dir():
        files = sorted(p for p in root.rglob("*.json") if p.is_file())
        if not files:
            raise TaskFormatError(f"{root}: no *.json task files in this folder")
    elif root.is_file():
        files = [root]
    else:
        raise TaskFormatError(f"{root}: no such task file or folder")
    tasks: list[Task] = []
    seen: dict[str, str] = {}
    for f in files:
        task = load_task_file(f)
        if task.id in seen:
            raise TaskFormatError(f"{f}: duplicate task id {task.id!r} (also in {seen[task.id]})")
        seen[task.id] = str(f)
        tasks.append(task)
    return tasks
