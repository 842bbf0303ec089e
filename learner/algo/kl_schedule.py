"""The KL control of a rollout batch's update: the KL it caused sets the next learning rate (``learner.target_kl``)
and bounds the update kept (``learner.max_kl``).

Adaptive learning rate (:func:`adapt_lr`).

With the gradient norm clipped (learner.grad_clip) and AdamW normalising every coordinate, each optimizer step
moves the policy by about the same amount whatever the batch says, so a nearly solved family, whose only
signal is the odd failure in a group of successes, still takes full steps. In the 3-step settings family that
moved the policy by up to 0.4 nats per token in one batch and threw a run from 0.88 back to 0.06. The remedy
is the PPO practice of sizing the step by the KL it causes: after each batch the learning rate is divided by
1.5 when the batch's KL was above twice the target and multiplied by 1.5 when it was below half of it, within
``[lr / 100, lr]`` (Heess et al., "Emergence of Locomotion Behaviours in Rich Environments", arXiv 1707.02286;
the "adaptive" schedule of rsl_rl's and rl_games' PPO, whose factor 1.5 and thresholds 2x and 0.5x this
keeps; the configured ``learner.lr`` is the ceiling here, not a starting point).

Bounded update (:class:`UpdateControl`, ``learner.max_kl``): TRPO's backtracking line search (Schulman et al.,
"Trust Region Policy Optimization", arXiv 1502.05477, section 6 and appendix C) applied to the step the optimizer
took: an update whose KL is above ``max_kl`` is halved, parameters to the midpoint of the batch's start and where
they are, and the batch scored again, until it is within the bound or :data:`MAX_HALVINGS` halvings have been made.
The optimizer's moments keep the batch's gradients.

Role: the whole KL control, in one place. :func:`batch_kl` and :func:`adapt_lr` are pure; :class:`UpdateControl`
holds the batch's starting parameters and is driven by learner.train.trainer.Trainer.train_batch on every rank (the
scoring pass is a collective under FSDP2, and every rank reaches the same KL, so the same rate and the same
halvings). It takes the parameters and a scoring function as arguments, so nothing here imports the trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from arpo_async.config import LearnerConfig

__all__ = ["LR_FACTOR", "LR_FLOOR", "MAX_HALVINGS", "UpdateControl", "adapt_lr", "batch_kl"]

LR_FACTOR = 1.5
"""The learning rate is divided or multiplied by this after a batch whose KL is out of band (rsl_rl, rl_games)."""
LR_FLOOR = 0.01
"""The lowest learning rate, as a share of ``learner.lr``."""
MAX_HALVINGS = 6
"""learner.max_kl: at most this many halvings of a batch's update (down to 1/64 of it) before it is kept as is."""


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


class UpdateControl:
    """One batch's KL control: create it before the batch's optimizer steps, call :meth:`after` once they are done.

    Args:
        config: the learner section (target_kl, max_kl and lr, the rate's ceiling).
        params: the trained parameters; with ``max_kl > 0`` a copy of them is kept (one model's float32 memory).
        score: the log-probs of the batch's output tokens under the current weights, one list per sample
            (Trainer.compute_logprobs on the batch).
    """

    def __init__(self, config: LearnerConfig, params: Sequence[torch.Tensor],
                 score: Callable[[], list[list[float]]]) -> None:
        self.config, self.params, self.score = config, list(params), score
        self.start = [p.detach().clone() for p in self.params] if config.max_kl > 0 else None

    def after(self, proximal: Sequence[Sequence[float]], masks: Sequence[Sequence[bool] | None],
              lr: float) -> tuple[float, dict[str, float]]:
        """The next batch's learning rate and ``{"policy_kl", "step_scale"}`` (the KL per trained token of the
        update kept, nats; the share of the optimizer's update kept). ``proximal``: the batch's log-probs before
        its steps; ``masks``: the samples' loss masks; ``lr``: the rate its steps used."""
        kl = batch_kl(proximal, self.score(), masks)
        next_lr = adapt_lr(lr, kl, self.config.target_kl, self.config.lr)
        scale = 1.0
        for _ in range(MAX_HALVINGS if self.start is not None else 0):
            if kl <= self.config.max_kl:
                break
            self._halve()
            scale /= 2
            kl = batch_kl(proximal, self.score(), masks)
        return next_lr, {"policy_kl": kl, "step_scale": scale}

    @torch.no_grad()
    def _halve(self) -> None:
        for param, start in zip(self.params, self.start):
            param.add_(start).mul_(0.5)
