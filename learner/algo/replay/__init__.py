"""Success replay buffers: ARPO's per-task FIFO (exact), a prioritized variant, and an off switch.

Both buffers store whole successful trajectories per task and inject one into a group of the same task before
advantages are computed, so that a group the policy failed entirely still carries a learning signal. They
share one interface (:class:`ReplayBuffer`), used by :class:`learner.algo.batcher.Batcher` in this order per complete
group: ``inject(...)`` then ``add_group(...)`` with the ORIGINAL (un-injected) trajectories, so an injected
trajectory is never stored twice and a success is replayed from the next group of its task on, never into its own
group. :func:`make_replay` builds one by mode name: "arpo", "prioritized" or "off".

Modules: :mod:`learner.algo.replay.buffer` (the common interface, :class:`Injection`, :class:`ReplayError`),
:mod:`learner.algo.replay.arpo` (:class:`SuccessReplay`: ARPO's rule, exact; also the "off" switch) and
:mod:`learner.algo.replay.prioritized` (:class:`PrioritizedReplay`). This package's own code is only
:func:`make_replay`; it re-exports the public names, so callers import from ``learner.algo.replay``.

State: ``state_dict`` / ``load_state_dict`` give plain dicts, lists, strings and numbers (msgpack-friendly when
the ``encode`` hook makes the trajectories so: learner.train.checkpoint encodes each stored
:class:`arpo_async.messages.Trajectory` as wire-codec frames), including the RNG state and counters, so a resumed
learner continues the same draws.
"""

from __future__ import annotations

from typing import Any

from arpo_async.success import DEFAULT_SUCCESS_THRESHOLD
from learner.algo.replay.arpo import SuccessReplay
from learner.algo.replay.buffer import Injection, ReplayBuffer, ReplayError
from learner.algo.replay.prioritized import PrioritizedReplay, trajectory_length, trajectory_version

__all__ = [
    "REPLAY_MODES",
    "Injection",
    "PrioritizedReplay",
    "ReplayBuffer",
    "ReplayError",
    "SuccessReplay",
    "make_replay",
    "trajectory_length",
    "trajectory_version",
]

REPLAY_MODES: tuple[str, ...] = ("arpo", "prioritized", "off")
"""Replay modes accepted by :func:`make_replay`."""


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
    success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
) -> SuccessReplay[Any] | PrioritizedReplay[Any]:
    """The replay buffer for ``mode``: "arpo" (:class:`SuccessReplay`, ARPO-exact), "prioritized"
    (:class:`PrioritizedReplay`; ``max_total``, ``inject_below``, ``alpha``, ``tau``, ``beta`` apply to it only)
    or "off" (a disabled :class:`SuccessReplay`: stores and injects nothing). Both store the trajectories scored
    above ``success_threshold`` (:func:`arpo_async.success.is_success`).

    Raises:
        ReplayError: unknown mode or a parameter out of range.
    """
    if mode == "arpo":
        return SuccessReplay(capacity_per_task=capacity_per_task, success_threshold=success_threshold, seed=seed)
    if mode == "off":
        return SuccessReplay(capacity_per_task=capacity_per_task, enabled=False, seed=seed)
    if mode == "prioritized":
        return PrioritizedReplay(capacity_per_task, max_total, success_threshold=success_threshold,
                                 inject_below=inject_below, alpha=alpha, tau=tau, beta=beta, seed=seed)
    raise ReplayError(f"unknown replay mode {mode!r}; expected one of {REPLAY_MODES}")
