"""Admission control: the rules that decide whether one more rollout may start. Pure and tiny so they can be
reference-tested; both classes have the same interface (capacity, can_admit, on_start, on_finish, on_discard,
and the ``accepted`` and ``running`` counts), which is all learner.rollouts.service uses.

:class:`StalenessManager`, the async schedule, bounds staleness (AReaL, arXiv 2505.24298, section 5.1).
Invariant: with B trajectories per optimizer step and staleness bound eta, a new rollout starts only while

    accepted + running < (eta + version + 1) x B

where ``accepted`` counts trajectories the learner has kept (in trained batches or waiting in groups),
``running`` counts rollouts handed out and not yet returned, and ``version`` is the current policy version.
So no trajectory can be trained more than eta versions after the version it started from; eta = 0 is the
synchronous schedule. Dropped trajectories (zero-variance groups, ENV_ERROR) are not counted as accepted.

:class:`LockstepAdmission`, the lockstep schedule (ARPO's synchronous loop), counts the same way and admits at most one
rollout batch in flight.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StalenessManager:
    """Counts accepted and running rollouts and applies AReaL's admission rule.

    Args:
        batch_size: B, trajectories per optimizer step (> 0).
        max_staleness: eta (>= 0).
    """

    batch_size: int
    max_staleness: int
    accepted: int = 0
    running: int = 0

    def __post_init__(self) -> None:
        if self.batch_size <= 0 or self.max_staleness < 0:
            raise ValueError(f"need batch_size > 0 and max_staleness >= 0, got {self.batch_size}, {self.max_staleness}")

    def capacity(self, version: int) -> int:
        """How many more rollouts may start now at policy ``version`` (never negative)."""
        limit = (self.max_staleness + version + 1) * self.batch_size
        return max(0, limit - self.accepted - self.running)

    def can_admit(self, version: int) -> bool:
        return self.capacity(version) > 0

    def on_start(self) -> None:
        """A rollout was handed out."""
        self.running += 1

    def on_finish(self, accepted: bool) -> None:
        """A rollout came back; ``accepted`` when the learner keeps it for training."""
        if self.running <= 0:
            raise RuntimeError("on_finish without a running rollout")
        self.running -= 1
        if accepted:
            self.accepted += 1

    def on_discard(self, count: int) -> None:
        """``count`` accepted trajectories were dropped later (e.g. their group had zero reward variance)."""
        self.accepted = max(0, self.accepted - count)


@dataclass
class LockstepAdmission(StalenessManager):
    """Admission for the lockstep schedule (ARPO's synchronous loop): StalenessManager's counting, another capacity.

    The batch boundary is the scheduler's group budget: the training loop opens one rollout batch of
    ``groups_per_step`` groups, every slot of them (re-issues included) is admitted, and nothing else until the
    batch has come back and been trained. This class only guarantees that no more than one batch of
    ``batch_size`` rollouts is ever in flight; ``max_staleness`` plays no part.

    Args:
        batch_size: rollouts per rollout batch, groups_per_step x G (> 0).
    """

    max_staleness: int = 0

    def capacity(self, version: int) -> int:
        """How many more rollouts may start now (``version`` plays no part in lockstep)."""
        return max(0, self.batch_size - self.running)
