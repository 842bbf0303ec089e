"""Task scheduler: hands out rollouts in groups of G and collects them back into complete groups.

Owns: open groups, their handed-out rollouts (with deadlines) and their results.
Invariants: a group has exactly G rollout slots; a slot's result is the first trainable trajectory for it,
or its last non-trainable one once ``max_retries`` re-issues are spent; a group is complete when every slot
has a result. Rollouts whose trajectory never arrives before the deadline are re-issued like ENV_ERROR ones.
Tasks are visited in a shuffled round-robin order (seeded), one group per visit.

Group budget: with ``group_budget=None`` (the async schedule) new groups open whenever a rollout is asked for;
with a number (the lockstep schedule) at most that many new groups open until :meth:`add_group_budget` adds
more, while re-issues of the open groups' slots are always handed out. Group ids start with ``id_prefix`` (the
learner's id), so a restarted learner never mistakes a trajectory of its predecessor's group for one of its own.
State for checkpoints (:meth:`state_dict`): the task order, its RNG, the group counter and per-task statistics;
open groups are not saved (their rollouts are lost with the learner that handed them out).
"""

from __future__ import annotations

import collections
import random
import time
from dataclasses import dataclass, field
from typing import Callable

from arpo_async.messages import Outcome, Trajectory
from arpo_async.tasks import Task


@dataclass
class Rollout:
    """One handed-out rollout slot."""

    group_id: str
    rollout_index: int
    task: Task
    deadline: float


@dataclass
class Group:
    """G rollouts of one task; ``results`` maps rollout index -> trajectory."""

    group_id: str
    task: Task
    size: int
    results: dict[int, Trajectory] = field(default_factory=dict)
    attempts: collections.Counter[int] = field(default_factory=collections.Counter)

    @property
    def complete(self) -> bool:
        return len(self.results) == self.size

    def trajectories(self) -> list[Trajectory]:
        return [self.results[i] for i in sorted(self.results)]


class GroupScheduler:
    """Hands out (task, group id, rollout index) and assembles returned trajectories into groups.

    Args:
        tasks: the task pool (non-empty).
        group_size: G.
        max_retries: re-issues of a slot whose trajectory was ENV_ERROR / ABORTED or never came back.
        rollout_timeout_s: a handed-out slot with no trajectory after this long is re-issued.
        seed: task-order seed.
        group_budget: new groups that may open (None = unlimited; see the module docstring).
        id_prefix: prepended to every group id (e.g. the learner id).
        pick_task: chooses the task of each new group (e.g. learner.algo.task_selection.TaskSelector.pick_task);
            None = shuffled round-robin over ``tasks`` with ``seed``.
    """

    def __init__(self, tasks: list[Task], group_size: int, *, max_retries: int = 2,
                 rollout_timeout_s: float = 900.0, seed: int = 0, group_budget: int | None = None,
                 id_prefix: str = "", pick_task: Callable[[], Task] | None = None) -> None:
        if not tasks:
            raise ValueError("the task pool is empty")
        if group_budget is not None and group_budget < 0:
            raise ValueError(f"group_budget must be >= 0 or None, got {group_budget}")
        self._tasks = list(tasks)
        self._rng = random.Random(seed)
        self._order: list[Task] = []
        self._group_size = group_size
        self._max_retries = max_retries
        self._timeout = rollout_timeout_s
        self._next_group = 0
        self._budget = group_budget
        self._prefix = id_prefix
        self._pick_task = pick_task
        self.task_stats: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        """Per task id: "groups" opened, "completed" groups, "trajectories" kept as results, "successes"."""
        self._groups: dict[str, Group] = {}
        self._open: tuple[Group, int] | None = None  # group being handed out, next index
        self._reissue: collections.deque[tuple[str, int]] = collections.deque()
        self._running: dict[tuple[str, int], Rollout] = {}

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def has_work(self) -> bool:
        """Whether :meth:`next_rollout` has a slot to hand out (a re-issue, the open group, or group budget)."""
        while self._reissue and not self._needs_result(*self._reissue[0]):
            self._reissue.popleft()  # its group completed or is gone
        return bool(self._reissue) or self._open is not None or self._budget is None or self._budget > 0

    @property
    def idle(self) -> bool:
        """No group is open or incomplete and no new group may open: everything handed out has come back."""
        return not self._groups and self._budget == 0

    def add_group_budget(self, groups: int) -> None:
        """Allow ``groups`` more new groups (lockstep: one rollout batch). Raises ValueError without a budget."""
        if self._budget is None:
            raise ValueError("this scheduler has no group budget (it opens groups without limit)")
        self._budget += groups

    def set_task_source(self, pick_task: Callable[[], Task] | None, group_budget: int | None) -> None:
        """Switch where new groups' tasks come from and the group budget (None = unlimited), e.g. from the task
        pre-pass to training; groups already open keep their task.

        Raises:
            ValueError: a negative budget.
        """
        if group_budget is not None and group_budget < 0:
            raise ValueError(f"group_budget must be >= 0 or None, got {group_budget}")
        self._pick_task, self._budget = pick_task, group_budget

    def next_rollout(self, now: float | None = None) -> Rollout:
        """The next slot to hand out: re-issues first, then the open group, then a new group.

        Raises:
            RuntimeError: no slot to hand out (check :attr:`has_work` first).
        """
        now = time.monotonic() if now is None else now
        while self._reissue:
            group_id, index = self._reissue.popleft()
            if self._needs_result(group_id, index):
                return self._start(self._groups[group_id], index, now)
        if self._open is None:
            if self._budget is not None:
                if self._budget <= 0:
                    raise RuntimeError("no rollout to hand out: the group budget is spent")
                self._budget -= 1
            task = self._next_task()
            group = Group(f"{self._prefix}g{self._next_group}-{task.id}", task, self._group_size)
            self._next_group += 1
            self.task_stats[task.id]["groups"] += 1
            self._groups[group.group_id] = group
            self._open = (group, 0)
        group, index = self._open
        self._open = (group, index + 1) if index + 1 < group.size else None
        return self._start(group, index, now)

    def _needs_result(self, group_id: str, index: int) -> bool:
        group = self._groups.get(group_id)
        return group is not None and index not in group.results

    def _next_task(self) -> Task:
        if self._pick_task is not None:
            return self._pick_task()
        if not self._order:
            self._order = self._rng.sample(self._tasks, len(self._tasks))
        return self._order.pop()

    def _start(self, group: Group, index: int, now: float) -> Rollout:
        group.attempts[index] += 1
        rollout = Rollout(group.group_id, index, group.task, now + self._timeout)
        self._running[(group.group_id, index)] = rollout
        return rollout

    def is_running(self, group_id: str, rollout_index: int) -> bool:
        return (group_id, rollout_index) in self._running

    def running_task(self, group_id: str, rollout_index: int) -> Task:
        """The task of a running slot. Raises KeyError when the slot is not running (check :meth:`is_running`)."""
        return self._running[(group_id, rollout_index)].task

    def on_trajectory(self, traj: Trajectory) -> Group | None:
        """Record a returned trajectory; returns its group when that completes it.

        A non-trainable trajectory (ENV_ERROR, ABORTED) is re-issued while the slot has retries left.
        Raises:
            KeyError: the trajectory names a slot that is not running (unknown group, or already filled).
        """
        key = (traj.group_id, traj.rollout_index)
        if key not in self._running:
            raise KeyError(f"no running rollout {key}")
        del self._running[key]
        group = self._groups[traj.group_id]
        retry = not traj.outcome.trainable and group.attempts[traj.rollout_index] <= self._max_retries
        if retry:
            self._reissue.append(key)
            return None
        group.results[traj.rollout_index] = traj
        stats = self.task_stats[group.task.id]
        stats["trajectories"] += 1
        stats["successes"] += traj.outcome is Outcome.SUCCESS
        if group.complete:
            stats["completed"] += 1
            del self._groups[group.group_id]
            return group
        return None

    def expire(self, now: float | None = None) -> int:
        """Re-issue every running slot past its deadline; returns how many."""
        now = time.monotonic() if now is None else now
        late = [key for key, r in self._running.items() if r.deadline <= now]
        for key in late:
            del self._running[key]
            self._reissue.append(key)
        return len(late)

    def expire_slots(self, keys: list[tuple[str, int]]) -> int:
        """Re-issue these running slots (group id, rollout index) now, e.g. those of an actor that went silent;
        slots no longer running are skipped. Returns how many were re-issued."""
        count = 0
        for key in keys:
            if key in self._running:
                del self._running[key]
                self._reissue.append(key)
                count += 1
        return count

    def pending_trainable(self) -> int:
        """Trainable trajectories held in incomplete groups (they are lost if the learner stops now)."""
        return sum(t.outcome.trainable for g in self._groups.values() for t in g.results.values())

    def state_dict(self) -> dict:
        """Task order, its RNG, the group counter and per-task statistics, as plain lists, dicts and numbers."""
        version, internal, gauss = self._rng.getstate()
        return {"schema": 1, "rng": [version, list(internal), gauss], "order": [t.id for t in self._order],
                "next_group": self._next_group,
                "task_stats": {task_id: dict(c) for task_id, c in self.task_stats.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output. Tasks no longer in the pool are left out of the order.

        Raises:
            ValueError: unknown schema or malformed state.
        """
        if state.get("schema") != 1:
            raise ValueError(f"unsupported scheduler state schema {state.get('schema')!r}")
        try:
            version, internal, gauss = state["rng"]
            rng = random.Random()
            rng.setstate((int(version), tuple(int(x) for x in internal), gauss))
            by_id = {t.id: t for t in self._tasks}
            order = [by_id[i] for i in state["order"] if i in by_id]
            next_group = int(state["next_group"])
            stats = collections.defaultdict(collections.Counter, {
                str(k): collections.Counter({str(n): int(v) for n, v in c.items()})
                for k, c in state["task_stats"].items()})
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"malformed scheduler state: {type(error).__name__}: {error}") from error
        self._rng, self._order, self._next_group, self.task_stats = rng, order, next_group, stats
