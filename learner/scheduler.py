"""Task scheduler: hands out rollouts in groups of G and collects them back into complete groups.

Owns: open groups, their handed-out rollouts (with deadlines) and their results.
Invariants: a group has exactly G rollout slots; a slot's result is the first trainable trajectory for it,
or its last non-trainable one once ``max_retries`` re-issues are spent; a group is complete when every slot
has a result. Rollouts whose trajectory never arrives before the deadline are re-issued like ENV_ERROR ones.
Tasks are visited in a shuffled round-robin order (seeded), one group per visit.
"""

from __future__ import annotations

import collections
import itertools
import random
import time
from dataclasses import dataclass, field

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
    """

    def __init__(self, tasks: list[Task], group_size: int, *, max_retries: int = 2,
                 rollout_timeout_s: float = 900.0, seed: int = 0) -> None:
        if not tasks:
            raise ValueError("the task pool is empty")
        self._tasks = list(tasks)
        self._rng = random.Random(seed)
        self._order: list[Task] = []
        self._group_size = group_size
        self._max_retries = max_retries
        self._timeout = rollout_timeout_s
        self._counter = itertools.count()
        self._groups: dict[str, Group] = {}
        self._open: tuple[Group, int] | None = None  # group being handed out, next index
        self._reissue: collections.deque[tuple[str, int]] = collections.deque()
        self._running: dict[tuple[str, int], Rollout] = {}

    @property
    def running(self) -> int:
        return len(self._running)

    def next_rollout(self, now: float | None = None) -> Rollout:
        """The next slot to hand out: re-issues first, then the open group, then a new group."""
        now = time.monotonic() if now is None else now
        while self._reissue:
            group_id, index = self._reissue.popleft()
            group = self._groups.get(group_id)
            if group is not None and index not in group.results:
                return self._start(group, index, now)
        if self._open is None:
            task = self._next_task()
            group = Group(f"g{next(self._counter)}-{task.id}", task, self._group_size)
            self._groups[group.group_id] = group
            self._open = (group, 0)
        group, index = self._open
        self._open = (group, index + 1) if index + 1 < group.size else None
        return self._start(group, index, now)

    def _next_task(self) -> Task:
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
        retry = not Outcome(traj.outcome).trainable and group.attempts[traj.rollout_index] <= self._max_retries
        if retry:
            self._reissue.append(key)
            return None
        group.results[traj.rollout_index] = traj
        if group.complete:
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
