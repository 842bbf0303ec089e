"""The run's state: its step, its published policy version and its counters, in one object.

Role: :class:`RunState` holds the optimizer step count, the published policy version and the run's counters
(``totals``, ``drops``), and saves and restores them (:meth:`RunState.state_dict`, :meth:`RunState.load_state_dict`,
called by the checkpoint code, learner.train.checkpoint). The run (learner.run.Run) makes the one RunState of a
process and hands it by argument to every component that reads or counts into it: the rollouts room (the service,
its peers, acks, statistics and evaluation rounds), the algorithm's batcher (``drops``) and the training loop. No
component keeps the counters under a name of its own: each writes ``state.totals`` or ``state.drops``.

Two policy versions exist in a run and are named apart: the *published* one (``RunState.published_version``: the
newest whose weights reached every inference server) and the *announced* one
(learner.rollouts.peers.Peers.announced_version: what actors were told last). The service announces a version only
after it was published, so the announced version trails the published one by at most the time of one announcement.

Invariant: only :meth:`RunState.advance` (the training loop's last stage) changes ``step`` and ``published_version``
during a run; a resumed run restores them from its checkpoint before any actor is served.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any


def _number(value: Any) -> int | float:
    """A counter value from a checkpoint (counts are ints, summed seconds floats). Raises TypeError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected a number, got {type(value).__name__}")
    return value


@dataclass
class RunState:
    """Step, published policy version and counters of one run, shared by argument (see the module docstring).

    Attributes:
        step: optimizer steps taken in this run, across restarts.
        published_version: the newest policy version whose weights reached every inference server (0: the initial
            weights); reported as ``policy_version``.
        totals: the run's counters by name (trajectories by outcome, acks, rejections by kind, ...), reported in
            metrics.jsonl ``totals`` and status.json.
        drops: trajectories and groups the algorithm left out of training, by reason (``stale``, ``env_error``,
            ``zero_variance``, ...; learner.algo.batcher.Batcher), reported as ``drops``.
    """

    step: int = 0
    published_version: int = 0
    totals: collections.Counter[str] = field(default_factory=collections.Counter)
    drops: collections.Counter[str] = field(default_factory=collections.Counter)

    def advance(self, updates: int, version: int) -> None:
        """A batch took ``updates`` optimizer steps and its weights were published as ``version``.

        Raises:
            ValueError: ``updates`` < 1, or ``version`` not above the current one (versions only grow).
        """
        if updates < 1 or version <= self.published_version:
            raise ValueError(f"advance needs updates >= 1 and a newer version, got {updates} and {version} "
                             f"(now step {self.step}, version {self.published_version})")
        self.step += updates
        self.published_version = version

    def state_dict(self) -> dict[str, Any]:
        """The resumable state: ``{"version", "step", "totals", "drops"}`` (checkpointed beside the service's
        scheduler and admission state under the checkpoint's ``service`` key, as before this class saved itself,
        so checkpoints of older runs still load)."""
        return {"version": self.published_version, "step": self.step, "totals": dict(self.totals),
                "drops": dict(self.drops)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output in place (the counters stay the same objects, so every component
        holding this RunState sees the restored counts).

        Raises:
            ValueError: a field is missing or malformed (names it; nothing is changed then).
        """
        try:
            version, step = int(state["version"]), int(state["step"])
            totals = collections.Counter({str(k): _number(v) for k, v in state["totals"].items()})
            drops = collections.Counter({str(k): int(v) for k, v in state["drops"].items()})
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"malformed learner service state: {type(error).__name__}: {error}") from error
        self.step, self.published_version = step, version
        self.totals.clear()
        self.totals.update(totals)
        self.drops.clear()
        self.drops.update(drops)
