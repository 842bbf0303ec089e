"""The run's state: what both rooms of the learner read, in one place.

Role: :class:`RunState` holds the optimizer step count, the published policy version and the run's counters. The
rollouts room (learner.rollouts.service: totals, the version it announces) and the training room
(learner.train.loop: the step and version it advances, the drops the algorithm counts) get the same object as an
argument from the wiring function (learner.main); neither owns it. Checkpointed with the service's state
(learner.rollouts.service.LearnerService.state_dict).

Invariant: only :meth:`RunState.advance` (the training loop's last stage) changes ``step`` and ``version`` during a
run; a resumed run restores them from its checkpoint before any actor is served.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field


@dataclass
class RunState:
    """Step, policy version and counters of one run, shared by argument (see the module docstring).

    Attributes:
        step: optimizer steps taken in this run, across restarts.
        version: the newest policy version whose weights reached every inference server (0: the initial weights).
        totals: the run's counters by name (trajectories by outcome, acks, rejections by kind, ...), reported in
            metrics.jsonl ``totals`` and status.json.
        drops: trajectories and groups the algorithm left out of training, by reason (``stale``, ``env_error``,
            ``zero_variance``, ...; learner.algo.batcher.Batcher), reported as ``drops``.
    """

    step: int = 0
    version: int = 0
    totals: collections.Counter[str] = field(default_factory=collections.Counter)
    drops: collections.Counter[str] = field(default_factory=collections.Counter)

    def advance(self, updates: int, version: int) -> None:
        """A batch took ``updates`` optimizer steps and its weights were published as ``version``.

        Raises:
            ValueError: ``updates`` < 1, or ``version`` not above the current one (versions only grow).
        """
        if updates < 1 or version <= self.version:
            raise ValueError(f"advance needs updates >= 1 and a newer version, got {updates} and {version} "
                             f"(now step {self.step}, version {self.version})")
        self.step += updates
        self.version = version
