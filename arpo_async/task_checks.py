"""The checks a task dict passes before it becomes an :class:`arpo_async.tasks.Task`: the errors they raise,
the size caps, and the field checks.

:func:`check_task` walks a task's JSON value (plain JSON all through, nesting within :data:`MAX_JSON_DEPTH`),
then its fields: ``id``, ``instruction``, the setup steps of ``config`` and ``evaluator.postconfig`` (with the
types of the parameters OSWorld's setup steps take, :data:`SETUP_PARAMETERS`), the ``evaluator`` (metric funcs,
getters, options, one per func when ``func`` is a list), ``family`` and ``related_apps``; on request, the setup
types, getter types and metric funcs against those our evaluator implements (:mod:`arpo_async.task_names`), and
every ``upload_file`` source against the task file's folder. Whatever the value, it raises only
:class:`TaskFormatError` (or its subclass :class:`UnsupportedTask`), naming the source and the field.
"""
from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Any

from arpo_async.task_names import GETTER_TYPES, METRIC_FUNCS, SETUP_TYPES

INFEASIBLE = "infeasible"
"""The metric func of a task whose success is the agent giving up (scored by its last action)."""

MAX_JSON_DEPTH = 32
"""Deepest nesting of objects/lists in a task (the task object itself is level 1; OSWorld's deepest is 9)."""
MAX_ID_CHARS = 256
"""Longest ``id`` (and ``family``)."""
MAX_INSTRUCTION_CHARS = 10_000
"""Longest ``instruction`` (OSWorld's longest is under 700)."""
MAX_STEPS = 100
"""Most steps in ``config``, and separately in ``evaluator.postconfig`` (OSWorld uses at most 9)."""
MAX_METRICS = 32
"""Most metrics in a list ``evaluator.func`` (OSWorld uses at most 5)."""
MAX_RELATED_APPS = 64
"""Most entries in ``related_apps``."""
_INT_MIN, _INT_MAX = -(2 ** 63), 2 ** 64 - 1  # what the msgpack wire codec can carry


class TaskFormatError(ValueError):
    """A task file or dict is not valid OSWorld task JSON; the message names the file and the field.
    ``kind`` is ``format`` (see :class:`UnsupportedTask` for valid tasks we cannot run)."""

    kind = "format"


class UnsupportedTask(TaskFormatError):
    """A valid task that uses a part our evaluator does not implement.

    Attributes:
        kind: ``setup_type``, ``getter`` or ``metric`` (load time; ``needs_network`` and ``app_missing`` are
            found when the task is set up, as actors.osworld.setup.TaskSetupError kinds).
        detail: the missing part's name (e.g. ``googledrive``).
    """

    def __init__(self, message: str, kind: str, detail: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.detail = detail


def check_task(d: Any, source: str, *, check_names: bool = False,
               folder: Path | None = None) -> tuple[dict, str]:
    """Check an OSWorld task dict; return it (a copy whose ``upload_file`` sources are absolute when ``folder`` is
    given, else ``d`` itself) and its family (the ``family`` key, else the id up to its last '-').

    Args:
        d: the task's JSON value.
        source: where it came from (a path), used in error messages.
        check_names: also require every setup type, getter type and metric func to be one our evaluator
            implements (``SETUP_TYPES``, ``GETTER_TYPES``, ``METRIC_FUNCS`` of :mod:`arpo_async.task_names`).
        folder: the folder of the task file: every ``upload_file`` step's ``local_path`` (relative ones taken from
            it) must then lie inside it, after symlinks are followed, so a task cannot copy the actor host's other
            files into a desktop. None: not checked.

    Raises:
        TaskFormatError: naming ``source`` and the field: not an object; a value that is not JSON (NaN,
            Infinity, an integer beyond 64 bits, a string that is not valid Unicode, a non-string key,
            another Python type); nesting deeper than MAX_JSON_DEPTH; a missing or mistyped field; a
            field over its cap (MAX_ID_CHARS, MAX_INSTRUCTION_CHARS, MAX_STEPS, MAX_METRICS,
            MAX_RELATED_APPS); an id with ``/``, ``\\`` or ``..`` (it names files in the download cache and
            the OSWorld mirror); with ``folder``, an ``upload_file`` source outside it.
        UnsupportedTask: with ``check_names``, an unknown setup type, getter type or metric func (listing the
            supported ones).
    """
    def fail(fieldname: str, why: str) -> TaskFormatError:
        return TaskFormatError(f"{source}: field '{fieldname}': {why}")

    if not isinstance(d, dict):
        raise TaskFormatError(f"{source}: a task must be a JSON object, got {type(d).__name__}")
    _check_json_value(d, source)
    for key in ("id", "instruction"):
        if not isinstance(d.get(key), str) or not d[key].strip():
            raise fail(key, "required, a non-empty string")
    _check_len(d["id"], MAX_ID_CHARS, "id", fail)
    if any(bad in d["id"] for bad in ("/", "\\", "..")):
        raise fail("id", f"{d['id'][:80]!r} holds '/', '\\' or '..' (an id names files under the download "
                         "cache and learner.osworld_files; it must not walk out of them)")
    _check_len(d["instruction"], MAX_INSTRUCTION_CHARS, "instruction", fail)
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
    else:
        _check_len(family, MAX_ID_CHARS, "family", fail)
    apps = d.get("related_apps", [])
    if not isinstance(apps, list) or not all(isinstance(a, str) for a in apps):
        raise fail("related_apps", "must be a list of strings")
    if len(apps) > MAX_RELATED_APPS:
        raise fail("related_apps", f"{len(apps)} entries, more than the cap of {MAX_RELATED_APPS}")
    for i, app in enumerate(apps):
        _check_len(app, MAX_ID_CHARS, f"related_apps[{i}]", fail)
    if check_names:
        _check_names(config, ev, fail)
    if folder is not None:  # on a copy: upload sources become absolute paths, the caller's dict stays
        config = copy.deepcopy(config)
        _check_upload_sources(config, folder, fail)
        d = {**d, "config": config}
    return d, family


def _check_len(value: str, cap: int, where: str, fail) -> None:
    if len(value) > cap:
        raise fail(where, f"{len(value)} characters, more than the cap of {cap}")


def _check_json_value(root: dict, source: str) -> None:
    """Walk the task (iteratively: no recursion, whatever the depth) and require plain JSON all through: str
    keys, valid-Unicode strings, finite floats, integers a 64-bit wire field can carry, nesting within
    MAX_JSON_DEPTH. Raises TaskFormatError naming the path of the first bad value."""
    stack: list[tuple[Any, str, int]] = [(root, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        where = path or "<top level>"
        if isinstance(value, (dict, list, tuple)):
            if depth > MAX_JSON_DEPTH:
                raise TaskFormatError(f"{source}: field '{where}': nested deeper than the cap of "
                                      f"{MAX_JSON_DEPTH} levels")
            if isinstance(value, dict):
                for k, v in value.items():
                    if not isinstance(k, str):
                        raise TaskFormatError(f"{source}: field '{where}': key {k!r} is not a string")
                    _check_str(k, f"{path}.{k}" if path else k, source)
                    stack.append((v, f"{path}.{k}" if path else k, depth + 1))
            else:
                stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))
        elif isinstance(value, str):
            _check_str(value, where, source)
        elif isinstance(value, bool) or value is None:
            pass
        elif isinstance(value, int):
            if not _INT_MIN <= value <= _INT_MAX:
                raise TaskFormatError(f"{source}: field '{where}': integer out of the 64-bit range")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise TaskFormatError(f"{source}: field '{where}': {value} is not allowed (only finite numbers)")
        else:
            raise TaskFormatError(f"{source}: field '{where}': {type(value).__name__} is not a JSON value")


def _check_str(s: str, where: str, source: str) -> None:
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise TaskFormatError(f"{source}: field '{where}': not valid Unicode text ({exc.reason} at "
                                  f"character {exc.start})") from None


def _supported(kind: str, name: str, names: frozenset[str]) -> str:
    return f"unknown {kind} {name!r} (supported: {', '.join(sorted(names))})"


def _unsupported(exc: TaskFormatError, kind: str, detail: str) -> UnsupportedTask:
    return UnsupportedTask(str(exc), kind, detail)


def _check_names(config: list, ev: dict, fail) -> None:
    """Every setup type, getter type and metric func must be one our evaluator implements (shapes are
    already valid). The getters of an infeasible task are never called, so they are not checked."""
    for where, steps in (("config", config), ("evaluator.postconfig", ev.get("postconfig", []))):
        for i, step in enumerate(steps):
            if step["type"] not in SETUP_TYPES:
                raise _unsupported(fail(f"{where}[{i}].type", _supported("setup type", step["type"], SETUP_TYPES)),
                                   "setup_type", step["type"])
    func = ev["func"]
    if func == INFEASIBLE:
        return
    multi = isinstance(func, list)
    for i, f in enumerate(func if multi else [func]):
        if f not in METRIC_FUNCS:
            raise _unsupported(fail(f"evaluator.func[{i}]" if multi else "evaluator.func",
                                    _supported("metric func", f, METRIC_FUNCS)), "metric", f)
    for key in ("result", "expected"):
        if key not in ev:
            continue
        getters = ev[key] if multi else [ev[key]]
        for i, g in enumerate(getters):
            if g is not None and g["type"] not in GETTER_TYPES:
                raise _unsupported(fail(f"evaluator.{key}[{i}].type" if multi else f"evaluator.{key}.type",
                                        _supported("getter type", g["type"], GETTER_TYPES)), "getter", g["type"])


def _is_command(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 86_400


def _is_file_list(*keys: str):
    return lambda v: isinstance(v, list) and all(isinstance(f, dict) and all(isinstance(f.get(k), str)
                                                                            for k in keys) for f in v)


def _is_str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


_COMMAND_PARAMS = {"command": (_is_command, "a string or a list of strings"),
                   "shell": (lambda v: isinstance(v, (bool, str)), "a boolean"),
                   "until": (lambda v: isinstance(v, dict), "an object"),
                   "timeout": (_is_number, "a number of seconds in [0, 86400]"),
                   "stdout": (lambda v: isinstance(v, str), "a string"),
                   "stderr": (lambda v: isinstance(v, str), "a string")}
_WINDOW_PARAMS = {"window_name": (lambda v: isinstance(v, str), "a string"),
                  "strict": (lambda v: isinstance(v, bool), "a boolean"),
                  "by_class": (lambda v: isinstance(v, bool), "a boolean")}
SETUP_PARAMETERS: dict[str, dict[str, tuple[Any, str]]] = {
    "execute": _COMMAND_PARAMS, "command": _COMMAND_PARAMS,
    "launch": {"command": _COMMAND_PARAMS["command"], "shell": _COMMAND_PARAMS["shell"]},
    "sleep": {"seconds": (_is_number, "a number of seconds in [0, 86400]")},
    "activate_window": _WINDOW_PARAMS, "close_window": _WINDOW_PARAMS,
    "open": {"path": (lambda v: isinstance(v, str), "a string")},
    "download": {"files": (_is_file_list("url", "path"), "a list of {url, path} objects with string values")},
    "upload_file": {"files": (_is_file_list("local_path", "path"),
                              "a list of {local_path, path} objects with string values")},
    "chrome_open_tabs": {"urls_to_open": (_is_str_list, "a list of strings")},
    "chrome_close_tabs": {"urls_to_close": (_is_str_list, "a list of strings")},
    "update_browse_history": {"history": (lambda v: isinstance(v, list) and all(isinstance(h, dict) for h in v),
                                          "a list of objects")},
}
"""The type of each parameter a setup step takes, as OSWorld's task files use them (its 369 Ubuntu tasks all
pass); a parameter that is present must have it, so a task with ``"command": 5`` is refused when it loads instead
of failing in every episode. Parameters not listed are not checked (OSWorld's own setup controller ignores them)."""


def _check_steps(steps: Any, where: str, fail) -> None:
    if not isinstance(steps, list):
        raise fail(where, "must be a list of {type, parameters} steps")
    if len(steps) > MAX_STEPS:
        raise fail(where, f"{len(steps)} steps, more than the cap of {MAX_STEPS}")
    for i, step in enumerate(steps):
        if not isinstance(step, dict) or not isinstance(step.get("type"), str) or not step["type"]:
            raise fail(f"{where}[{i}]", "a step needs a string 'type'")
        params = step.get("parameters", {})
        if not isinstance(params, dict):
            raise fail(f"{where}[{i}].parameters", "must be an object")
        for name, (ok, kind) in SETUP_PARAMETERS.get(step["type"], {}).items():
            if name in params and not ok(params[name]):
                raise fail(f"{where}[{i}].parameters.{name}", f"must be {kind}, got {_short(params[name])}")


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_upload_sources(steps: list, folder: Path, fail) -> None:
    """Every ``upload_file`` step's ``local_path`` is a string naming a file inside ``folder`` (relative paths are
    taken from it; symlinks are followed before the check), and is rewritten in ``steps`` to that file's resolved
    absolute path: the actor reads exactly the file checked here, whatever its working directory (and refuses it if
    a symlink is put on the way later: actors.osworld.setup)."""
    root = os.path.realpath(folder)
    for i, step in enumerate(steps):
        if step["type"] != "upload_file":
            continue
        files = step.get("parameters", {}).get("files")
        for j, entry in enumerate(files if isinstance(files, list) else []):
            where = f"config[{i}].parameters.files[{j}].local_path"
            local = entry.get("local_path") if isinstance(entry, dict) else None
            if not isinstance(local, str) or not local or "\0" in local:
                raise fail(where, "must be a non-empty string without NUL (a file next to the task file)")
            resolved = os.path.realpath(os.path.join(root, local))
            if os.path.commonpath([root, resolved]) != root:
                raise fail(where, f"{local[:200]!r} lies outside the task's folder {root}; upload_file sends only "
                                  "files next to the task file (use a download step for others)")
            entry["local_path"] = resolved


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
        if n > MAX_METRICS:
            raise fail("evaluator.func", f"{n} metrics, more than the cap of {MAX_METRICS}")
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
