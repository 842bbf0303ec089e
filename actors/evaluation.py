"""Task setup and scoring with OSWorld's semantics, against a live desktop's controller.

Setup: :func:`run_setup` runs OSWorld setup steps (``{"type", "parameters"}``) in order through the controller.
Scoring: :func:`evaluate` follows OSWorld's ``DesktopEnv.evaluate`` (desktop_env/desktop_env.py):

1. run the evaluator's ``postconfig`` steps;
2. func ``infeasible``: 1.0 iff the episode's last action was FAIL, else 0.0;
3. otherwise a last action of FAIL scores 0.0;
4. one metric: ``metric(result_getter(), expected_getter(), **options)`` (without the expected argument when
   the task has none); a list of metrics combines per ``conj``: "and" returns 0 at the first 0, else the mean;
   "or" returns 1 at the first 1, else the max.

Getters (``get_<type>`` in OSWorld) and metrics live in the :data:`GETTERS` and :data:`METRICS` registries;
add an entry to support more. Getters read the desktop's real state after the episode, so the reward is
what the agent actually did. A getter that finds nothing returns None and metrics score None as 0.

Errors: TaskSetupError for a setup step that cannot be run or fails; EvaluationError for an unknown getter
or metric or a malformed evaluator; DesktopError (from the controller) when the desktop itself is gone.
"""
from __future__ import annotations

import asyncio
import difflib
import math
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.desktop.controller_client import ControllerClient, RequestRefused
from arpo_async.tasks import Task

UNTIL_TRIALS = 31  # OSWorld SetupController._execute_setup: at most 31 tries ...
UNTIL_INTERVAL_S = 0.3  # ... 0.3 s apart
UNTIL_DEADLINE_S = 60.0  # ours: an `until` loop also stops after this many seconds in all
FAIL_ACTION = "FAIL"


class TaskSetupError(Exception):
    """A setup (or postconfig) step is unknown, malformed, or failed inside the desktop."""


class EvaluationError(Exception):
    """The evaluator names an unknown getter or metric, or a metric returned something that is not a score."""


# --------------------------------------------------------------------------------------------------------
# setup steps


def _params(step: dict) -> dict:
    return step.get("parameters") or {}


async def _step_launch(c: ControllerClient, p: dict) -> None:
    if "command" not in p:
        raise TaskSetupError("launch: parameters need 'command'")
    await c.launch(p["command"], shell=bool(p.get("shell", False)))


def _until_met(result: dict, until: dict) -> bool:
    ok = True
    if "returncode" in until:
        ok = ok and result.get("returncode") == until["returncode"]
    if "stdout" in until:
        ok = ok and str(until["stdout"]) in (result.get("output") or "")
    if "stderr" in until:
        ok = ok and str(until["stderr"]) in (result.get("error") or "")
    return ok


async def _step_execute(c: ControllerClient, p: dict) -> None:
    """OSWorld's execute/command step; ``until`` ({returncode|stdout|stderr}) retries up to 31 times, 0.3 s
    apart (and for at most 60 s in all), and (stricter than OSWorld, which only logs) raises TaskSetupError if
    never met. A command that
    cannot run or times out raises TaskSetupError; a non-zero exit without ``until`` is accepted, as in
    OSWorld."""
    if "command" not in p:
        raise TaskSetupError("execute: parameters need 'command'")
    until = p.get("until") or {}
    timeout = float(p.get("timeout", 120))
    deadline = time.monotonic() + UNTIL_DEADLINE_S
    for trial in range(1, UNTIL_TRIALS + 1 if until else 2):
        result = await c.execute(p["command"], shell=bool(p.get("shell", False)), timeout=timeout, setup=True)
        if result["status"] != "success":
            raise TaskSetupError(f"execute {p['command']!r} failed: {result.get('error') or result.get('message')}")
        if not until or _until_met(result, until):
            return
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(UNTIL_INTERVAL_S)
    raise TaskSetupError(f"execute {p['command']!r}: condition {until} not met after {trial} tries; "
                         f"last returncode {result['returncode']}, stderr {result['error'][-300:]!r}")


async def _step_sleep(c: ControllerClient, p: dict) -> None:
    seconds = p.get("seconds")
    if not isinstance(seconds, (int, float)) or seconds < 0:
        raise TaskSetupError(f"sleep: 'seconds' must be a non-negative number, got {seconds!r}")
    await asyncio.sleep(seconds)


async def _step_activate_window(c: ControllerClient, p: dict) -> None:
    name = p.get("window_name")
    if not name:
        raise TaskSetupError("activate_window: parameters need 'window_name'")
    if not await c.activate_window(name, strict=bool(p.get("strict", False))):
        raise TaskSetupError(f"activate_window: no visible window named {name!r}")


async def _step_close_window(c: ControllerClient, p: dict) -> None:
    name = p.get("window_name")
    if not name:
        raise TaskSetupError("close_window: parameters need 'window_name'")
    if not await c.close_window(name, strict=bool(p.get("strict", False))):
        raise TaskSetupError(f"close_window: no visible window named {name!r}")


async def _step_open(c: ControllerClient, p: dict) -> None:
    path = p.get("path")
    if not path:
        raise TaskSetupError("open: parameters need 'path'")
    probe = await c.execute("command -v xdg-open", shell=True, timeout=10, setup=True)
    if probe["returncode"] != 0:
        raise TaskSetupError("open: xdg-open is not installed in this desktop image")
    await c.launch(["xdg-open", path])


UPLOAD_MAX_BYTES = 32 * 1024 * 1024
"""Largest local file an ``upload_file`` step sends. With its multipart framing it fits the controller's request
body limit (an eighth of the desktop's memory, at most 64 MiB: actors/desktop/fleet.py controller_env) for
desktops of more than 256 MiB (the default is 512); a smaller desktop refuses it (413, a TaskSetupError). It also
bounds what the actor holds in memory per upload."""


def _read_upload_source(path: str, cap: int) -> bytes:
    """The bytes of the regular file ``path`` on the actor host: TaskSetupError when it is anything else (a
    folder, a device such as /dev/zero, a FIFO: opened without blocking) or holds more than ``cap`` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise TaskSetupError(f"upload_file: cannot read {path}: {exc}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TaskSetupError(f"upload_file: {path} is not a regular file")
        if st.st_size > cap:
            raise TaskSetupError(f"upload_file: {path} has {st.st_size} bytes, more than the limit of {cap}")
    except BaseException:
        os.close(fd)
        raise
    with open(fd, "rb", buffering=0) as f:
        data = bytearray()
        while len(data) <= cap:  # read up to the cap even if the file grew since fstat
            chunk = f.read(min(1024 * 1024, cap + 1 - len(data)))
            if not chunk:
                return bytes(data)
            data += chunk
        raise TaskSetupError(f"upload_file: {path} grew past the limit of {cap} bytes while it was read")


async def _step_upload_file(c: ControllerClient, p: dict) -> None:
    """OSWorld's upload_file: copies local files (on the actor host) into the desktop. Each must be a regular
    file of at most UPLOAD_MAX_BYTES; anything else, an unreadable file or a controller that refuses the upload
    (RequestRefused, e.g. over its body limit) is a TaskSetupError."""
    files = p.get("files")
    if not isinstance(files, list) or not files:
        raise TaskSetupError("upload_file: parameters need 'files': [{local_path, path}, ...]")
    for f in files:
        try:
            local, target = str(f["local_path"]), f["path"]
        except (KeyError, TypeError) as exc:
            raise TaskSetupError(f"upload_file: each file needs 'local_path' and 'path', got {f!r}") from exc
        try:
            data = await asyncio.to_thread(_read_upload_source, local, UPLOAD_MAX_BYTES)
        except OSError as exc:
            raise TaskSetupError(f"upload_file: cannot read {local}: {exc}") from exc
        try:
            await c.upload(target, data)
        except RequestRefused as exc:
            raise TaskSetupError(f"upload_file: the desktop refused {local} -> {target}: {exc}") from exc


SetupStep = Callable[[ControllerClient, dict], Awaitable[None]]
SETUP_STEPS: dict[str, SetupStep] = {
    "launch": _step_launch,
    "execute": _step_execute,
    "command": _step_execute,
    "sleep": _step_sleep,
    "activate_window": _step_activate_window,
    "close_window": _step_close_window,
    "open": _step_open,
    "upload_file": _step_upload_file,
}


async def run_setup(controller: ControllerClient, steps: list[dict] | tuple[dict, ...]) -> None:
    """Run OSWorld setup steps in order.

    Raises TaskSetupError naming the step (index and type) for an unknown type or a failed step;
    DesktopError passes through when the desktop cannot be reached.
    """
    for i, step in enumerate(steps):
        kind = step.get("type") if isinstance(step, dict) else None
        handler = SETUP_STEPS.get(kind)  # type: ignore[arg-type]
        if handler is None:
            raise TaskSetupError(f"setup step {i}: unknown type {kind!r} (supported: {', '.join(sorted(SETUP_STEPS))})")
        try:
            await handler(controller, _params(step))
        except TaskSetupError as exc:
            raise TaskSetupError(f"setup step {i} ({kind}): {exc}") from exc


# --------------------------------------------------------------------------------------------------------
# getters: async (controller, config, ctx) -> value


@dataclass
class EvalContext:
    """Per-evaluation scratch space: ``cache_dir`` holds files fetched by vm_file (removed afterwards)."""

    cache_dir: Path


async def get_vm_file(c: ControllerClient, config: dict, ctx: EvalContext) -> Any:
    """OSWorld get_vm_file: fetch ``path`` into the cache as ``dest``; returns the local path, or None when the
    file does not exist. With ``multi``: lists ``path``/``dest``, returns the paths at ``gives`` (default [0])
    as a list (or the single path when one is given)."""
    paths = config["path"] if config.get("multi") else [config["path"]]
    dests = config["dest"] if config.get("multi") else [config.get("dest") or Path(config["path"]).name]
    out: list[str | None] = []
    for path, dest in zip(paths, dests, strict=True):
        data = await c.get_file(path)
        if data is None:
            out.append(None)
            continue
        local = ctx.cache_dir / Path(dest).name
        await asyncio.to_thread(local.write_bytes, data)
        out.append(str(local))
    if not config.get("multi"):
        return out[0]
    gives = config.get("gives", [0])
    picked = [out[i] for i in gives]
    return picked[0] if len(picked) == 1 else picked


async def get_vm_command_line(c: ControllerClient, config: dict, ctx: EvalContext) -> str | None:
    """OSWorld get_vm_command_line: stdout of ``command`` run in the desktop (None if it could not run)."""
    r = await c.execute(config["command"], shell=bool(config.get("shell", False)))
    return r["output"] if r["status"] == "success" else None


async def get_vm_command_error(c: ControllerClient, config: dict, ctx: EvalContext) -> str | None:
    """OSWorld get_vm_command_error: stderr of ``command`` run in the desktop (None if it could not run)."""
    r = await c.execute(config["command"], shell=bool(config.get("shell", False)))
    return r["error"] if r["status"] == "success" else None


async def get_rule(c: ControllerClient, config: dict, ctx: EvalContext) -> Any:
    """OSWorld get_rule: the literal ``rules`` object of the getter spec."""
    return config["rules"]


async def get_vm_screen_size(c: ControllerClient, config: dict, ctx: EvalContext) -> dict:
    """OSWorld get_vm_screen_size: {"width", "height"} of the desktop's screen."""
    w, h = await c.screen_size()
    return {"width": w, "height": h}


Getter = Callable[[ControllerClient, dict, EvalContext], Awaitable[Any]]
GETTERS: dict[str, Getter] = {
    "vm_file": get_vm_file,
    "vm_command_line": get_vm_command_line,
    "vm_command_error": get_vm_command_error,
    "rule": get_rule,
    "vm_screen_size": get_vm_screen_size,
}


# --------------------------------------------------------------------------------------------------------
# metrics: sync (result, [expected], **options) -> float in [0, 1]; semantics of OSWorld's metrics/general.py


def exact_match(result: Any, rules: dict) -> float:
    """1.0 iff result == rules["expected"]."""
    return float(result == rules["expected"])


def check_include_exclude(result: Any, rules: dict) -> float:
    """1.0 iff every rules["include"] item is in result and no rules["exclude"] item is; 0.0 for None."""
    if result is None:
        return 0.0
    include, exclude = rules.get("include", []), rules.get("exclude", [])
    return float(all(r in result for r in include) and all(r not in result for r in exclude))


def is_in_list(result: Any, rules: dict) -> float:
    """1.0 iff rules["expected"] is in result."""
    return float(result is not None and rules["expected"] in result)


def literal_match(result: Any, expected: Any, **options: Any) -> float:
    """String (or list of strings) equality; options ``type`` ("str"|"list"), ``ignore_case``."""
    norm = (lambda s: str(s).lower()) if options.get("ignore_case", False) else str
    kind = options.get("type", "str")
    if kind == "str":
        return float(norm(result) == norm(expected))
    if kind == "list":
        if not isinstance(result, (list, tuple)) or not isinstance(expected, (list, tuple)):
            return 0.0
        return float([norm(s) for s in result] == [norm(s) for s in expected])
    raise EvaluationError(f"literal_match: unknown type {kind!r}")


def fuzzy_match(result: Any, rules: dict) -> float:
    """Similarity in [0, 1] of result and rules["expected"] (difflib ratio; OSWorld uses rapidfuzz's
    fuzz.ratio / 100, which agrees on identical and disjoint strings and is close in between)."""
    if result is None:
        return 0.0
    return difflib.SequenceMatcher(a=str(result), b=str(rules["expected"])).ratio()


def _read_text(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def file_contains(file_path: str | None, config: dict) -> float:
    """1.0 iff the file exists and contains every string in config["expected"] (a string or a list)."""
    text = _read_text(file_path)
    if text is None:
        return 0.0
    expected = config["expected"]
    expected = [expected] if isinstance(expected, str) else expected
    return float(all(e in text for e in expected))


def check_list(result: str | None, rules: dict) -> float:
    """File at ``result``: every regex in rules["expect"] matches some line, none in rules["unexpect"] does."""
    text = _read_text(result)
    if text is None:
        return 0.0
    lines = text.splitlines()
    expect = [re.compile(p) for p in rules.get("expect", [])]
    unexpect = [re.compile(p) for p in rules.get("unexpect", [])]
    ok = all(any(p.search(line) for line in lines) for p in expect)
    return float(ok and not any(p.search(line) for p in unexpect for line in lines))


def diff_text_file(result: str | None, expect: str | None) -> float:
    """Line-level difflib ratio of two files; 0.0 when the result file is missing."""
    a, b = _read_text(result), _read_text(expect)
    if a is None or b is None:
        return 0.0
    return difflib.SequenceMatcher(a=a.splitlines(), b=b.splitlines()).ratio()


def compare_text_file(file1: str | None, file2: str | None, **options: Any) -> float:
    """1.0 iff the two files' texts are equal (options ``ignore_blanks``: collapse whitespace;
    ``ignore_case``)."""
    a, b = _read_text(file1), _read_text(file2)
    if a is None or b is None:
        return 0.0
    if options.get("ignore_blanks", False):
        a, b = re.sub(r"\s+", " ", a).strip(), re.sub(r"\s+", " ", b).strip()
    if options.get("ignore_case", False):
        a, b = a.lower(), b.lower()
    return float(a == b)


Metric = Callable[..., float]
METRICS: dict[str, Metric] = {
    "exact_match": exact_match,
    "check_include_exclude": check_include_exclude,
    "is_in_list": is_in_list,
    "literal_match": literal_match,
    "fuzzy_match": fuzzy_match,
    "file_contains": file_contains,
    "check_list": check_list,
    "diff_text_file": diff_text_file,
    "compare_text_file": compare_text_file,
}


# --------------------------------------------------------------------------------------------------------
# scoring


@dataclass(frozen=True)
class _Part:
    metric: str
    result: dict | None
    expected: dict | None
    options: dict


def _as_list(value: Any, n: int) -> list:
    return list(value) if isinstance(value, list) else [value] * n


def _parts(task: Task) -> list[_Part]:
    """One (metric, result getter, expected getter, options) per func, checked against the registries."""
    ev = task.evaluator
    funcs = task.funcs
    n, multi = len(funcs), isinstance(ev["func"], list)
    results = ev.get("result") if multi else [ev.get("result")]
    expected = (ev.get("expected") or [None] * n) if multi else [ev.get("expected")]
    options = (ev.get("options") or [{}] * n) if multi else [ev.get("options") or {}]
    parts = []
    for f, r, e, o in zip(funcs, _as_list(results, n), _as_list(expected, n), _as_list(options, n), strict=True):
        if f not in METRICS:
            raise EvaluationError(f"task {task.id}: unknown metric {f!r} (known: {', '.join(sorted(METRICS))})")
        for g in (r, e):
            if g is not None and g.get("type") not in GETTERS:
                raise EvaluationError(f"task {task.id}: unknown getter {g.get('type')!r} "
                                      f"(known: {', '.join(sorted(GETTERS))})")
        if r is None:
            raise EvaluationError(f"task {task.id}: metric {f!r} has no result getter")
        parts.append(_Part(f, r, e, o or {}))
    return parts


async def _score_part(c: ControllerClient, part: _Part, ctx: EvalContext) -> float:
    result = await GETTERS[part.result["type"]](c, part.result, ctx)  # type: ignore[index]
    metric = METRICS[part.metric]
    if part.expected:
        expected = await GETTERS[part.expected["type"]](c, part.expected, ctx)
        score = await asyncio.to_thread(metric, result, expected, **part.options)
    else:
        score = await asyncio.to_thread(metric, result, **part.options)
    try:
        value = float(score)
    except (TypeError, ValueError) as exc:
        raise EvaluationError(f"metric {part.metric!r} returned {score!r}, not a number") from exc
    if math.isnan(value):
        raise EvaluationError(f"metric {part.metric!r} returned NaN")
    return min(1.0, max(0.0, value))


def _is_fail(last_action: str | None) -> bool:
    return last_action is not None and last_action.strip().upper() == FAIL_ACTION


async def evaluate(controller: ControllerClient, task: Task, last_action: str | None) -> float:
    """Score the episode in [0, 1] from the desktop's state, with OSWorld's semantics (module docstring).

    Args:
        controller: the desktop the episode ran in.
        task: the task (its evaluator is used).
        last_action: the episode's last action ("FAIL" when the agent gave up, e.g. UI-TARS call_user);
            None when the episode had no action.

    Raises EvaluationError (unknown getter/metric, bad metric output), TaskSetupError (postconfig failed),
    DesktopError (desktop unreachable).
    """
    parts = [] if task.infeasible else _parts(task)  # fail fast on unknown names, before postconfig
    await run_setup(controller, task.evaluator.get("postconfig", []))
    if task.infeasible:
        return 1.0 if _is_fail(last_action) else 0.0
    if _is_fail(last_action):
        return 0.0
    conj = task.evaluator.get("conj", "and")
    cache = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="arpo-eval-"))
    try:
        ctx = EvalContext(cache_dir=cache)
        scores: list[float] = []
        for part in parts:
            s = await _score_part(controller, part, ctx)
            if len(parts) > 1 and conj == "and" and s == 0.0:
                return 0.0
            if len(parts) > 1 and conj == "or" and s == 1.0:
                return 1.0
            scores.append(s)
        if len(scores) == 1:
            return scores[0]
        return sum(scores) / len(scores) if conj == "and" else max(scores)
    finally:
        await asyncio.to_thread(shutil.rmtree, cache, True)
