"""Advantage functions: the one seam for another advantage rule.

Role: turns a group's rewards into per-trajectory advantages (the algorithm's "advantages" stage,
learner.algo.batcher.Batcher.advantages). GRPO's group-relative rule is the default; ``learner.advantage_function``
names another as ``"package.module:function"``, imported when the learner starts, the way slime's
``--custom-advantage-function-path`` does (github.com/THUDM/slime, slime/utils/arguments.py).

A custom function has the signature of :class:`AdvantageFunction`. It is called once per scored group, after the
replay stage (so an injected success is among the rewards) and only for a group whose rewards vary (a group with
zero reward variance is dropped first: it carries no gradient under any group-relative rule). It must return one
finite float per trajectory; anything else, or an exception it raises, stops the learner with an
:class:`AdvantageFunctionError` naming the function and the task (a rule that fails once fails for every group).
"""

from __future__ import annotations

import importlib
from typing import Protocol

import numpy as np

from learner.algo.grpo import group_advantages


class AdvantageFunctionError(ValueError):
    """The advantage function returned something other than one finite float per trajectory (the learner stops:
    every later group would fail the same way)."""


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


def checked_advantages(function: AdvantageFunction, rewards: np.ndarray, task_id: str) -> list[float]:
    """``function(rewards, task_id)`` as a list of floats, checked.

    Raises:
        AdvantageFunctionError: the function raised, or its result is not one finite number per reward (names the
            function and the task; the function's own error is chained).
    """
    try:
        values = np.asarray(function(rewards, task_id), dtype=np.float64)
    except Exception as error:  # noqa: BLE001 - whatever a user's function raises stops the learner, named
        raise AdvantageFunctionError(f"advantage function {getattr(function, '__name__', function)!r} failed or "
                                     f"returned no numbers for task {task_id!r}: {type(error).__name__}: "
                                     f"{error}") from error
    if values.shape != rewards.shape or not np.isfinite(values).all():
        raise AdvantageFunctionError(f"advantage function {getattr(function, '__name__', function)!r} must return "
                                     f"{rewards.shape[0]} finite floats for task {task_id!r}, got {values.tolist()!r}")
    return values.tolist()
