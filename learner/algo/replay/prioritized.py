"""Prioritized success replay: per-task successes under a global memory bound, drawn and evicted by priority.

Owns the stored successes (per task, insertion order, each with its sampling version, length, insertion counter
and replay count), the per-task success-rate estimates, the draw's RNG and the counters reported by ``stats``.
The priority formula, which groups get a replayed success and why the defaults are what they are: see
:class:`PrioritizedReplay`.

Invariants: after every ``add_group`` (and ``load_state_dict``) no task holds more than ``capacity_per_task``
successes and the buffer no more than ``max_total``; eviction and draws are deterministic for a given seed and
history (ties broken by the insertion counter); ``state_dict`` round-trips everything (schema
``_PRIORITIZED_SCHEMA``, mode "prioritized"). Replayed trajectories keep their own behaviour log-probs and token
versions; the trainer's off-policy correction treats them like any other data.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from arpo_async.success import DEFAULT_SUCCESS_THRESHOLD, is_success
from learner.algo.grpo import is_all_failed
from learner.algo.replay.buffer import Injection, ReplayError, check_group, rng_from_state, rng_state

__all__ = ["PrioritizedReplay", "trajectory_length", "trajectory_version"]

T = TypeVar("T")

_PRIORITIZED_SCHEMA = 1


def trajectory_version(trajectory: Any) -> int:
    """Policy version that sampled a trajectory: the oldest version among its tokens (``step.versions``), or its
    ``assigned_version`` when it has no generated token. Works on :class:`arpo_async.messages.Trajectory`."""
    oldest = trajectory.oldest_version()
    return oldest if oldest is not None else int(getattr(trajectory, "assigned_version", 0))


def trajectory_length(trajectory: Any) -> int:
    """Episode length in policy steps (``len(trajectory.steps)``), at least 1."""
    return max(1, len(trajectory.steps))


@dataclass
class _Entry(Generic[T]):
    trajectory: T
    score: float
    version: int
    length: int
    counter: int
    replays: int = 0


class PrioritizedReplay(Generic[T]):
    """Per-task success replay with a global memory bound and a sampling priority.

    Priority of a stored success ``e`` of task ``k`` when the policy version is ``v``::

        p(e) = (1 - s_k + eps)^alpha  *  exp(-(v - v_e) / tau)  *  L_e^(-beta)
               task: fails more often    fresher success          shorter episode

    ``s_k`` is an exponential moving average of task k's sampled success rate, one update per group
    (``s <- s + ema * (rate - s)``; the task's first group sets ``s = rate``); ``v_e`` the policy version that
    sampled ``e`` (:func:`trajectory_version`: its oldest token's version); ``L_e`` its number of steps
    (:func:`trajectory_length`); ``v - v_e`` is floored at 0.

    How the priority is used:

    - injection: among the task's stored successes, one is drawn with probability ``p(e) / sum p`` (the task
      factor cancels inside a task) by walking the entries in insertion order with ``u = rng.random() * sum p``;
      seeded, so the same history gives the same draws;
    - eviction: when a task holds more than ``capacity_per_task`` successes, its lowest-priority entry goes;
      when the buffer holds more than ``max_total``, the lowest-priority entry over ALL tasks goes, so tasks the
      policy already solves give up their memory first. Ties are broken by the insertion counter: the oldest
      goes first (deterministic).

    Which groups get a replayed success (always of their own task): every group satisfying ARPO's all-failed
    rule (:func:`learner.algo.grpo.is_all_failed`), and, when ``inject_below > 0``, every group whose success rate
    (share of scores above ``success_threshold``) is below ``inject_below``. The replayed success replaces the
    rollout with the LOWEST reward (``rewards`` if given, else the scores; ties: the lowest index), so a rollout
    whose reply did not parse is replaced before a merely failed one.

    Defaults and why:

    - ``alpha = 1, eps = 0.05``: a task never solved weighs 1.05, one solved half the time 0.55, one always
      solved 0.05: always-solved tasks keep 1/21 of an unsolved task's weight, so their successes are evicted
      first but not wiped at once.
    - ``tau = 8`` versions: a success 8 versions old weighs e^-1 = 0.37 of a fresh one. Old successes still help
      (their tokens are reweighted by the off-policy correction) but carry a more corrected, noisier gradient,
      so fresh ones should displace them.
    - ``beta = 0.5``: a 2-step success weighs sqrt(2) = 1.41 times a 4-step one: prefer short solutions
      without letting length override diversity.
    - ``ema = 0.3``: the last three or so groups of a task dominate its success estimate.
    - ``capacity_per_task = 8`` (ARPO), ``max_total = 256`` trajectories (screenshots make one ~100 KB to a few
      MB, so the bound caps the learner's memory).

    Args:
        capacity_per_task: most successes kept per task (>= 1).
        max_total: most successes kept over all tasks (>= 1).
        success_threshold: a trajectory is a success when its score is strictly above this
            (:func:`arpo_async.success.is_success`; ``learner.success_threshold``, ARPO: 0.1).
        inject_below: also inject into groups with success rate below this (0 = all-failed groups only).
        alpha, eps: task-preference exponent (>= 0) and floor (> 0).
        tau: age scale in policy versions (> 0).
        beta: length exponent (>= 0).
        ema: EMA rate of the per-task success estimate, in (0, 1].
        seed: seed of the draw's RNG (its state is part of :meth:`state_dict`).
        all_failed_std, all_failed_mean: thresholds of the all-failed rule (ARPO: 0.05, 0.2).
        version_of: the sampling version of a stored trajectory (default :func:`trajectory_version`).
        length_of: the episode length of a stored trajectory (default :func:`trajectory_length`).

    Raises:
        ReplayError: a parameter out of range.
    """

    def __init__(
        self,
        capacity_per_task: int = 8,
        max_total: int = 256,
        *,
        success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
        inject_below: float = 0.0,
        alpha: float = 1.0,
        eps: float = 0.05,
        tau: float = 8.0,
        beta: float = 0.5,
        ema: float = 0.3,
        seed: int = 0,
        all_failed_std: float = 0.05,
        all_failed_mean: float = 0.2,
        version_of: Callable[[T], int] = trajectory_version,
        length_of: Callable[[T], int] = trajectory_length,
    ) -> None:
        checks = (
            ("capacity_per_task", capacity_per_task >= 1, ">= 1"),
            ("max_total", max_total >= 1, ">= 1"),
            ("success_threshold", math.isfinite(success_threshold), "finite"),
            ("inject_below", 0.0 <= inject_below <= 1.0, "in [0, 1]"),
            ("alpha", alpha >= 0 and math.isfinite(alpha), "finite and >= 0"),
            ("eps", eps > 0 and math.isfinite(eps), "finite and > 0"),
            ("tau", tau > 0 and math.isfinite(tau), "finite and > 0"),
            ("beta", beta >= 0 and math.isfinite(beta), "finite and >= 0"),
            ("ema", 0 < ema <= 1, "in (0, 1]"),
            ("all_failed_std", math.isfinite(all_failed_std), "finite"),
            ("all_failed_mean", math.isfinite(all_failed_mean), "finite"),
        )
        for name, ok, rule in checks:
            if not ok:
                raise ReplayError(f"{name} must be {rule}, got {locals()[name]!r}")
        self.capacity_per_task = capacity_per_task
        self.max_total = max_total
        self.success_threshold = success_threshold
        self.inject_below = inject_below
        self.alpha, self.eps, self.tau, self.beta, self.ema = alpha, eps, tau, beta, ema
        self.all_failed_std = all_failed_std
        self.all_failed_mean = all_failed_mean
        self._version_of = version_of
        self._length_of = length_of
        self._rng = random.Random(seed)
        self._tasks: dict[str, list[_Entry[T]]] = {}
        self._success: dict[str, float] = {}
        self._counter = 0
        self._now = 0
        self._injections = 0
        self._low_success_injections = 0
        self._evicted = 0

    @property
    def mode(self) -> str:
        return "prioritized"

    # ------------------------------------------------------------------ priority

    def task_success(self, task_id: str) -> float | None:
        """The task's success-rate EMA, or None before its first group."""
        return self._success.get(task_id)

    def _task_factor(self, task_id: str) -> float:
        return (1.0 - self._success.get(task_id, 0.0) + self.eps) ** self.alpha

    def _entry_factor(self, entry: _Entry[T]) -> float:
        age = max(0, self._now - entry.version)
        return math.exp(-age / self.tau) * float(entry.length) ** (-self.beta)

    def priorities(self, task_id: str) -> list[float]:
        """p(e) of each of the task's stored successes at the latest version seen, in insertion order (empty when
        none)."""
        return [self._task_factor(task_id) * self._entry_factor(entry) for entry in self._tasks.get(task_id, ())]

    # ------------------------------------------------------------------ inject / add

    def inject(self, task_id: str, trajectories: Sequence[T], scores: Sequence[float], *, version: int = 0,
               rewards: Sequence[float] | None = None) -> Injection[T]:
        """Replace the lowest-reward rollout of an all-failed (or low-success) group by a drawn stored success.

        Args:
            task_id: the task's id.
            trajectories: the group's trajectories, shape (G,).
            scores: their evaluator scores, shape (G,).
            version: the current policy version (ages are measured against it).
            rewards: the rollouts' rewards, shape (G,), to pick the rollout to replace; None = use ``scores``.

        Returns:
            An :class:`Injection` (new lists; the inputs are not modified).

        Raises:
            ReplayError: lengths differ, the group is empty, or a score or reward is not finite.
        """
        checked = check_group(trajectories, scores)
        rank = checked if rewards is None else check_group(trajectories, rewards)
        self._now = max(self._now, int(version))
        out = list(trajectories)
        entries = self._tasks.get(task_id)
        all_failed = is_all_failed(checked, std_threshold=self.all_failed_std, mean_threshold=self.all_failed_mean)
        rate = sum(is_success(score, self.success_threshold) for score in checked) / len(checked)
        low_success = self.inject_below > 0 and rate < self.inject_below
        if not entries or not (all_failed or low_success):
            return Injection(out, checked, None)
        weights = [self._entry_factor(entry) for entry in entries]
        chosen = self._draw(entries, weights)
        index = min(range(len(rank)), key=lambda i: (rank[i], i))
        out[index] = chosen.trajectory
        checked[index] = chosen.score
        chosen.replays += 1
        self._injections += 1
        self._low_success_injections += not all_failed
        return Injection(out, checked, index)

    def _draw(self, entries: list[_Entry[T]], weights: list[float]) -> _Entry[T]:
        total = math.fsum(weights)
        if not total > 0:  # every weight underflowed: take the freshest
            return max(entries, key=lambda e: (e.version, e.counter))
        u = self._rng.random() * total
        cumulative = 0.0
        for entry, weight in zip(entries, weights):
            cumulative += weight
            if u < cumulative:
                return entry
        return entries[-1]  # u within rounding of the total

    def add_group(
        self, task_id: str, trajectories: Sequence[T], scores: Sequence[float], *, version: int = 0
    ) -> int:
        """Update the task's success estimate from the group as sampled and store its successes.

        Pass the original (un-injected) group, after :meth:`inject`. Successes are scores strictly above
        ``success_threshold``. Bounds are enforced right after storing (see the class docstring).

        Returns:
            How many successes were stored (some may have been evicted at once by the bounds).

        Raises:
            ReplayError: lengths differ, the group is empty, or a score is not finite.
        """
        checked = check_group(trajectories, scores)
        self._now = max(self._now, int(version))
        successes = [is_success(score, self.success_threshold) for score in checked]
        rate = sum(successes) / len(checked)
        previous = self._success.get(task_id)
        self._success[task_id] = rate if previous is None else previous + self.ema * (rate - previous)
        stored = 0
        for trajectory, score, success in zip(trajectories, checked, successes):
            if success:
                entry = _Entry(trajectory, score, int(self._version_of(trajectory)),
                               max(1, int(self._length_of(trajectory))), self._counter)
                self._counter += 1
                self._tasks.setdefault(task_id, []).append(entry)
                stored += 1
        if stored:
            self._evicted += self._enforce_bounds()
        return stored

    def _enforce_bounds(self) -> int:
        evicted = 0
        for task_id, entries in self._tasks.items():
            while len(entries) > self.capacity_per_task:
                self._remove(*self._lowest([(task_id, e) for e in entries]))
                evicted += 1
        while sum(len(entries) for entries in self._tasks.values()) > self.max_total:
            candidates = [(task_id, e) for task_id, entries in self._tasks.items() for e in entries]
            self._remove(*self._lowest(candidates))
            evicted += 1
        self._tasks = {task_id: entries for task_id, entries in self._tasks.items() if entries}
        return evicted

    def _lowest(self, candidates: list[tuple[str, _Entry[T]]]) -> tuple[str, _Entry[T]]:
        return min(candidates, key=lambda c: (self._task_factor(c[0]) * self._entry_factor(c[1]), c[1].counter))

    def _remove(self, task_id: str, entry: _Entry[T]) -> None:
        entries = self._tasks[task_id]
        del entries[next(i for i, e in enumerate(entries) if e is entry)]

    # ------------------------------------------------------------------ inspection and state

    def stored(self, task_id: str) -> list[tuple[T, float]]:
        """The task's stored ``(trajectory, score)`` pairs in insertion order (a copy)."""
        return [(e.trajectory, e.score) for e in self._tasks.get(task_id, ())]

    def stats(self) -> dict[str, float]:
        """``{"tasks", "stored", "injections", "low_success_injections", "evicted", "age_mean" (versions, over
        stored successes; 0 when empty), "length_mean" (steps)}``; counters since construction or load."""
        entries = [e for entries in self._tasks.values() for e in entries]
        return {
            "tasks": len(self._tasks),
            "stored": len(entries),
            "injections": self._injections,
            "low_success_injections": self._low_success_injections,
            "evicted": self._evicted,
            "age_mean": sum(max(0, self._now - e.version) for e in entries) / len(entries) if entries else 0.0,
            "length_mean": sum(e.length for e in entries) / len(entries) if entries else 0.0,
        }

    def state_dict(self, encode: Callable[[T], Any] | None = None) -> dict[str, Any]:
        """The buffer as plain data: ``{"schema", "mode": "prioritized", "rng", "counter", "now", "injections",
        "low_success_injections", "evicted", "success": {task_id: ema}, "tasks": {task_id: [[trajectory, score,
        version, length, counter, replays], ...]}}`` (insertion order).

        Args:
            encode: applied to each stored trajectory (learner.train.checkpoint passes its ``encode_trajectory``);
                identity if None.
        """
        return {
            "schema": _PRIORITIZED_SCHEMA,
            "mode": "prioritized",
            "rng": rng_state(self._rng),
            "counter": self._counter,
            "now": self._now,
            "injections": self._injections,
            "low_success_injections": self._low_success_injections,
            "evicted": self._evicted,
            "success": dict(self._success),
            "tasks": {
                task_id: [[encode(e.trajectory) if encode else e.trajectory, e.score, e.version, e.length,
                           e.counter, e.replays] for e in entries]
                for task_id, entries in self._tasks.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any], decode: Callable[[Any], T] | None = None) -> None:
        """Restore contents, success estimates, counters and RNG from :meth:`state_dict`'s output.

        The constructor's configuration is kept; when its bounds are smaller than the saved contents, the
        lowest-priority entries are evicted (not counted in ``evicted``).

        Raises:
            ReplayError: another mode's state, an unknown schema, or a malformed state.
        """
        if state.get("mode") != "prioritized":
            raise ReplayError(f"this is the state of a {state.get('mode', 'arpo')!r} replay buffer, "
                              "not a prioritized one")
        if state.get("schema") != _PRIORITIZED_SCHEMA:
            raise ReplayError(f"unsupported prioritized replay schema {state.get('schema')!r}")
        try:
            rng = rng_from_state(state["rng"])
            tasks: dict[str, list[_Entry[T]]] = {}
            for task_id, rows in state["tasks"].items():
                entries = [
                    _Entry(decode(trajectory) if decode else trajectory, float(score), int(version),
                           int(length), int(counter), int(replays))
                    for trajectory, score, version, length, counter, replays in rows
                ]
                if entries:
                    tasks[str(task_id)] = entries
            success = {str(k): float(v) for k, v in state["success"].items()}
            counter, now = int(state["counter"]), int(state["now"])
            counts = (int(state["injections"]), int(state["low_success_injections"]), int(state["evicted"]))
        except (KeyError, TypeError, ValueError) as error:
            raise ReplayError(f"malformed replay state: {type(error).__name__}: {error}") from error
        self._rng, self._tasks, self._success, self._counter, self._now = rng, tasks, success, counter, now
        self._injections, self._low_success_injections, self._evicted = counts
        self._enforce_bounds()
