"""Adaptive learning rate from the policy's KL per rollout batch (``learner.target_kl``).

With the gradient norm clipped (learner.grad_clip) and AdamW normalising every coordinate, each optimizer step
moves the policy by about the same amount whatever the batch says, so a nearly solved family, whose only
signal is the odd failure in a group of successes, still takes full steps. In the 3-step settings family that
moved the policy by up to 0.4 nats per token in one batch and threw a run from 0.88 back to 0.06. The remedy
is the PPO practice of sizing the step by the KL it causes: after each batch the learning rate is divided by
1.5 when the batch's KL was above twice the target and multiplied by 1.5 when it was below half of it, within
``[lr / 100, lr]`` (Heess et al., "Emergence of Locomotion Behaviours in Rich Environments", arXiv 1707.02286;
the "adaptive" schedule of rsl_rl's and rl_games' PPO, whose factor 1.5 and thresholds 2x and 0.5x this
keeps; the configured ``learner.lr`` is the ceiling here, not a starting point).

Role: pure functions; learner.train.update_control measures the KL and applies the rate.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["LR_FACTOR", "LR_FLOOR", "adapt_lr", "batch_kl"]

LR_FACTOR = 1.5
"""The learning rate is divided or multiplied by this after a batch whose KL is out of band (rsl_rl, rl_games)."""
LR_FLOOR = 0.01
"""The lowest learning rate, as a share of ``learner.lr``."""


def batch_kl(before: Sequence[Sequence[float]], after: Sequence[Sequence[float]],
             masks: Sequence[Sequence[bool] | None] | None = None) -> float:
    """KL(pi_before || pi_after) per token of a batch, from the log-probs of its tokens before and after the
    update: the mean of ``(r - 1) - log r`` with ``r = pi_after / pi_before`` (the "k3" estimator, non-negative
    and unbiased when the tokens were sampled from pi_before; J. Schulman, "Approximating KL Divergence", 2020).

    Args:
        before, after: per sample, the log-probs (nats) of its output tokens; equal lengths sample by sample.
        masks: per sample, None or which tokens count (the trained tokens, TrainSample.loss_mask).
    Returns:
        the mean over the counted tokens (nats, >= 0); 0.0 when none counts.
    Raises:
        ValueError: lengths that do not match, or a non-finite log-prob among the counted tokens.
    """
    if len(before) != len(after) or (masks is not None and len(masks) != len(before)):
        raise ValueError(f"{len(before)} samples before the update, {len(after)} after, "
                         f"{'no' if masks is None else len(masks)} masks")
    total, count = 0.0, 0
    for i, (b, a) in enumerate(zip(before, after)):
        b, a = np.asarray(b, np.float64), np.asarray(a, np.float64)
        if b.shape != a.shape:
            raise ValueError(f"sample {i}: {b.size} log-probs before the update, {a.size} after")
        if masks is not None and masks[i] is not None:
            keep = np.asarray(masks[i], bool)
            b, a = b[keep], a[keep]
        if not (np.isfinite(b).all() and np.isfinite(a).all()):
            raise ValueError(f"sample {i}: a log-prob is not finite")
        log_r = a - b
        total += float(np.sum(np.expm1(log_r) - log_r))
        count += log_r.size
    return total / count if count else 0.0


def adapt_lr(lr: float, kl: float, target: float, lr_max: float) -> float:
    """The learning rate for the next batch, after a batch whose KL was ``kl``.

    ``lr / 1.5`` if ``kl > 2 target``, ``lr * 1.5`` if ``kl < target / 2``, else ``lr``; always within
    ``[LR_FLOOR * lr_max, lr_max]``. ``target <= 0`` returns ``lr`` unchanged (the schedule is off).
    """
    if target <= 0:
        return lr
    if kl > 2 * target:
        lr /= LR_FACTOR
    elif kl < target / 2:
        lr *= LR_FACTOR
    return min(lr_max, max(LR_FLOOR * lr_max, lr))
