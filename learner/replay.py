"""Success replay buffers: ARPO's per-task FIFO (exact), a prioritized variant, and an off switch.

Both buffers store whole successful trajectories per task and inject one into a group of the same task before
advantages are computed, so that a group the policy failed entirely still carries a learning signal. They
share one interface (:class:`ReplayBuffer`), used by :class:`learner.batcher.Batcher` in this order per complete
group: ``inject(...)`` then ``add_group(...)`` with the ORIGINAL (un-injected) trajectories, so an injected
trajectory is never stored twice and a success is replayed from the next group of its task on, never into its own
group. :func:`make_replay` builds one by mode name: "arpo", "prioritized" or "off".

ARPO's rule (:class:`SuccessReplay`; ARPO ``verl/trainer/ray_trainer.py`` ``apply_replay``, ``replay_buffer.py``):

1. A group whose evaluator scores satisfy :func:`learner.grpo.is_all_failed` (std < 0.05 and mean < 0.2) and
   whose task has a stored success gets one stored success, drawn uniformly, in place of its FIRST rollout;
   the group size is unchanged. Other groups are untouched.
2. Only after that is the buffer updated from the group as sampled (successes: score > 0.1), at most 8 per task,
   oldest evicted first.

Unlike ARPO (whose ``enable_replay`` switch is never read, ARPO issue 17) ``enabled=False`` really turns the
buffer off: nothing is stored and nothing is injected.

The prioritized rule (:class:`PrioritizedReplay`) is documented on the class. Replayed trajectories keep their
own behaviour log-probs and token versions; the trainer's off-policy correction treats them like any other data.

State: ``state_dict`` / ``load_state_dict`` give plain dicts, lists, strings and numbers (msgpack-friendly when
the ``encode`` hook makes the trajectories so; :func:`encode_trajectory` / :func:`decode_trajectory` do that for
:class:`arpo_async.messages.Trajectory` through the wire codec), including the RNG state and counters, so a
resumed learner continues the same draws.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from learner.grpo import is_all_failed

__all__ = [
    "REPLAY_MODES",
    "Injection",
    "PrioritizedReplay",
    "ReplayBuffer",
    "ReplayError",
    "SuccessReplay",
    "decode_trajectory",
    "encode_trajectory",
    "make_replay",
    "trajectory_length",
    "trajectory_version",
]

T = TypeVar("T")

REPLAY_MODES: tuple[str, ...] = ("arpo", "prioritized", "off")
"""Replay modes accepted by :func:`make_replay`."""

_STATE_SCHEMA = 1
_PRIORITIZED_SCHEMA = 1


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
    """What the batcher needs from a replay buffer (both :class:`SuccessReplay` and :class:`PrioritizedReplay`)."""

    @property
    def mode(self) -> str: ...

    def inject(self, task_id: str, trajectories: Sequence[T], scores: Sequence[float], *, version: int = 0,
               rewards: Sequence[float] | None = None) -> Injection[T]: ...

    def add_group(self, task_id: str, trajectories: Sequence[T], scores: Sequence[float], *,
                  version: int = 0) -> int: ...

    def stats(self) -> dict[str, float]: ...

    def state_dict(self, encode: Callable[[T], Any] | None = None) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], decode: Callable[[Any], T] | None = None) -> None: ...


def _check_group(trajectories: Sequence[Any], scores: Sequence[float]) -> list[float]:
    if len(trajectories) != len(scores):
        raise ReplayError(f"{len(trajectories)} trajectories but {len(scores)} scores")
    if len(scores) == 0:
        raise ReplayError("empty group")
    checked = [float(s) for s in scores]
    bad = [s for s in checked if not math.isfinite(s)]
    if bad:
        raise ReplayError(f"non-finite scores: {bad}")
    return checked


def _rng_state(rng: random.Random) -> list[Any]:
    version, internal, gauss_next = rng.getstate()
    return [version, list(internal), gauss_next]


def _rng_from_state(state: Sequence[Any]) -> random.Random:
    version, internal, gauss_next = state
    rng = random.Random()
    rng.setstate((int(version), tuple(int(x) for x in internal), gauss_next))
    return rng


class SuccessReplay(Generic[T]):
    """ARPO's per-task replay buffer of successful trajectories.

    Args:
        capacity_per_task: most successes kept per task; the oldest is evicted first (ARPO: 8).
        success_threshold: a trajectory is a success when its evaluator score is strictly above this (ARPO: 0.1).
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
        success_threshold: float = 0.1,
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
        self.all_failed_std = all_failed_std
        self.all_failed_mean = all_failed_mean
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
        checked = _check_group(trajectories, scores)
        if not self.enabled:
            return 0
        stored = 0
        for trajectory, score in zip(trajectories, checked):
            if score > self.success_threshold:
                fifo = self._buffers.setdefault(task_id, deque(maxlen=self.capacity_per_task))
                fifo.append((trajectory, score))
                stored += 1
        return stored

    def inject(
        self,
        task_id: str,
        trajectories: Sequence[T],
        scores: Sequence[float],
        *,
        version: int = 0,
        rewards: Sequence[float] | None = None,
    ) -> Injection[T]:
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
        checked = _check_group(trajectories, scores)
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

    def maybe_inject(
        self, task_id: str, trajectories: Sequence[T], scores: Sequence[float]
    ) -> tuple[list[T], list[float], bool]:
        """:meth:`inject` as a tuple ``(trajectories, scores, injected)`` (element 0 replaced when injected)."""
        result = self.inject(task_id, trajectories, scores)
        return result.trajectories, result.scores, result.injected

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
            "rng": _rng_state(self._rng),
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
            rng = _rng_from_state(state["rng"])
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


# ---------------------------------------------------------------------------------------------- prioritized


def trajectory_version(trajectory: Any) -> int:
    """Policy version that sampled a trajectory: the oldest version among its tokens (``step.versions``), or its
    ``assigned_version`` when it has no generated token. Works on :class:`arpo_async.messages.Trajectory`."""
    versions = [v for step in trajectory.steps for v in step.versions]
    return int(min(versions)) if versions else int(getattr(trajectory, "assigned_version", 0))


def trajectory_length(trajectory: Any) -> int:
    """Episode length in policy steps (``len(trajectory.steps)``), at least 1."""
    return max(1, len(trajectory.steps))


def encode_trajectory(trajectory: Any) -> list[bytes]:
    """A Trajectory as wire frames (``arpo_async.codec.encode``): a msgpack-friendly list of bytes, for
    ``state_dict(encode=encode_trajectory)``."""
    from arpo_async import codec

    return codec.encode(trajectory)


def decode_trajectory(frames: Sequence[bytes], *, max_bytes: int = 1 << 31) -> Any:
    """Inverse of :func:`encode_trajectory`, for ``load_state_dict(decode=decode_trajectory)``.

    Raises:
        ReplayError: the frames do not decode to a Trajectory.
    """
    from arpo_async import codec
    from arpo_async.messages import Trajectory

    try:
        message = codec.decode([bytes(f) for f in frames], max_bytes=max_bytes)
    except codec.WireError as error:
        raise ReplayError(f"stored trajectory does not decode: {error}") from error
    if not isinstance(message, Trajectory):
        raise ReplayError(f"stored entry decodes to {type(message).__name__}, not a Trajectory")
    return message


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
    rule (:func:`learner.grpo.is_all_failed`), and, when ``inject_below > 0``, every group whose success rate
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
        success_threshold: a trajectory is a success when its score is strictly above this (ARPO: 0.1).
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
        success_threshold: float = 0.1,
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

    def priority(self, task_id: str, entry_index: int) -> float:
        """p(e) of the task's ``entry_index``-th stored success (insertion order) at the latest version seen."""
        return self._task_factor(task_id) * self._entry_factor(self._tasks[task_id][entry_index])

    def priorities(self, task_id: str) -> list[float]:
        """p(e) of each of the task's stored successes, in insertion order (empty when none)."""
        return [self.priority(task_id, i) for i in range(len(self._tasks.get(task_id, ())))]

    # ------------------------------------------------------------------ inject / add

    def inject(
        self,
        task_id: str,
        trajectories: Sequence[T],
        scores: Sequence[float],
        *,
        version: int = 0,
        rewards: Sequence[float] | None = None,
    ) -> Injection[T]:
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
        checked = _check_group(trajectories, scores)
        rank = checked if rewards is None else _check_group(trajectories, rewards)
        self._now = max(self._now, int(version))
        out = list(trajectories)
        entries = self._tasks.get(task_id)
        all_failed = is_all_failed(checked, std_threshold=self.all_failed_std, mean_threshold=self.all_failed_mean)
        rate = sum(score > self.success_threshold for score in checked) / len(checked)
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
        checked = _check_group(trajectories, scores)
        self._now = max(self._now, int(version))
        successes = [score > self.success_threshold for score in checked]
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
            encode: applied to each stored trajectory (e.g. :func:`encode_trajectory`); identity if None.
        """
        return {
            "schema": _PRIORITIZED_SCHEMA,
            "mode": "prioritized",
            "rng": _rng_state(self._rng),
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
            rng = _rng_from_state(state["rng"])
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


def make_replay(
    mode: str,
    *,
    capacity_per_task: int = 8,
    max_total: int = 256,
    seed: int = 0,
    inject_below: float = 0.0,
    alpha: float = 1.0,
    tau: float = 8.0,
    beta: float = 0.5,
) -> SuccessReplay[Any] | PrioritizedReplay[Any]:
    """The replay buffer for ``mode``: "arpo" (:class:`SuccessReplay`, ARPO-exact), "prioritized"
    (:class:`PrioritizedReplay`; ``max_total``, ``inject_below``, ``alpha``, ``tau``, ``beta`` apply to it only)
    or "off" (a disabled :class:`SuccessReplay`: stores and injects nothing).

    Raises:
        ReplayError: unknown mode or a parameter out of range.
    """
    if mode == "arpo":
        return SuccessReplay(capacity_per_task=capacity_per_task, seed=seed)
    if mode == "off":
        return SuccessReplay(capacity_per_task=capacity_per_task, enabled=False, seed=seed)
    if mode == "prioritized":
        return PrioritizedReplay(capacity_per_task, max_total, inject_below=inject_below, alpha=alpha, tau=tau,
                                 beta=beta, seed=seed)
    raise ReplayError(f"unknown replay mode {mode!r}; expected one of {REPLAY_MODES}")
