"""Task selection: online selection with retirement of solved tasks and revisits (the task pre-pass before
training is learner.algo.prepass).

Owns: which task the next group of G rollouts is for during training, and whether every task is solved. Pure and
seeded; no I/O, no clock.

- :class:`TaskSelector`: during training, keeps each task's last ``window`` complete groups (per group: its
  successful and its trainable rollouts) and retires a task once it is *solved*: at least ``solved_rate`` of
  those groups had every rollout succeed. Such groups have no reward difference: DAPO's dynamic sampling (Yu et
  al. 2025, arXiv:2503.14476, section 3.2) drops them and samples more, as learner.algo.batcher does, so a solved
  task costs desktop time and gives no gradient. Retiring it online is ARPO's task filter (Lu et al. 2025,
  arXiv:2505.16282: its pre-pass sets aside tasks the policy always solves, learner.algo.prepass) applied to
  the policy as it learns. Retired tasks are revisited now and then (every ``revisit_every``-th pick and/or with
  probability ``revisit_prob``): one group, and a revisit that leaves the window no longer solved reactivates the
  task. Otherwise picks go to active tasks by shuffled round-robin or by uncertainty p(1 - p). :attr:`solved`
  says when every task (not set aside) is retired: the learner then ends the run (learner.stop_when_solved).
  "Success" is the evaluator's score above ``success_threshold`` (the actors' Outcome.SUCCESS), never the reward:
  a run whose reward is turned against the task is never solved by missing it.
  A task whose rollouts end in TASK_ERROR ``task_error_limit`` times in a row (its setup,
  getter or metric is broken) is set aside for good: never picked again, named in ``set_aside`` and metrics.

Plugs into :class:`learner.rollouts.scheduler.GroupScheduler` as its task source: the scheduler calls ``pick_task()``
once per new group, and whoever receives complete groups calls ``record_group(task_id, scores)``.

Invariants: a pick never returns a task outside the pool or one set aside; while any task is active, only revisits
return a retired one; with every task retired (:attr:`TaskSelector.solved`), picks cycle through the retired ones
(least recently picked first), so the caller is never left without work while any task is not set aside (a run with
learner.stop_when_solved = false goes on so); with every task set aside a pick raises NoTaskLeft, which stops the
learner. A group with no trainable rollout (all ENV_ERROR or ABORTED) is no evidence and changes no window.
Zero-variance groups still cost no optimizer work: the batcher drops them.
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

_STATE_SCHEMA = 2
"""2: windows of groups ([successes, rollouts] per group); 1 (before issue 49): windows of rollouts, not loaded."""


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
    ABORTED left out): what :meth:`TaskSelector.record_group` and
    :meth:`learner.algo.prepass.TaskPrepass.record_group` take."""
    return [float(t.score) for t in group.trajectories() if t.outcome.trainable]


def _group_result(value: Any) -> tuple[int, int]:
    """A window entry from a state: ``[successes, rollouts]`` with 0 <= successes <= rollouts. Raises ValueError."""
    successes, rollouts = (int(x) for x in value)
    if not 0 <= successes <= rollouts:
        raise ValueError(f"a group of {rollouts} rollouts with {successes} successes")
    return successes, rollouts


class TaskSelector(Generic[T]):
    """Online task selection: retire tasks solved over a window of groups, revisit them now and then.

    Per task, its last ``window`` complete groups are kept, each as (successful rollouts, trainable rollouts); a
    rollout succeeds when its evaluator score is above ``success_threshold``. A group is *all-success* when every
    one of its trainable rollouts succeeded; a task is *solved* when its window is full and at least
    ``solved_rate`` x ``window`` of its groups are all-success.

    - Retire: an active task that is solved is retired (ARPO's filter of always-solved tasks, arXiv:2505.16282,
      applied online; its groups would have no reward difference, which DAPO's dynamic sampling, arXiv:2503.14476,
      drops).
    - Revisit: a pick goes to a retired task when every task is retired, or when ``revisit_every > 0`` and the
      pick's number (1, 2, ...) is a multiple of it, or, when ``revisit_prob > 0``, with that probability. The
      revisited task is the retired one picked least recently (ties: pool order). A revisit group is added to the
      window; when the task is then no longer solved it is reactivated (with ``solved_rate`` 1: any failure
      reactivates it, and it needs ``window`` all-success groups in a row to retire again); else it stays
      retired.
    - Otherwise, among active tasks: ``"round_robin"``: rounds in a seeded shuffled order (``rng.sample`` of
      the active tasks in pool order, taken from the end, as GroupScheduler's own order; a task retired during
      the round is skipped); ``"uncertainty"``: drawn with probability proportional to p(1 - p), where
      p = (successes + 1) / (rollouts + 2) over the window's groups (Laplace's rule, so an untried task has
      p = 1/2 and the largest weight, 1/4, and a task never solved keeps a small weight).

    Defaults: ``window = 4`` groups and ``solved_rate = 1.0``: a task is retired after 4 groups in a row in which
    every rollout succeeded (32 successes in a row at G = 8; a policy at 0.9 success per rollout passes that by
    chance with probability 0.9^32 = 0.03); ``revisit_every = 10`` (one group in ten re-checks a retired task, so
    forgetting is noticed within a few steps).

    Args:
        tasks: the pool (non-empty, unique ids).
        window: complete groups per task in its window (>= 1).
        solved_rate: share of the window's groups that must be all-success for the task to be solved (in (0, 1]).
        retire: False disables retirement (and therefore revisits; the pool is then never solved).
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
        window: int = 4,
        solved_rate: float = 1.0,
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
        if not 0.0 < solved_rate <= 1.0:
            raise TaskSelectionError(f"solved_rate must be in (0, 1], got {solved_rate}")
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
        self.solved_rate = solved_rate
        self.retire = retire
        self.revisit_every = revisit_every
        self.revisit_prob = revisit_prob
        self.strategy = strategy
        self.success_threshold = success_threshold
        self._rng = random.Random(seed)
        self._order: list[str] = []
        self._windows: dict[str, collections.deque[tuple[int, int]]] = {i: collections.deque(maxlen=window)
                                                                         for i in ids}
        """Task id -> its last ``window`` groups, each (successful rollouts, trainable rollouts), oldest first."""
        self._retired: set[str] = set()
        self._frozen = False
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

    def freeze(self) -> None:
        """Stop recording groups: the run has stopped as solved, so groups still in flight (finishing during the
        final evaluation and shutdown) neither reactivate a retired task nor retire one; ``retired`` stays the set
        that stopped the run."""
        self._frozen = True

    @property
    def retired(self) -> list[str]:
        """Ids of retired tasks (not set aside), in pool order."""
        return [i for i in self._ids if i in self._retired and i not in self._set_aside]

    @property
    def set_aside(self) -> list[str]:
        """Ids of tasks set aside after ``task_error_limit`` TASK_ERROR rollouts in a row, in pool order."""
        return [i for i in self._ids if i in self._set_aside]

    @property
    def solved(self) -> bool:
        """Whether every task not set aside is retired (solved over its window): nothing left that gives a reward
        difference. False with retirement off, and when every task is set aside (picks raise NoTaskLeft then)."""
        return len(self._set_aside) < len(self._ids) and not self.active

    def solved_reason(self) -> str:
        """The one line a run that ends as solved says, e.g. ``every task is solved in its last 4 groups: training
        stops (learner.stop_when_solved = false keeps it going)``."""
        needed = math.ceil(self.solved_rate * self.window - 1e-9)
        rate = "" if needed == self.window else f" ({needed} of them with every rollout successful)"
        return (f"every task is solved in its last {self.window} groups{rate}: training stops "
                "(learner.stop_when_solved = false keeps it going)")

    def success_estimate(self, task_id: str) -> float:
        """p = (successes + 1) / (rollouts + 2) over the task's window (1/2 before any result)."""
        groups = self._windows[task_id]
        return (sum(s for s, _ in groups) + 1) / (sum(n for _, n in groups) + 2)

    def is_solved(self, task_id: str) -> bool:
        """Whether ``task_id``'s window is full and at least ``solved_rate`` x ``window`` of its groups had every
        rollout succeed (KeyError for an id not in the pool)."""
        groups = self._windows[task_id]
        all_success = sum(s == n for s, n in groups)
        return len(groups) == self.window and all_success >= self.solved_rate * self.window - 1e-9

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
        """Record a complete group's evaluator scores (trainable rollouts only, :func:`trainable_scores`; never
        rewards) in its task's window; retire the task when it is now solved, reactivate a retired one that no
        longer is. A group with no score changes nothing.

        Returns:
            False (and counts ``unknown_groups``) when ``task_id`` is not in the pool; else True.
        """
        window = self._windows.get(task_id)
        if window is None:
            self._counts["unknown_groups"] += 1
            return False
        if not scores or self._frozen:
            return True
        window.append((sum(is_success(s, self.success_threshold) for s in scores), len(scores)))
        if task_id in self._retired:
            if not self.is_solved(task_id):
                self._retired.discard(task_id)
                self._counts["reactivations"] += 1
        elif self.retire and self.is_solved(task_id):
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
            "windows": {i: [[s, n] for s, n in w] for i, w in self._windows.items() if w},
            "retired": self.retired,
            "last_pick": dict(self._last_pick),
            "counts": dict(self._counts),
            "set_aside": self.set_aside,
            "error_streak": {i: n for i, n in self._error_streak.items() if n},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`. Ids no longer in the pool are ignored; windows longer than this
        selector's ``window`` keep their newest groups; the constructor's parameters are kept. A schema 1 state
        (windows of rollouts, before issue 49) loads without its windows: each task's window fills again.

        Raises:
            TaskSelectionError: unknown schema or a malformed state.
        """
        schema = state.get("schema")
        if schema not in (1, _STATE_SCHEMA):
            raise TaskSelectionError(f"unsupported task selector schema {state.get('schema')!r}")
        try:
            version, internal, gauss_next = state["rng"]
            rng = random.Random()
            rng.setstate((int(version), tuple(int(x) for x in internal), gauss_next))
            windows = {i: collections.deque(maxlen=self.window) for i in self._ids}
            for task_id, groups in state["windows"].items() if schema == _STATE_SCHEMA else ():
                if task_id in windows:
                    windows[task_id].extend(_group_result(g) for g in groups)
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
