"""Rewards: what one trajectory is worth to the learner. The module to change for reward shaping.

Role: the "score" stage of the algorithm (learner.algo.batcher.Batcher.score) gives every trajectory it keeps the
reward :func:`compute_reward` returns, and so does the replay stage to a success it injects; the advantages stage
(learner.algo.advantages) compares the rewards within a group. Pure: no state, no I/O.
"""

from __future__ import annotations

import math

from learner.algo.grpo import GrpoInputError

__all__ = ["compute_reward"]


def compute_reward(score: float, format_ok: bool, *, format_weight: float = 0.5) -> float:
    """Reward of one trajectory: evaluator score plus a weighted format reward.

    ``reward = score + format_weight * format_reward`` with ``format_reward = 0.0`` when every reply of the
    episode parsed and ``-1.0`` when one did not (the unparseable reply also ends the episode).

    Source: ARPO ``ray_trainer.py`` (``rewards = eval_results + 0.5 * format_rewards``) and ``gui_agent.py``
    (``EnvWorker.step`` sets ``format_reward = 0.0`` after a successful parse, ``-1.0`` in the except branch).

    Args:
        score: the evaluator's score, a float (OSWorld scores lie in [0, 1]).
        format_ok: whether all replies of the episode parsed into actions.
        format_weight: weight of the format reward (ARPO: 0.5).

    Returns:
        The scalar reward, unitless; in [-0.5, 1] for ARPO's defaults and a score in [0, 1].

    Raises:
        GrpoInputError: ``score`` or ``format_weight`` is not a finite number.
    """
    if not math.isfinite(score):
        raise GrpoInputError(f"score must be finite, got {score!r}")
    if not math.isfinite(format_weight):
        raise GrpoInputError(f"format_weight must be finite, got {format_weight!r}")
    format_reward = 0.0 if format_ok else -1.0
    return float(score) + format_weight * format_reward
