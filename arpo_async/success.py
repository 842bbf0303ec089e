"""The one definition of a successful episode, shared by the actors (Outcome.SUCCESS) and the learner.

Owns: :func:`is_success` and its default threshold. Every counter, selector and buffer that asks "was this
episode a success?" calls it with ``learner.success_threshold``: the actor's outcome (actors.episode), the
batch success rate (learner.algo.batcher), the task windows (learner.algo.task_selection), the task pre-pass
(learner.algo.prepass) and both replay buffers (learner.algo.replay); the success rates of metrics.jsonl, the progress
line and `arpo eval` reports count Outcome.SUCCESS, which the actor set with this same function.

Invariant: a success is an evaluator score strictly above the threshold, nowhere "at least".
"""

from __future__ import annotations

__all__ = ["DEFAULT_SUCCESS_THRESHOLD", "is_success"]

DEFAULT_SUCCESS_THRESHOLD = 0.1
"""ARPO's: its replay buffer keeps the trajectories whose evaluator score is above 0.1 (github.com/dvlab-research/ARPO,
``verl/trainer/ray_trainer.py`` ``apply_replay`` and ``replay_buffer.py``). OSWorld's metrics score most tasks 0 or
1 and some with a fraction (partial credit), which this counts as a success above 0.1."""


def is_success(score: float, threshold: float) -> bool:
    """Whether an episode with evaluator ``score`` succeeded: ``score > threshold`` (strictly; ARPO's rule).

    Args:
        score: the evaluator's score, unitless, usually in [0, 1].
        threshold: ``learner.success_threshold`` (:data:`DEFAULT_SUCCESS_THRESHOLD` unless configured); no
            default here, so that a caller cannot forget to pass the configured one.

    Returns:
        True for a success; False for any other score, NaN included.
    """
    return float(score) > threshold
