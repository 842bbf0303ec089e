"""The task pre-pass (ARPO's "valuable tasks") and the task pool training starts from.

Role: before training, k rollouts of every task with the initial policy (rounded up to whole groups), evaluated
and never trained on; training then uses only the tasks with at least ``learner.prepass_min_success`` successes
(ARPO trains on the 128 of OSWorld's 369 tasks its base agent solved at least once; arXiv 2505.16282, task
selection),
optionally dropping tasks already solved k times out of k (they would only give zero-variance groups).

Owns: :class:`TaskPrepass` (the pass as a task source for the GroupScheduler, and its results), the pure rule
:func:`valuable_tasks`, ``<run>/prepass.json`` (written once the pass is over; a restarted learner reuses it
instead of running the pass again; a run folder from before the rename holds ``baseline.json``, still read), and
:class:`TaskPlan` (made by :func:`plan_tasks`): where the learner's tasks come from as it starts, and
:meth:`TaskPlan.finish_prepass`, which saves a finished pass and switches the plan to the tasks it kept. The run
(learner.run.run_prepass) drives the pass through the learner service; nothing here calls the service.

Invariants: the pass's groups are never trained on (the service routes them to the pass); a run that trained
without a pass never starts one on resume; when no task qualifies the learner stops with an error that lists the
results.
"""

from __future__ import annotations

import collections
import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from arpo_async.config import LearnerConfig
from arpo_async.success import DEFAULT_SUCCESS_THRESHOLD, is_success
from arpo_async.tasks import Task
from learner.algo.task_selection import TaskSelectionError, TaskSelector, check_pool, task_id_of

log = logging.getLogger(__name__)

T = TypeVar("T")

class PrepassExhausted(LookupError):
    """:meth:`TaskPrepass.pick_task` was called after every planned group had been handed out."""


def prepass_plan(tasks: Sequence[T], k: int) -> list[tuple[T, int]]:
    """the task pre-pass: ``(task, k)`` for every task, in pool order: run k rollouts of each with the initial policy.

    Args:
        tasks: the candidate pool (objects with an ``id``), non-empty, unique ids.
        k: rollouts per task (>= 1; ARPO's procedure is reported second hand, without its k).

    Raises:
        TaskSelectionError: empty pool, duplicate ids, or k < 1.
    """
    check_pool(tasks, task_id_of)
    if k < 1:
        raise TaskSelectionError(f"k must be >= 1, got {k}")
    return [(task, k) for task in tasks]


def valuable_tasks(
    results: Mapping[str, Sequence[float]],
    min_success: int = 1,
    *,
    drop_solved: bool = False,
    success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
) -> list[str]:
    """ARPO's valuable tasks: the ids whose pre-pass results hold at least ``min_success`` successes.

    A result is a success when its evaluator score is above ``success_threshold``
    (:func:`arpo_async.success.is_success`). A task with no result (every rollout of it failed to run) is
    dropped: nothing shows it can be solved.

    Args:
        results: task id -> evaluator scores of its pre-pass rollouts (trainable outcomes only).
        min_success: successes needed to keep a task (>= 1; ARPO: 1).
        drop_solved: also drop tasks solved in every one of their rollouts (k out of k).
        success_threshold: a rollout scored above this is a success (``learner.success_threshold``).

    Returns:
        The kept ids, in the order of ``results``.

    Raises:
        TaskSelectionError: ``min_success`` < 1 or a score is not finite.
    """
    if min_success < 1:
        raise TaskSelectionError(f"min_success must be >= 1, got {min_success}")
    kept: list[str] = []
    for task_id, scores in results.items():
        if not all(math.isfinite(float(s)) for s in scores):
            raise TaskSelectionError(f"task {task_id!r}: non-finite score in {list(scores)}")
        successes = sum(is_success(s, success_threshold) for s in scores)
        if successes < min_success:
            continue
        if drop_solved and successes == len(scores):
            continue
        kept.append(task_id)
    return kept


class TaskPrepass(Generic[T]):
    """the task pre-pass as a task source for the GroupScheduler: ``ceil(k / group_size)`` groups per task.

    Hand it to the scheduler as ``pick_task``; stop handing out new groups once :attr:`exhausted`; feed every
    complete group to :meth:`record_group`; when :attr:`done`, :meth:`valuable` gives the tasks to train on.

    Args:
        tasks: the candidate pool (non-empty, unique ids).
        k: rollouts per task (>= 1); rounded up to whole groups.
        group_size: G.
        task_id: a task's id (default: its ``id`` attribute).

    Raises:
        TaskSelectionError: empty pool, duplicate ids, k < 1 or group_size < 1.
    """

    def __init__(self, tasks: Sequence[T], k: int, group_size: int, *,
                 task_id: Callable[[T], str] = task_id_of) -> None:
        if group_size < 1:
            raise TaskSelectionError(f"group_size must be >= 1, got {group_size}")
        self._ids = check_pool(tasks, task_id)
        if k < 1:
            raise TaskSelectionError(f"k must be >= 1, got {k}")
        groups = -(-k // group_size)
        self._plan: collections.deque[T] = collections.deque(t for _ in range(groups) for t in tasks)
        self._expected = groups * len(tasks)
        self._recorded = 0
        self.results: dict[str, list[float]] = {i: [] for i in self._ids}
        """Task id -> scores recorded so far."""

    @property
    def planned_groups(self) -> int:
        """Groups the pass hands out in all: ``ceil(k / group_size)`` per task."""
        return self._expected

    @property
    def recorded_groups(self) -> int:
        """Groups recorded so far."""
        return self._recorded

    @property
    def exhausted(self) -> bool:
        """Every planned group has been handed out."""
        return not self._plan

    @property
    def done(self) -> bool:
        """Every planned group has been recorded."""
        return self._recorded >= self._expected

    def pick_task(self) -> T:
        """The task of the next pre-pass group (pool order, one round per group of each task).

        Raises:
            PrepassExhausted: every planned group was already handed out.
        """
        if not self._plan:
            raise PrepassExhausted("the task pre-pass has handed out all its groups")
        return self._plan.popleft()

    def record_group(self, task_id: str, scores: Sequence[float]) -> bool:
        """Record a complete group's evaluator scores (trainable rollouts only). False for an unknown task."""
        if task_id not in self.results:
            return False
        self.results[task_id].extend(float(s) for s in scores)
        self._recorded += 1
        return True

    def valuable(self, min_success: int = 1, *, drop_solved: bool = False,
                 success_threshold: float = DEFAULT_SUCCESS_THRESHOLD) -> list[str]:
        """:func:`valuable_tasks` of the results so far."""
        return valuable_tasks(self.results, min_success, drop_solved=drop_solved,
                              success_threshold=success_threshold)


PREPASS_FILE = "prepass.json"
"""The task pre-pass's results in the run folder: {"k", "results": {task id: scores}, "valuable": [ids]}."""
OLD_PREPASS_FILE = "baseline.json"
"""The same file in a run folder written when the pass was called the "baseline pass" (before issue 52): such a
run resumes from it (:func:`prepass_path`); nothing writes it any more."""


def prepass_path(run: Path) -> Path:
    """Where the task pre-pass's results of the run folder ``run`` are: ``<run>/prepass.json``, or
    ``<run>/baseline.json`` when only that exists (an older run being resumed)."""
    path, old = run / PREPASS_FILE, run / OLD_PREPASS_FILE
    return old if old.exists() and not path.exists() else path


def plan_prepass(tasks: list[Task], lc: LearnerConfig, path: Path, *, resuming: bool) -> TaskPrepass | None:
    """The task pre-pass to run before training, or None: when ``prepass_k`` is 0, when ``path`` holds a
    finished pass of this run (a restart reuses it), or when resuming a run that trained without one."""
    if not lc.prepass_k or path.exists():
        return None
    if resuming:
        log.warning("learner.prepass_k=%d but this run already trained without a task pre-pass; not running one",
                    lc.prepass_k)
        return None
    return TaskPrepass(tasks, lc.prepass_k, lc.group_size)


def save_prepass(path: Path, prepass: TaskPrepass, lc: LearnerConfig) -> list[str]:
    """Write the finished task pre-pass to ``path`` (atomically) and return the valuable task ids.

    Raises:
        ValueError: no task met ``prepass_min_success`` (nothing to train on; the message lists the results).
    """
    results = prepass.results
    kept = prepass.valuable(lc.prepass_min_success, drop_solved=lc.prepass_drop_solved,
                             success_threshold=lc.success_threshold)
    summary = {task_id: f"{sum(is_success(s, lc.success_threshold) for s in scores)}/{len(scores)}"
               for task_id, scores in results.items()}
    if not kept:
        raise ValueError(f"the task pre-pass found no task with >= {lc.prepass_min_success} successes in "
                         f"{lc.prepass_k} rollouts (successes per task: {summary}); lower "
                         "learner.prepass_min_success or set learner.prepass_k=0")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"k": lc.prepass_k, "results": results, "valuable": kept}, indent=1))
    tmp.replace(path)
    log.info("task pre-pass: kept %d of %d tasks (successes per task: %s)", len(kept), len(results), summary)
    return kept


def load_prepass(path: Path) -> list[str]:
    """The valuable task ids of a finished task pre-pass saved by :func:`save_prepass`.

    Raises:
        ValueError: the file is not JSON or has no non-empty list of ids under "valuable" (names the file).
    """
    try:
        kept = json.loads(path.read_text())["valuable"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a task pre-pass result ({type(exc).__name__}: {exc}); remove it to run "
                         "the pass again") from exc
    if not isinstance(kept, list) or not kept or not all(isinstance(i, str) for i in kept):
        raise ValueError(f"{path}: \"valuable\" must be a non-empty list of task ids, got {kept!r}; remove it "
                         "to run the pass again")
    return kept


def valuable_pool(tasks: list[Task], kept: list[str]) -> list[Task]:
    """The tasks of ``tasks`` whose ids are in ``kept`` (pool order).

    Raises:
        ValueError: none of them is in the pool (a prepass.json from another task set).
    """
    pool = [t for t in tasks if t.id in set(kept)]
    if not pool:
        raise ValueError(f"none of the task pre-pass's valuable tasks {kept} is in the task pool; remove "
                         f"{PREPASS_FILE} (or {OLD_PREPASS_FILE}, from an older run) from the run folder to run the "
                         "pass again")
    return pool


def task_selector(tasks: list[Task], lc: LearnerConfig) -> TaskSelector:
    """The online task selector over ``tasks`` with the configured window, retirement and revisits."""
    return TaskSelector(tasks, window=lc.task_solved_groups, solved_rate=lc.task_solved_rate, retire=lc.task_retire,
                        revisit_every=lc.task_revisit_every,
                        revisit_prob=lc.task_revisit_prob, strategy=lc.task_strategy, seed=lc.seed,
                        task_error_limit=lc.task_error_limit, success_threshold=lc.success_threshold)


def training_pool(tasks: list[Task], lc: LearnerConfig, path: Path) -> list[Task]:
    """The tasks training uses when no pass runs now: the valuable ones of a finished pass saved at ``path``
    (with ``learner.prepass_k`` set), else all of ``tasks``.

    Raises:
        ValueError: ``path`` is malformed or names no task of the pool (see :func:`load_prepass`).
    """
    if lc.prepass_k and path.exists():
        return valuable_pool(tasks, load_prepass(path))
    return tasks


@dataclass
class TaskPlan:
    """Where the learner's tasks come from as it starts: a task pre-pass over every task first (``prepass`` set,
    ``selector`` None until the pass is over), or training at once on ``pool`` with ``selector``.

    Attributes:
        tasks: every candidate task (learner.tasks / task_ids).
        pool: the tasks the scheduler starts with: all of them for a pass, else the valuable ones of a finished
            pass (a restart) or all of them (no pass).
        prepass: the pass to run before training, or None.
        selector: the online task selector over ``pool``, or None while a pass is due.
        path: <run>/prepass.json (<run>/baseline.json in an older run that has only that; :func:`prepass_path`).
    """

    tasks: list[Task]
    pool: list[Task]
    prepass: TaskPrepass | None
    selector: TaskSelector | None
    path: Path

    @property
    def pick_task(self) -> Callable[[], Task]:
        """The scheduler's task source now: the pass's while one is due, else the selector's."""
        return (self.prepass or self.selector).pick_task

    def finish_prepass(self, lc: LearnerConfig) -> TaskSelector:
        """The pre-pass came back in full: save it to ``path``, switch the plan to training on the tasks it kept
        (``pool``, ``selector``) and return the selector (the run hands it to the service, learner.run.run_prepass).

        Raises:
            ValueError: no task met ``learner.prepass_min_success`` (see :func:`save_prepass`).
        """
        if self.prepass is None:
            raise RuntimeError("finish_prepass without a pre-pass")
        kept = save_prepass(self.path, self.prepass, lc)
        self.pool = valuable_pool(self.tasks, kept)
        self.selector = task_selector(self.pool, lc)
        return self.selector


def plan_tasks(tasks: list[Task], lc: LearnerConfig, run: Path, *, resuming: bool) -> TaskPlan:
    """The learner's :class:`TaskPlan` for the run folder ``run`` (``resuming``: it holds a checkpoint).

    Raises:
        ValueError: a finished pass's <run>/prepass.json (or an older run's baseline.json) is malformed or names
            no task of ``tasks``.
    """
    path = prepass_path(run)
    prepass = plan_prepass(tasks, lc, path, resuming=resuming)
    if prepass is not None:
        return TaskPlan(tasks, tasks, prepass, None, path)
    pool = training_pool(tasks, lc, path)
    return TaskPlan(tasks, pool, None, task_selector(pool, lc), path)
