"""Advantage functions: the one seam for another advantage rule.

Role: turns a group's rewards into per-trajectory advantages (the algorithm's "advantages" stage,
learner.algo.batcher.Batcher.advantages). GRPO's group-relative rule is the default; ``learner.advantage_function``
names another as ``"package.module:function"``, imported when the learner starts, the way slime's
``--custom-advantage-function-path`` does (github.com/THUDM/slime, slime/utils/arguments.py).

Trusted code: the path is imported and called in the learner process with the learner's rights, as slime's
``--custom-*-path`` functions are. Whoever writes the run file (or passes ``--set``) runs code in the learner; any
importable callable loads (``os:system`` too). Nothing here sandboxes it: the checks below stop a function that is
wrong, not one that is hostile.

A custom function has the signature of :class:`AdvantageFunction`. It is called once per scored group, after the
replay stage (so an injected success is among the rewards) and only for a group whose rewards vary (a group with
zero reward variance is dropped first: it carries no gradient under any group-relative rule). It gets a copy of the
rewards (changing them in place changes nothing of the learner's) and runs in a thread of its own, off the event
loop (:func:`advantages_off_loop`), for at most :data:`ADVANTAGE_TIMEOUT_S`. It must return one real number per
trajectory (ints or floats; not bools, strings or objects), each finite and at most :data:`ADVANTAGE_BOUND` in
magnitude; anything else, a deadline passed, or an exception it raises, stops the learner with an
:class:`AdvantageFunctionError` naming the function and the task (a rule that fails once fails for every group).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import threading
from typing import Protocol

import numpy as np

from learner.algo.grpo import group_advantages


ADVANTAGE_BOUND = 1e6
"""The largest advantage magnitude taken from a custom function. GRPO's are below sqrt(G) (at most 8 for G = 64); a
value beyond this is a bug, and 1e308 would overflow the loss to inf."""

ADVANTAGE_TIMEOUT_S = 60.0
"""The longest one call of a custom advantage function may take (seconds) before the learner stops, naming it; a
rule over G numbers takes microseconds."""


class AdvantageFunctionError(ValueError):
    """The advantage function raised, passed its deadline, or returned something other than one finite real number
    of magnitude at most ADVANTAGE_BOUND per trajectory (the learner stops: every later group would fail alike)."""


class AdvantageFunction(Protocol):
    """``(rewards, task_id) -> advantages``: ``rewards`` a float64 array of shape (G,), one per trajectory of the
    group in order; returns an array-like of shape (G,) of finite floats, the advantage every token of that
    trajectory is trained with (learner.train.trainer)."""

    def __call__(self, rewards: np.ndarray, task_id: str) -> np.ndarray: ...


def grpo_advantages(rewards: np.ndarray, task_id: str) -> np.ndarray:
    """GRPO's rule (DeepSeekMath, arXiv 2402.03300, section 4.1.2): ``(r - mean(r)) / (std(r) + eps)`` over the
    group (learner.algo.grpo.group_advantages); ``task_id`` plays no part."""
    return group_advantages(rewards)


def load_advantage_function(path: str) -> AdvantageFunction:
    """The function ``path`` names: ``""`` is :func:`grpo_advantages`, else ``"package.module:function"``.

    Raises:
        ValueError: ``path`` is not of the form ``module:function``, the module does not import (its error is
            included), or the attribute is missing or not callable.
    """
    if not path:
        return grpo_advantages
    module_name, _, name = path.partition(":")
    if not module_name or not name:
        raise ValueError(f"learner.advantage_function must be 'package.module:function', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - any import failure is the user's module's, reported as such
        raise ValueError(f"learner.advantage_function {path!r}: module {module_name!r} does not import: "
                         f"{type(error).__name__}: {error}") from error
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"learner.advantage_function {path!r}: {module_name!r} has no callable {name!r}")
    return function


def _name(function: AdvantageFunction) -> str:
    return getattr(function, "__qualname__", None) or repr(function)[:100]


def _checked(function: AdvantageFunction, values: np.ndarray, rewards: np.ndarray, task_id: str) -> list[float]:
    """``values`` (the function's result, as an array) as a list of floats, checked: real numbers (dtype kind
    i, u or f), one per reward, finite, magnitude at most ADVANTAGE_BOUND. Raises AdvantageFunctionError."""
    shown = repr(values.tolist())[:200]
    if values.dtype.kind not in "iuf":
        raise AdvantageFunctionError(f"advantage function {_name(function)!r} returned {values.dtype} values, not "
                                     f"numbers, for task {task_id!r}: {shown}")
    if values.shape != rewards.shape:
        raise AdvantageFunctionError(f"advantage function {_name(function)!r} must return {rewards.shape[0]} finite "
                                     f"floats for task {task_id!r}, got shape {values.shape}: {shown}")
    values = values.astype(np.float64)
    if not np.isfinite(values).all() or (np.abs(values) > ADVANTAGE_BOUND).any():
        raise AdvantageFunctionError(f"advantage function {_name(function)!r} must return {rewards.shape[0]} finite "
                                     f"floats of magnitude at most {ADVANTAGE_BOUND:g} for task {task_id!r}, got "
                                     f"{shown}")
    return values.tolist()


def _failed(function: AdvantageFunction, task_id: str, error: BaseException) -> AdvantageFunctionError:
    return AdvantageFunctionError(f"advantage function {_name(function)!r} failed or returned no numbers for task "
                                  f"{task_id!r}: {type(error).__name__}: {str(error)[:300]}")


def checked_advantages(function: AdvantageFunction, rewards: np.ndarray, task_id: str) -> list[float]:
    """``function(copy of rewards, task_id)`` called in this thread, as a list of floats, checked (see the module
    docstring). The training loop calls :func:`advantages_off_loop` instead.

    Raises:
        AdvantageFunctionError: the function raised, or its result is not one finite real number per reward of
            magnitude at most ADVANTAGE_BOUND (names the function and the task; its own error is chained).
    """
    try:
        values = np.asarray(function(rewards.copy(), task_id))
    except Exception as error:  # noqa: BLE001 - whatever a user's function raises stops the learner, named
        raise _failed(function, task_id, error) from error
    return _checked(function, values, rewards, task_id)


async def advantages_off_loop(function: AdvantageFunction, rewards: np.ndarray, task_id: str, *,
                              timeout_s: float = ADVANTAGE_TIMEOUT_S) -> list[float]:
    """:func:`checked_advantages` with the call off the event loop: :func:`grpo_advantages` (ours, microseconds)
    runs inline; a custom function runs, with its result's conversion to an array, in a daemon thread of its own
    (not ``asyncio.to_thread``: a call that never returns must not hold the executor, nor the process at exit),
    for at most ``timeout_s`` seconds. Past the deadline the thread is left to finish (a thread cannot be stopped)
    and its result is ignored.

    Raises:
        AdvantageFunctionError: as :func:`checked_advantages` (whatever the function raised, SystemExit included),
            or the deadline passed (names the function, the task and the deadline).
    """
    if function is grpo_advantages:
        return checked_advantages(function, rewards, task_id)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[np.ndarray] = loop.create_future()

    def settle(value: np.ndarray | None, error: AdvantageFunctionError | None) -> None:
        if not done.done():
            done.set_exception(error) if error is not None else done.set_result(value)

    def call(copy: np.ndarray) -> None:
        value, error = None, None
        try:
            value = np.asarray(function(copy, task_id))
        except BaseException as raised:  # noqa: BLE001 - SystemExit too: reported to the loop, which stops the learner
            error = _failed(function, task_id, raised)
            error.__cause__ = raised
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits for it any more
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=call, args=(rewards.copy(),), name="advantage-function", daemon=True).start()
    try:
        async with asyncio.timeout(timeout_s):
            values = await done
    except TimeoutError:
        raise AdvantageFunctionError(f"advantage function {_name(function)!r} did not return within {timeout_s:g} s "
                                     f"for task {task_id!r} (learner.algo.advantages.ADVANTAGE_TIMEOUT_S)") from None
    return _checked(function, values, rewards, task_id)
