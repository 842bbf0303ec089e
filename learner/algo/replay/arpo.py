"""ARPO's success replay (exact): a per-task FIFO of successful trajectories, one injected into an all-failed group.

Owns the stored successes (per task, oldest first), the RNG of the uniform draw and the injection count.

ARPO's rule (:class:`SuccessReplay`; ARPO ``verl/trainer/ray_trainer.py`` ``apply_replay``, ``replay_buffer.py``):

1. A group whose evaluator scores satisfy :func:`learner.algo.grpo.is_all_failed` (std < 0.05 and mean < 0.2) and
   whose task has a stored success gets one stored success, drawn uniformly, in place of its FIRST rollout;
   the group size is unchanged. Other groups are untouched.
2. Only after that is the buffer updated from the group as sampled (successes: score > 0.1, the rule that
   :func:`arpo_async.success.is_success` makes the run's one definition of success), at most 8 per task, oldest
   evicted first.

Unlike ARPO (whose ``enable_replay`` switch is never read, ARPO issue 17) ``enabled=False`` really turns the
buffer off: nothing is stored and nothing is injected.

Invariants: at most ``capacity_per_task`` successes per task; a disabled buffer stores and injects nothing;
``state_dict`` round-trips contents, counter and RNG (schema ``_STATE_SCHEMA``, mode "arpo").
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from arpo_async.success import DEFAULT_SUCCESS_THRESHOLD, is_success
from learner.algo.grpo import is_all_failed
from learner.algo.replay.buffer import Injection, ReplayError, check_group, rng_from_state, rng_state

__all__ = ["SuccessReplay"]

T = TypeVar("T")

_STATE_SCHEMA = 1


class SuccessReplay(Generic[T]):
    """ARPO's per-task replay buffer of successful trajectories.

    Args:
        capacity_per_task: most successes kept per task; the oldest is evicted first (ARPO: 8).
        success_threshold: a trajectory is a success when its evaluator score is strictly above this
            (:func:`arpo_async.success.is_success`; ``learner.success_threshold``, ARPO: 0.1).
        enabled: False turns the buffer off (no storing, no injection).
        seed: seed of the RNG used for the uniform draw; the RNG state is part of :meth:`state_dict`.
        all_failed_std: std threshold of the all-failed rule (ARPO: 0.05).
        all_failed_mean: mean threshold of the all-failed rule (ARPO: 0.2).

    Raises:
        ReplayError: ``capacity_per_task`` < 1 or a threshold is not finite.
    """

    def __init__(
        self,
        capacity_per_task: int = 8,
        success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
        enabled: bool = True,
        seed: int = 0,
        *,
        all_failed_std: float = 0.05,
        all_failed_mean: float = 0.2,
    ) -> None:
        if capacity_per_task < 1:
            raise ReplayError(f"capacity_per_task must be >= 1, got {capacity_per_task}")
        for name, value in (
            ("success_threshold", success_threshold),
            ("all_failed_std", all_failed_std),
            ("all_failed_mean", all_failed_mean),
        ):
            if not math.isfinite(value):
                raise ReplayError(f"{name} must be finite, got {value}")
        self.capacity_per_task = capacity_per_task
        self.success_threshold = success_threshold
        self.enabled = enabled
        self.all_failed_std, self.all_failed_mean = all_failed_std, all_failed_mean
        self._rng = random.Random(seed)
        self._buffers: dict[str, deque[tuple[T, float]]] = {}
        self._injections = 0

    @property
    def mode(self) -> str:
        """"arpo" when enabled, else "off"."""
        return "arpo" if self.enabled else "off"

    def add_group(
        self, task_id: str, trajectories: Sequence[T], scores: Sequence[float], *, version: int = 0
    ) -> int:
        """Store the group's successes (score > ``success_threshold``) at the back of the task's FIFO.

        Pass the group as sampled, after :meth:`inject` has been called for it.

        Args:
            task_id: the task's id.
            trajectories: the group's trajectories, any objects, shape (G,).
            scores: their evaluator scores, shape (G,).
            version: the current policy version (unused by ARPO's buffer; part of the common interface).

        Returns:
            How many trajectories were stored (0 when disabled).

        Raises:
            ReplayError: lengths differ, the group is empty, or a score is not finite.
        """
        checked = check_group(trajectories, scores)
        if not self.enabled:
            return 0
        stored = 0
        for trajectory, score in zip(trajectories, checked):
            if is_success(score, self.success_threshold):
                fifo = self._buffers.setdefault(task_id, deque(maxlen=self.capacity_per_task))
                fifo.append((trajectory, score))
                stored += 1
        return stored

    def inject(self, task_id: str, trajectories: Sequence[T], scores: Sequence[float], *, version: int = 0,
               rewards: Sequence[float] | None = None) -> Injection[T]:
        """Replace the FIRST rollout of an all-failed group by a stored success of the same task, drawn uniformly.

        Args:
            task_id: the task's id.
            trajectories: the group's trajectories, shape (G,).
            scores: their evaluator scores, shape (G,); the all-failed rule is applied to these.
            version: the current policy version (unused here; part of the common interface).
            rewards: the rollouts' rewards (unused here: ARPO always replaces rollout 0).

        Returns:
            An :class:`Injection` with new lists of length G (the inputs are not modified); when ``injected``,
            ``index`` is 0 and element 0 of both lists is the replayed success and its stored score.

        Raises:
            ReplayError: lengths differ, the group is empty, or a score is not finite.
        """
        checked = check_group(trajectories, scores)
        out_trajectories = list(trajectories)
        fifo = self._buffers.get(task_id)
        if (
            not self.enabled
            or not fifo
            or not is_all_failed(checked, std_threshold=self.all_failed_std, mean_threshold=self.all_failed_mean)
        ):
            return Injection(out_trajectories, checked, None)
        trajectory, score = fifo[self._rng.randrange(len(fifo))]
        out_trajectories[0] = trajectory
        checked[0] = score
        self._injections += 1
        return Injection(out_trajectories, checked, 0)

    def stored(self, task_id: str) -> list[tuple[T, float]]:
        """The task's stored ``(trajectory, score)`` pairs, oldest first (a copy)."""
        return list(self._buffers.get(task_id, ()))

    def stats(self) -> dict[str, float]:
        """``{"tasks": tasks with at least one stored success, "stored": stored successes in all,
        "injections": injections since construction (or since the loaded state's)}``."""
        return {
            "tasks": sum(1 for fifo in self._buffers.values() if fifo),
            "stored": sum(len(fifo) for fifo in self._buffers.values()),
            "injections": self._injections,
        }

    def state_dict(self, encode: Callable[[T], Any] | None = None) -> dict[str, Any]:
        """The buffer as plain dicts, lists, strings and numbers (msgpack-friendly if the trajectories are).

        Args:
            encode: applied to each stored trajectory (e.g. to turn it into a msgpack map); identity if None.

        Returns:
            ``{"schema", "injections", "rng", "tasks": {task_id: [[trajectory, score], ...] oldest first}}``.
        """
        return {
            "schema": _STATE_SCHEMA,
            "mode": "arpo",
            "injections": self._injections,
            "rng": rng_state(self._rng),
            "tasks": {
                task_id: [[encode(t) if encode else t, score] for t, score in fifo]
                for task_id, fifo in self._buffers.items()
                if fifo
            },
        }

    def load_state_dict(self, state: dict[str, Any], decode: Callable[[Any], T] | None = None) -> None:
        """Restore contents, injection counter and RNG from :meth:`state_dict`'s output.

        The constructor's configuration (capacity, thresholds, enabled) is kept; a task holding more than
        ``capacity_per_task`` entries keeps its newest ones.

        Args:
            state: a dict produced by :meth:`state_dict`.
            decode: applied to each stored trajectory; identity if None.

        Raises:
            ReplayError: unknown schema or malformed state.
        """
        if state.get("schema") != _STATE_SCHEMA:
            raise ReplayError(f"unsupported replay state schema {state.get('schema')!r}, expected {_STATE_SCHEMA}")
        if state.get("mode", "arpo") != "arpo":
            raise ReplayError(f"this is the state of a {state.get('mode')!r} replay buffer, not an ARPO one")
        try:
            rng = rng_from_state(state["rng"])
            buffers: dict[str, deque[tuple[T, float]]] = {}
            for task_id, entries in state["tasks"].items():
                fifo: deque[tuple[T, float]] = deque(maxlen=self.capacity_per_task)
                for trajectory, score in entries:
                    fifo.append((decode(trajectory) if decode else trajectory, float(score)))
                buffers[str(task_id)] = fifo
            injections = int(state["injections"])
        except (KeyError, TypeError, ValueError) as error:
            raise ReplayError(f"malformed replay state: {type(error).__name__}: {error}") from error
        self._buffers = buffers
        self._injections = injections
        self._rng = rng
