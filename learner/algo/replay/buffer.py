"""The replay buffers' common contract: the interface the batcher calls, the injection result, the error type
and the checks and RNG-state helpers both buffers share.

Owns no state. Invariants every buffer keeps: ``inject`` never modifies its inputs and returns new lists of the
group's length; a replayed trajectory is always of the group's own task; ``state_dict`` gives plain data
(including the RNG state, so a resumed learner continues the same draws) and ``load_state_dict`` refuses another
mode's state or an unknown schema with :class:`ReplayError`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["Injection", "ReplayBuffer", "ReplayError", "check_group", "rng_from_state", "rng_state"]

T = TypeVar("T")


class ReplayError(ValueError):
    """Raised for bad arguments to a replay buffer or a state dict it cannot load."""


@dataclass(frozen=True)
class Injection(Generic[T]):
    """The result of ``inject``: the group after injection and which rollout was replaced.

    Attributes:
        trajectories: the group's trajectories after injection, length G (a new list).
        scores: their evaluator scores, length G (a new list).
        index: the position that now holds a replayed success, or None when nothing was injected.
    """

    trajectories: list[T]
    scores: list[float]
    index: int | None

    @property
    def injected(self) -> bool:
        return self.index is not None


class ReplayBuffer(Protocol[T]):
    """What the batcher needs from a replay buffer (both :class:`learner.algo.replay.arpo.SuccessReplay` and
    :class:`learner.algo.replay.prioritized.PrioritizedReplay`)."""

    @property
    def mode(self) -> str: ...

    def inject(self, task_id: str, trajectories: Sequence[T], scores: Sequence[float], *, version: int = 0,
               rewards: Sequence[float] | None = None) -> Injection[T]: ...

    def add_group(self, task_id: str, trajectories: Sequence[T], scores: Sequence[float], *,
                  version: int = 0) -> int: ...

    def stats(self) -> dict[str, float]: ...

    def state_dict(self, encode: Callable[[T], Any] | None = None) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], decode: Callable[[Any], T] | None = None) -> None: ...


def check_group(trajectories: Sequence[Any], scores: Sequence[float]) -> list[float]:
    """The group's scores as floats, shape (G,).

    Raises:
        ReplayError: lengths differ, the group is empty, or a score is not finite.
    """
    if len(trajectories) != len(scores):
        raise ReplayError(f"{len(trajectories)} trajectories but {len(scores)} scores")
    if len(scores) == 0:
        raise ReplayError("empty group")
    checked = [float(s) for s in scores]
    bad = [s for s in checked if not math.isfinite(s)]
    if bad:
        raise ReplayError(f"non-finite scores: {bad}")
    return checked


def rng_state(rng: random.Random) -> list[Any]:
    """A buffer RNG's state as plain data (for state_dict)."""
    version, internal, gauss_next = rng.getstate()
    return [version, list(internal), gauss_next]


def rng_from_state(state: Sequence[Any]) -> random.Random:
    """Inverse of :func:`rng_state`."""
    version, internal, gauss_next = state
    rng = random.Random()
    rng.setstate((int(version), tuple(int(x) for x in internal), gauss_next))
    return rng
