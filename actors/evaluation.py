"""Task setup and scoring with OSWorld's semantics, against a live desktop's controller.

Setup: :func:`run_setup` (actors.osworld.setup) runs OSWorld setup steps (``{"type", "parameters"}``) in order.
Scoring: :func:`evaluate` follows OSWorld's ``DesktopEnv.evaluate`` (desktop_env/desktop_env.py):

1. run the evaluator's ``postconfig`` steps (an activate/close_window whose window is gone is skipped, as
   OSWorld's SetupController only logs it: actors.osworld.setup.SetupContext.postconfig);
2. func ``infeasible``: 1.0 iff the episode's last action was FAIL, else 0.0;
3. otherwise a last action of FAIL, or :data:`PARSE_ERROR_ACTION`, scores 0.0;
4. one metric: ``metric(result_getter(), expected_getter(), **options)`` (without the expected argument when
   the task has none); a list of metrics combines per ``conj``: "and" returns 0 at the first 0, else the mean;
   "or" returns 1 at the first 1, else the max.

Getters (:data:`GETTERS`, actors.osworld.getter_table) read the desktop's real state after the episode, so the reward
is what the agent actually did. Metrics (:data:`METRICS`): a few of our own (actors.osworld.native_metrics), the
rest OSWorld's published functions run unchanged in a worker process (actors.osworld.metrics). A metric that
raises on the state it is given (OSWorld's metrics raise e.g. TypeError on a missing file's None) scores 0.0
(OSWorld lets the exception end the run; an agent that left no such state has failed the task); a metric that
cannot run at all (its library missing, its worker dead) is an EvaluationError.

FAIL is only ever an action the agent chose (UI-TARS ``call_user()``); an episode that ended on a reply nobody
could parse has :data:`PARSE_ERROR_ACTION` as its last action (actors.episode), which is not FAIL: it scores 0.0 on
an infeasible task as on any other. OSWorld's rule, as read in copies of desktop_env/desktop_env.py
(``DesktopEnv.evaluate``; upstream https://github.com/xlang-ai/OSWorld, e.g. the copy in MacPaw/MacArena at
dcdc7d36): ``if func == "infeasible": return 1 if action_history[-1] == "FAIL" else 0``, and a feasible task whose
last action is FAIL returns 0 before any metric.

Errors: TaskSetupError for a setup step that cannot be run or fails; EvaluationError for an unknown getter
or metric or a malformed evaluator; DesktopError (from the controller) when the desktop itself is gone.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.desktop.controller_client import ControllerClient
from actors.osworld.downloads import DownloadCache
from actors.osworld.getter_table import GETTERS
from actors.osworld.getters import EvalContext, GetterError
from actors.osworld.metric_env import MetricEnvError
from actors.osworld.metrics import OSWORLD_METRICS, MetricError, call_metric
from actors.osworld.native_metrics import NATIVE_METRICS, MetricOptionError
from actors.osworld.setup import (SETUP_STEPS, UPLOAD_MAX_BYTES, SetupContext, TaskSetupError,  # noqa: F401
                                  run_setup)
from arpo_async.tasks import Task

FAIL_ACTION = "FAIL"
"""The last action of an agent that gave up (UI-TARS ``call_user()``): wins an infeasible task, zeroes any other."""
PARSE_ERROR_ACTION = "PARSE_ERROR"
"""The last action of an episode that ended because no reply of its last step parsed (actors.episode): scores 0.0
on every task, infeasible ones included (it is not FAIL: the agent said nothing we could read)."""
log = logging.getLogger(__name__)

__all__ = ["EvaluationError", "EvalContext", "GETTERS", "METRICS", "SETUP_STEPS", "SetupContext",
           "TaskSetupError", "UPLOAD_MAX_BYTES", "evaluate", "run_setup"]


class EvaluationError(Exception):
    """The evaluator names an unknown getter or metric, a metric cannot run, or returned something that is not
    a score."""


METRICS: dict[str, str] = {**{name: "native" for name in NATIVE_METRICS}, **{
    name: f"osworld:{module}" for name, module in OSWORLD_METRICS.items() if name not in NATIVE_METRICS}}
"""Every metric name we score, -> "native" (ours) or "osworld:<module>" (OSWorld's code, run in the worker)."""


async def _run_metric(name: str, args: list, options: dict) -> Any:
    if METRICS[name] == "native":
        try:
            return await asyncio.to_thread(NATIVE_METRICS[name], *args, **options)
        except MetricOptionError as exc:
            raise EvaluationError(str(exc)) from exc
    try:
        return await call_metric(name, args, options)
    except MetricError as exc:
        if exc.error_type in ("", "MissingLibrary"):
            raise EvaluationError(str(exc)) from exc
        log.info("metric %s raised on the desktop's state, scored 0: %s", name, exc)
        return 0.0
    except MetricEnvError as exc:
        raise EvaluationError(f"metric {name}: the OSWorld metrics environment is unavailable: {exc}") from exc


# --------------------------------------------------------------------------------------------------------
# scoring


@dataclass(frozen=True)
class _Part:
    metric: str
    result: dict | None
    expected: dict | None
    options: dict


def metric_option_problems(task: Task) -> list[str]:
    """The evaluator options our own (native) metrics would refuse: each metric is called as
    ``metric(result, expected, **options)`` (without ``expected`` when the task gives none), so an option its
    signature does not take raises TypeError in every episode. OSWorld's metrics run in the metrics worker and are
    not checked here, nor is an infeasible task (no metric runs). ``arpo tasks check`` reports these as
    ``metric_options``; an empty list means none found. An evaluator naming an unknown metric or getter is one
    problem (the loader refuses those first).
    """
    if task.infeasible:
        return []
    try:
        parts = _parts(task)
    except EvaluationError as exc:
        return [str(exc)]
    problems = []
    for part in parts:
        if METRICS[part.metric] != "native":
            continue
        args = (None, None) if part.expected is not None else (None,)
        try:
            inspect.signature(NATIVE_METRICS[part.metric]).bind(*args, **part.options)
        except TypeError as exc:
            problems.append(f"metric {part.metric!r} with options {sorted(part.options)}: {exc}")
    return problems


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
    try:
        args = [await GETTERS[part.result["type"]](c, part.result, ctx)]  # type: ignore[index]
        if part.expected:
            args.append(await GETTERS[part.expected["type"]](c, part.expected, ctx))
    except GetterError as exc:
        raise EvaluationError(f"getter: {exc}") from exc
    except (KeyError, TypeError) as exc:
        raise EvaluationError(f"getter spec {part.result!r} / {part.expected!r}: {exc!r}") from exc
    score = await _run_metric(part.metric, args, part.options)
    try:
        value = float(score)
    except (TypeError, ValueError) as exc:
        raise EvaluationError(f"metric {part.metric!r} returned {score!r}, not a number") from exc
    if math.isnan(value):
        raise EvaluationError(f"metric {part.metric!r} returned NaN")
    return min(1.0, max(0.0, value))


def _is_fail(last_action: str | None) -> bool:
    return last_action is not None and last_action.strip().upper() == FAIL_ACTION


async def evaluate(controller: ControllerClient, task: Task, last_action: str | None,
                   downloads: DownloadCache | None = None) -> float:
    """Score the episode in [0, 1] from the desktop's state, with OSWorld's semantics (module docstring).

    Args:
        controller: the desktop the episode ran in.
        task: the task (its evaluator is used).
        last_action: the episode's last action ("FAIL" when the agent gave up, e.g. UI-TARS call_user; "DONE"
            when it said finished; :data:`PARSE_ERROR_ACTION` when its last reply did not parse); None when the
            step budget ran out or the episode had no action.
        downloads: where postconfig downloads and cloud_file getters fetch from (default: DownloadCache()).

    Raises EvaluationError (unknown getter/metric, bad metric output), TaskSetupError (postconfig failed),
    DesktopError (desktop unreachable).
    """
    parts = [] if task.infeasible else _parts(task)  # fail fast on unknown names, before postconfig
    downloads = downloads or DownloadCache()
    setup = SetupContext(downloads, task.id, postconfig=True)
    await run_setup(controller, task.evaluator.get("postconfig", []), setup)
    if task.infeasible:
        return 1.0 if _is_fail(last_action) else 0.0
    if _is_fail(last_action) or last_action == PARSE_ERROR_ACTION:
        return 0.0
    conj = task.evaluator.get("conj", "and")
    cache = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="arpo-eval-"))
    try:
        ctx = EvalContext(cache_dir=cache, downloads=downloads, task_id=task.id, outputs=setup.outputs)
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
