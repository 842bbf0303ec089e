"""Task selection: online selection with retirement and revisits (the baseline pass before training is
learner.algo.baseline).

Owns: which task the next group of G rollouts is for during training. Pure and seeded; no I/O, no clock.

- :class:`TaskSelector`: during training, keeps each task's last ``window`` rollout outcomes, retires a task
  once all of them are successes (its groups would be zero-variance: no gradient, only desktop time), revisits
  retired tasks now and then (every ``revisit_every``-th pick and/or with probability ``revisit_prob``) and
  reactivates one as soon as a revisit fails; otherwise picks among active tasks by shuffled round-robin or by
  uncertainty p(1 - p). A task whose rollouts end in TASK_ERROR ``task_error_limit`` times in a row (its setup,
  getter or metric is broken) is set aside for good: never picked again, named in ``set_aside`` and metrics.

Plugs into :class:`learner.rollouts.scheduler.GroupScheduler` as its task source: the scheduler calls ``pick_task()``
once per new group, and whoever receives complete groups calls ``record_group(task_id, scores)``.

Invariants: a pick never returns a task outside the pool or one set aside; while any task is active, only revisits
return a retired one; with every task retired, picks cycle through the retired ones (least recently picked first),
so the caller is never left without work while any task is not set aside; with every task set aside a pick raises
NoTaskLeft, which stops the learner. Zero-variance groups still cost no optimizer work: the batcher drops them.
"""

from __future__ import annotations

import collections
import math
import random
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from arpo_async.success import DEFAULT_SUCCESS_THRESHOLD, is_success

__all__ = [
    "SELECTION_STRATEGIES",
    "NoTaskLeft",
    "TaskSelectionError",
    "TaskSelector",
    "check_pool",
    "trainable_scores",
]

T = TypeVar("T")

SELECTION_STRATEGIES: tuple[str, ...] = ("round_robin", "uncertainty")
"""Strategies of :class:`TaskSelector` among active tasks."""

_STATE_SCHEMA = 1


class TaskSelectionError(ValueError):
    """Bad arguments (empty pool, duplicate ids, out-of-range parameters) or a state that cannot be loaded."""


class NoTaskLeft(TaskSelectionError):
    """Every task of the pool has been set aside after task errors: nothing is left to train on."""


def task_id_of(task: Any) -> str:
    """A task's id: its ``id`` attribute, as a string."""
    return str(task.id)


def check_pool(tasks: Sequence[T], task_id: Callable[[T], str]) -> list[str]:
    """The ids of ``tasks``. Raises TaskSelectionError for an empty pool or duplicate ids."""
    if not tasks:
        raise TaskSelectionError("the task pool is empty")
    ids = [task_id(t) for t in tasks]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise TaskSelectionError(f"duplicate task ids in the pool: {duplicates}")
    return ids


def trainable_scores(group: Any) -> list[float]:
    """Evaluator scores of a complete :class:`learner.rollouts.scheduler.Group`'s trainable trajectories (ENV_ERROR and
    ABORTED left out): what :meth:`TaskSelector.record_group` and :meth:`BaselinePass.record_group` take."""
    return [float(t.score) for t in group.trajectories() if t.outcome.trainable]


class TaskSelector(Generic[T]):
    """Online task selection: retire tasks solved every time over a window, revisit them now and then.

    Per task, the outcomes of its last ``window`` rollouts are kept (success: score > ``success_threshold``).

    - Retire: an active task whose window is full and all successes is retired.
    - Revisit: a pick goes to a retired task when every task is retired, or when ``revisit_every > 0`` and the
      pick's number (1, 2, ...) is a multiple of it, or, when ``revisit_prob > 0``, with that probability. The
      revisited task is the retired one picked least recently (ties: pool order). A revisit group with any
      failure reactivates the task (its window then holds that failure, so it needs ``window`` successes in a
      row to retire again); an all-success revisit keeps it retired.
    - Otherwise, among active tasks: ``"round_robin"``: rounds in a seeded shuffled order (``rng.sample`` of
      the active tasks in pool order, taken from the end, as GroupScheduler's own order; a task retired during
      the round is skipped); ``"uncertainty"``: drawn with probability proportional to p(1 - p), where
      p = (successes + 1) / (results + 2) over the window (Laplace's rule, so an untried task has p = 1/2 and
      the largest weight, 1/4, and a task never solved keeps a small weight).

    Defaults: ``window = 8`` (two groups of 4: a task is retired after 8 successes in a row), ``revisit_every =
    10`` (one group in ten re-checks a retired task, so forgetting is noticed within a few steps).

    Args:
        tasks: the pool (non-empty, unique ids).
        window: rollouts per task in the success window (>= 1).
        retire: False disables retirement (and therefore revisits).
        revisit_every: revisit period in picks (0 = never by count).
        revisit_prob: revisit probability per pick (0 = never by chance).
        strategy: one of :data:`SELECTION_STRATEGIES`.
        success_threshold: a rollout scored above this is a success (:func:`arpo_async.success.is_success`).
        seed: RNG seed (the RNG state is part of :meth:`state_dict`).
        task_id: a task's id (default: its ``id`` attribute).
        task_error_limit: TASK_ERROR rollouts in a row (:meth:`record_rollout`) after which a task is set aside
            (0 = never).

    Raises:
        TaskSelectionError: a parameter out of range, an empty pool or duplicate ids.
    """

    def __init__(
        self,
        tasks: Sequence[T],
        *,
        window: int = 8,
        retire: bool = True,
        revisit_every: int = 10,
        revisit_prob: float = 0.0,
        strategy: str = "round_robin",
        success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
        seed: int = 0,
        task_id: Callable[[T], str] = task_id_of,
        task_error_limit: int = 3,
    ) -> None:
        ids = check_pool(tasks, task_id)
        if task_error_limit < 0:
            raise TaskSelectionError(f"task_error_limit must be >= 0, got {task_error_limit}")
        if window < 1:
            raise TaskSelectionError(f"window must be >= 1, got {window}")
        if revisit_every < 0:
            raise TaskSelectionError(f"revisit_every must be >= 0, got {revisit_every}")
        if not 0.0 <= revisit_prob <= 1.0:
            raise TaskSelectionError(f"revisit_prob must be in [0, 1], got {revisit_prob}")
        if strategy not in SELECTION_STRATEGIES:
            raise TaskSelectionError(f"strategy must be one of {SELECTION_STRATEGIES}, got {strategy!r}")
        if not math.isfinite(success_threshold):
            raise TaskSelectionError(f"success_threshold must be finite, got {success_threshold}")
        self._tasks = list(tasks)
        self._ids = ids
        self._by_id = dict(zip(ids, self._tasks))
        self.window = window
        self.retire = retire
        self.revisit_every = revisit_every
        self.revisit_prob = revisit_prob
        self.strategy = strategy
        self.success_threshold = success_threshold
        self._rng = random.Random(seed)
        self._order: list[str] = []
        self._windows: dict[str, collections.deque[bool]] = {i: collections.deque(maxlen=window) for i in ids}
        self._retired: set[str] = set()
        self._last_pick: dict[str, int] = {}
        self._counts: collections.Counter[str] = collections.Counter()
        self.task_error_limit = task_error_limit
        self._error_streak: collections.Counter[str] = collections.Counter()
        self._set_aside: set[str] = set()

    # ------------------------------------------------------------------ queries

    @property
    def active(self) -> list[str]:
        """Ids of active (neither retired nor set aside) tasks, in pool order."""
        return [i for i in self._ids if i not in self._retired and i not in self._set_aside]

    @property
    def retired(self) -> list[str]:
        """Ids of retired tasks (not set aside), in pool order."""
        return [i for i in self._ids if i in self._retired and i not in self._set_aside]

    @property
    def set_aside(self) -> list[str]:
        """Ids of tasks set aside after ``task_error_limit`` TASK_ERROR rollouts in a row, in pool order."""
        return [i for i in self._ids if i in self._set_aside]

    def success_estimate(self, task_id: str) -> float:
        """p = (successes + 1) / (results + 2) over the task's window (1/2 before any result)."""
        results = self._windows[task_id]
        return (sum(results) + 1) / (len(results) + 2)

    def stats(self) -> dict[str, Any]:
        """``{"active", "retired", "picks", "revisits", "retirements", "reactivations", "unknown_groups"}`` (counts)
        and ``"set_aside"`` (the ids set aside, a list)."""
        return {"active": len(self.active), "retired": len(self.retired),
                **{k: self._counts[k] for k in ("picks", "revisits", "retirements", "reactivations",
                                                "unknown_groups")}, "set_aside": self.set_aside}

    # ------------------------------------------------------------------ picking

    def pick_task(self) -> T:
        """The task for the next group (see the class docstring for the rule).

        Raises:
            NoTaskLeft: every task has been set aside.
        """
        if len(self._set_aside) == len(self._ids):
            raise NoTaskLeft(f"every task has been set aside after {self.task_error_limit} TASK_ERROR rollouts in "
                             f"a row ({', '.join(self._ids)[:300]}); fix the task files (see the trajectories' "
                             "errors in actors.log, or `arpo tasks check`)")
        self._counts["picks"] += 1
        pick = self._counts["picks"]
        active = self.active
        if self.retired and self._revisit_now(pick, active):
            chosen = min(self.retired, key=lambda i: self._last_pick.get(i, 0))  # min() keeps pool order on ties
            self._counts["revisits"] += 1
        elif self.strategy == "round_robin":
            chosen = self._next_round_robin(active)
        else:
            chosen = self._draw_uncertain(active)
        self._last_pick[chosen] = pick
        return self._by_id[chosen]

    def _revisit_now(self, pick: int, active: list[str]) -> bool:
        if not active:
            return True
        if self.revisit_every and pick % self.revisit_every == 0:
            return True
        return self.revisit_prob > 0 and self._rng.random() < self.revisit_prob

    def _next_round_robin(self, active: list[str]) -> str:
        while True:
            if not self._order:
                self._order = self._rng.sample(active, len(active))
            candidate = self._order.pop()
            if candidate not in self._retired and candidate not in self._set_aside:
                return candidate

    def _draw_uncertain(self, active: list[str]) -> str:
        weights = [p * (1 - p) for p in (self.success_estimate(i) for i in active)]
        u = self._rng.random() * math.fsum(weights)
        cumulative = 0.0
        for task_id, weight in zip(active, weights):
            cumulative += weight
            if u < cumulative:
                return task_id
        return active[-1]

    # ------------------------------------------------------------------ results

    def record_group(self, task_id: str, scores: Sequence[float]) -> bool:
        """Record a complete group's evaluator scores (trainable rollouts only); retire or reactivate its task.

        Returns:
            False (and counts ``unknown_groups``) when ``task_id`` is not in the pool; else True.
        """
        window = self._windows.get(task_id)
        if window is None:
            self._counts["unknown_groups"] += 1
            return False
        successes = [is_success(s, self.success_threshold) for s in scores]
        window.extend(successes)
        if task_id in self._retired:
            if not all(successes):
                self._retired.discard(task_id)
                self._counts["reactivations"] += 1
        elif self.retire and len(window) == self.window and all(window):
            self._retired.add(task_id)
            self._counts["retirements"] += 1
        return True

    def record_rollout(self, task_id: str, task_error: bool) -> bool:
        """Record whether one rollout of ``task_id`` ended in TASK_ERROR; set the task aside once
        ``task_error_limit`` did in a row (any other outcome starts the count again). Returns True when this
        call set it aside."""
        if task_id not in self._windows or task_id in self._set_aside:
            return False
        self._error_streak[task_id] = self._error_streak[task_id] + 1 if task_error else 0
        if not self.task_error_limit or self._error_streak[task_id] < self.task_error_limit:
            return False
        self._set_aside.add(task_id)
        self._order = [i for i in self._order if i != task_id]
        return True

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Windows, retired set, round-robin order, pick history, counters and RNG as plain (msgpack-friendly) data."""
        version, internal, gauss_next = self._rng.getstate()
        return {
            "schema": _STATE_SCHEMA,
            "rng": [version, list(internal), gauss_next],
            "order": list(self._order),
            "windows": {i: [int(x) for x in w] for i, w in self._windows.items() if w},
            "retired": self.retired,
            "last_pick": dict(self._last_pick),
            "counts": dict(self._counts),
            "set_aside": self.set_aside,
            "error_streak": {i: n for i, n in self._error_streak.items() if n},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`. Ids no longer in the pool are ignored; windows longer than this
        selector's ``window`` keep their newest results; the constructor's parameters are kept.

        Raises:
            TaskSelectionError: unknown schema or a malformed state.
        """
        if state.get("schema") != _STATE_SCHEMA:
            raise TaskSelectionError(f"unsupported task selector schema {state.get('schema')!r}")
        try:
            version, internal, gauss_next = state["rng"]
            rng = random.Random()
            rng.setstate((int(version), tuple(int(x) for x in internal), gauss_next))
            windows = {i: collections.deque(maxlen=self.window) for i in self._ids}
            for task_id, results in state["windows"].items():
                if task_id in windows:
                    windows[task_id].extend(bool(x) for x in results)
            retired = {str(i) for i in state["retired"] if i in windows}
            order = [str(i) for i in state["order"] if i in windows]
            last_pick = {str(i): int(n) for i, n in state["last_pick"].items() if i in windows}
            counts = collections.Counter({str(k): int(v) for k, v in state["counts"].items()})
            set_aside = {str(i) for i in state.get("set_aside", []) if i in windows}  # absent before TASK_ERROR
            streak = collections.Counter({str(i): int(n) for i, n in state.get("error_streak", {}).items()
                                          if i in windows})
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise TaskSelectionError(f"malformed task selector state: {type(error).__name__}: {error}") from error
        self._rng, self._windows, self._retired, self._order = rng, windows, retired, order
        self._last_pick, self._counts = last_pick, counts
        self._set_aside, self._error_streak = set_aside, streak
