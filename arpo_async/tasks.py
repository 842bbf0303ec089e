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
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUILTIN_DIR = Path(__file__).resolve().parent / "tasks_builtin"
INFEASIBLE = "infeasible"


class TaskFormatError(ValueError):
    """A task file or dict is not valid OSWorld task JSON; the message names the file and the field."""


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

    @property
    def expected_string(self) -> str | None:
        """The string a single-metric evaluator expects by rule (``expected.rules.expected``, e.g. the label a
        button-grid task must click); None when the evaluator has no such rule (list of metrics, a getter, ...)."""
        expected = self.evaluator.get("expected")
        rules = expected.get("rules") if isinstance(expected, dict) else None
        value = rules.get("expected") if isinstance(rules, dict) else None
        return value if isinstance(value, str) else None

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "<dict>") -> Task:
        """Validate an OSWorld task dict and build a Task. Raises TaskFormatError naming source and field."""
        def fail(fieldname: str, why: str) -> TaskFormatError:
            return TaskFormatError(f"{source}: field '{fieldname}': {why}")

        if not isinstance(d, dict):
            raise TaskFormatError(f"{source}: a task must be a JSON object, got {type(d).__name__}")
        for key in ("id", "instruction"):
            if not isinstance(d.get(key), str) or not d[key].strip():
                raise fail(key, "required, a non-empty string")
        config = d.get("config", [])
        _check_steps(config, "config", fail)
        ev = d.get("evaluator")
        if not isinstance(ev, dict):
            raise fail("evaluator", "required, an object")
        _check_evaluator(ev, fail)
        family = d.get("family")
        if family is None:
            family = d["id"].rsplit("-", 1)[0] if "-" in d["id"] else d["id"]
        elif not isinstance(family, str) or not family:
            raise fail("family", "must be a non-empty string")
        apps = d.get("related_apps", [])
        if not isinstance(apps, list) or not all(isinstance(a, str) for a in apps):
            raise fail("related_apps", "must be a list of strings")
        raw = copy.deepcopy(d)
        return cls(id=d["id"], instruction=d["instruction"], config=tuple(copy.deepcopy(config)),
                   evaluator=copy.deepcopy(ev), raw=raw, family=family, related_apps=tuple(apps), source=source)

    def to_dict(self) -> dict:
        """The task's OSWorld JSON dict (a copy), as sent over the wire."""
        return copy.deepcopy(self.raw)


def _check_steps(steps: Any, where: str, fail) -> None:
    if not isinstance(steps, list):
        raise fail(where, "must be a list of {type, parameters} steps")
    for i, step in enumerate(steps):
        if not isinstance(step, dict) or not isinstance(step.get("type"), str) or not step["type"]:
            raise fail(f"{where}[{i}]", "a step needs a string 'type'")
        if not isinstance(step.get("parameters", {}), dict):
            raise fail(f"{where}[{i}].parameters", "must be an object")


def _check_getter(g: Any, where: str, fail, *, allow_none: bool) -> None:
    if g is None and allow_none:
        return
    if not isinstance(g, dict) or not isinstance(g.get("type"), str) or not g["type"]:
        raise fail(where, "a getter must be an object with a string 'type'")


def _check_evaluator(ev: dict, fail) -> None:
    func = ev.get("func")
    if isinstance(func, str):
        if not func:
            raise fail("evaluator.func", "must not be empty")
        n = None
    elif isinstance(func, list) and func and all(isinstance(f, str) and f for f in func):
        n = len(func)
    else:
        raise fail("evaluator.func", "required, a metric name or a non-empty list of names")
    if n is not None and INFEASIBLE in func:
        raise fail("evaluator.func", "'infeasible' cannot be combined with other metrics")
    conj = ev.get("conj", "and")
    if conj not in ("and", "or"):
        raise fail("evaluator.conj", f"must be 'and' or 'or', got {conj!r}")
    if func != INFEASIBLE and "result" not in ev:
        raise fail("evaluator.result", "required unless func is 'infeasible'")
    for key in ("result", "expected"):
        if key not in ev:
            continue
        val = ev[key]
        if n is None:
            _check_getter(val, f"evaluator.{key}", fail, allow_none=False)
        else:
            if not isinstance(val, list) or len(val) != n:
                raise fail(f"evaluator.{key}", f"must be a list of {n} getters (one per func)")
            for i, g in enumerate(val):
                _check_getter(g, f"evaluator.{key}[{i}]", fail, allow_none=(key == "expected"))
    if "options" in ev:
        opts = ev["options"]
        if n is None and not isinstance(opts, dict):
            raise fail("evaluator.options", "must be an object")
        if n is not None and not (isinstance(opts, list) and len(opts) == n
                                  and all(o is None or isinstance(o, dict) for o in opts)):
            raise fail("evaluator.options", f"must be a list of {n} objects (or null)")
    _check_steps(ev.get("postconfig", []), "evaluator.postconfig", fail)


def load_task_file(path: str | Path) -> Task:
    """Load and validate one task file. Raises TaskFormatError (with the path) on bad JSON or fields."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TaskFormatError(f"{path}: invalid JSON: {exc}") from exc
    except OSError as exc:
        raise TaskFormatError(f"{path}: cannot read: {exc}") from exc
    return Task.from_dict(data, source=str(path))


def load_tasks(path: str | Path | None = None) -> list[Task]:
    """Load tasks: None = the built-in suite; a folder = every *.json under it (recursively, sorted by
    path); a file = that one task.

    Raises TaskFormatError for a malformed file (naming it), a missing path, an empty folder, or a
    duplicate task id (naming both files).
    """
    root = BUILTIN_DIR if path is None else Path(path)
    if root.is_dir():
        files = sorted(root.rglob("*.json"))
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
