"""What the learner's admission bookkeeping (learner.rollouts.peers) holds and needs: who holds a running slot, a
waiting request, the receipt of a trajectory, and the two protocols it talks to (the slot's owner, the admission
rule)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from arpo_async.messages import Trajectory, WorkRequest
from arpo_async.tasks import Task
from arpo_async.validation import InvalidMessage
from learner.rollouts.scheduler import Group


@dataclass
class Hold:
    """Who holds a running slot: the routing id it was sent to, the session it belongs to, the CURVE key of that
    session ("" without CURVE), and whether it is a training rollout (not an evaluation episode)."""

    peer: str
    session: str
    key: str
    training: bool


@dataclass
class Waiting:
    """A waiting work request, the CURVE key it came with, and when it arrived (time.monotonic)."""

    request: WorkRequest
    key: str
    since: float


class SlotOwner(Protocol):
    """Who runs a rollout slot: the scheduler (training rollouts) or the evaluation rounds (episodes)."""

    def is_running(self, group_id: str, rollout_index: int) -> bool: ...
    def running_task(self, group_id: str, rollout_index: int) -> Task: ...
    def on_trajectory(self, traj: Trajectory) -> Group | None: ...


@dataclass
class Receipt:
    """What :meth:`learner.rollouts.peers.Peers.receive` made of one trajectory.

    Attributes:
        taken: what went into its slot: the trajectory, or an ABORTED one in place of an invalid one from the
            slot's peer (so the rollout is handed out again); None when nothing was taken.
        task: the slot's task (when taken).
        group: the group it completed (a training rollout's last), else None.
        evaluation: the slot was an evaluation episode's (learner.rollouts.evaluation_rounds).
        problem: why the peer gets a Reject (None: no Reject).
    """

    taken: Trajectory | None = None
    task: Task | None = None
    group: Group | None = None
    evaluation: bool = False
    problem: InvalidMessage | None = None


class Admission(Protocol):
    """What the service needs from an admission rule (learner.rollouts.staleness.StalenessManager,
    learner.rollouts.staleness.LockstepAdmission)."""

    accepted: int
    running: int

    def capacity(self, version: int) -> int: ...
    def can_admit(self, version: int) -> bool: ...
    def on_start(self) -> None: ...
    def on_finish(self, accepted: bool) -> None: ...
    def on_discard(self, count: int) -> None: ...
