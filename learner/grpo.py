"""GRPO math for the learner: rewards, group-relative advantages, the all-failed rule, the clipped token loss.

Pure functions with no state and no I/O. Reward and group statistics use numpy; the loss uses torch so it can
be back-propagated. Every formula names the public code it was checked against:

- ARPO (dvlab-research/ARPO, a fork of hiyouga/EasyR1): ``verl/trainer/ray_trainer.py`` (reward =
  evaluator score + 0.5 x format reward; the all-failed rule in ``apply_replay``),
  ``verl/trainer/gui_agent.py`` (``EnvWorker.step``: format reward 0.0 when the reply parses, -1.0 when it
  does not), ``verl/trainer/core_algos.py`` (``compute_grpo_outcome_advantage``, ``compute_policy_loss``).
- DAPO (arXiv 2503.14476): clip-higher and token-level loss averaging over the whole batch.
- Dual-clip PPO (arXiv 1912.09729): a lower bound ``-c * A`` on the per-token loss when A < 0.
- Dr. GRPO (arXiv 2503.20783): advantages without the division by the group's standard deviation.

Invariants: a group's advantages sum to zero (up to rounding); a group whose rewards are all equal gets
all-zero advantages and therefore carries no gradient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

__all__ = [
    "GrpoInputError",
    "clipped_token_loss",
    "compute_reward",
    "group_advantages",
    "is_all_failed",
    "is_zero_variance",
]

# ratio = exp(log pi - log pi_old) is computed from a log-ratio clamped to this range so that a wildly
# off-policy token cannot overflow to inf/nan (EasyR1 core_algos.compute_policy_loss clamps to [-20, 20]).
_LOG_RATIO_LIMIT = 20.0


class GrpoInputError(ValueError):
    """Raised when a GRPO function receives input it cannot interpret (empty group, nan, mismatched shapes)."""


def _as_finite_1d(values: Sequence[float], what: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise GrpoInputError(f"{what} must be a flat sequence of numbers, got shape {array.shape}")
    if array.size == 0:
        raise GrpoInputError(f"{what} is empty")
    if not np.all(np.isfinite(array)):
        raise GrpoInputError(f"{what} contains nan or inf: {array.tolist()}")
    return array


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


def group_advantages(
    rewards: Sequence[float], *, eps: float = 1e-6, scale_by_std: bool = True, ddof: int = 1
) -> np.ndarray:
    """Group-relative advantages of one group (all rollouts of one task).

    ``A_i = (r_i - mean(r)) / (std(r) + eps)``; with ``scale_by_std=False`` (Dr. GRPO) ``A_i = r_i - mean(r)``.
    The caller broadcasts ``A_i`` to every generated token of rollout i.

    Which standard deviation: ARPO computes advantages with EasyR1's
    ``core_algos.compute_grpo_outcome_advantage``, which calls ``torch.std`` -- the unbiased (sample)
    standard deviation, divisor ``G - 1``. That is the default here (``ddof=1``); verl's function of the same
    name does the same. ``ddof=0`` gives the population standard deviation (divisor ``G``), which ARPO uses
    only in its all-failed rule (see :func:`is_all_failed`). Example, rewards [1, 0, 0, 0]: mean 0.25,
    unbiased std 0.5, advantages [1.5, -0.5, -0.5, -0.5].

    Args:
        rewards: the group's rewards, shape (G,), G >= 2.
        eps: added to the standard deviation; keeps an all-equal group at exactly zero advantages.
        scale_by_std: divide by the standard deviation (GRPO, ARPO) or not (Dr. GRPO).
        ddof: delta degrees of freedom of the standard deviation: 1 (ARPO/EasyR1/verl) or 0 (population).

    Returns:
        float64 array of shape (G,), summing to ~0; all zeros when all rewards are equal.

    Raises:
        GrpoInputError: fewer than two rewards, a non-finite reward, ``ddof`` not 0 or 1, or ``eps`` < 0.
    """
    array = _as_finite_1d(rewards, "rewards")
    if array.size < 2:
        raise GrpoInputError(f"a GRPO group needs at least 2 rollouts, got {array.size}")
    if ddof not in (0, 1):
        raise GrpoInputError(f"ddof must be 0 or 1, got {ddof}")
    if not eps >= 0.0:
        raise GrpoInputError(f"eps must be >= 0, got {eps}")
    centred = array - array.mean()
    if not scale_by_std:
        return centred
    std = float(array.std(ddof=ddof))
    if std == 0.0:
        # All rewards equal: no signal. Returned explicitly so eps=0 cannot turn 0/0 into nan.
        return np.zeros_like(array)
    return centred / (std + eps)


def is_zero_variance(rewards: Sequence[float], *, atol: float = 1e-9) -> bool:
    """Whether all rewards of a group are equal (max - min <= ``atol``): such a group has zero advantages
    under GRPO and Dr. GRPO alike and contributes no gradient (DAPO's dynamic-sampling filter drops them).

    Args:
        rewards: the group's rewards, shape (G,), G >= 1.
        atol: absolute tolerance on the spread, in reward units.

    Raises:
        GrpoInputError: empty or non-finite rewards.
    """
    array = _as_finite_1d(rewards, "rewards")
    return bool(array.max() - array.min() <= atol)


def is_all_failed(scores: Sequence[float], *, std_threshold: float = 0.05, mean_threshold: float = 0.2) -> bool:
    """ARPO's all-failed rule: a group qualifies for a replayed success when
    ``std(scores) < std_threshold and mean(scores) < mean_threshold``.

    Source: ARPO ``ray_trainer.py`` ``apply_replay``: ``np.std(cur_rewards) < 0.05 and np.mean(cur_rewards) <
    0.2``, applied to the evaluator scores (``eval_results``), not to the format-adjusted rewards. ``np.std``
    is the population standard deviation (divisor G), which is what is used here.

    Args:
        scores: the group's evaluator scores, shape (G,), G >= 1.
        std_threshold: the spread below which the group counts as uniform.
        mean_threshold: the mean below which a uniform group counts as failed.

    Raises:
        GrpoInputError: empty or non-finite scores.
    """
    array = _as_finite_1d(scores, "scores")
    return bool(array.std(ddof=0) < std_threshold and array.mean() < mean_threshold)


def clipped_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.3,
    dual_clip: float = 3.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level PPO clipped surrogate with clip-higher and dual-clip, summed over the tokens of one rollout.

    With ``rho = exp(logprobs - old_logprobs)`` (log-ratio clamped to [-20, 20]) and per token::

        l1 = -A * rho
        l2 = -A * clip(rho, 1 - eps_low, 1 + eps_high)            # clip-higher: eps_high > eps_low (DAPO)
        l  = max(l1, l2)                                           # A >= 0
        l  = min(max(l1, l2), -A * dual_clip)                      # A <  0 (dual-clip PPO)

    Source: EasyR1 / ARPO ``core_algos.compute_policy_loss`` (default loss type); ARPO's run uses eps_low 0.2,
    eps_high 0.3, dual_clip 3.0. No KL term, no entropy bonus.

    The SUM over tokens is returned (not the mean) so the caller can divide by the token count of the whole
    batch: DAPO's token-level averaging, where every generated token of the batch weighs the same.

    Args:
        logprobs: log pi_theta of the sampled tokens, shape (T,), float, carries the gradient.
        old_logprobs: log-probs of the policy the ratio is taken against, shape (T,); for one epoch on
            sampler data this is the behaviour policy (the sampler's log-probs). No gradient flows through it.
        advantages: per-token advantages, shape (T,) (a rollout's advantage broadcast to its tokens).
        eps_low: lower clip range, 0 <= eps_low < 1.
        eps_high: upper clip range, >= 0.
        dual_clip: dual-clip constant c > 1; bounds the loss of a token with A < 0 by ``-c * A``.

    Returns:
        ``(loss_sum, stats)``: ``loss_sum`` is a 0-dim tensor (the sum of per-token losses; 0 for T = 0);
        ``stats`` holds python floats: ``tokens`` (T), ``clip_frac`` (fraction of tokens where the clipped term
        was taken, i.e. whose gradient is cut by the trust region), ``dual_clip_frac`` (fraction bounded by the
        dual clip), ``ratio_mean`` (mean rho), ``approx_kl`` (mean of old_logprobs - logprobs). Fractions and
        means are 0 when T = 0.

    Raises:
        GrpoInputError: shapes differ or are not 1-D, or a clip parameter is out of range.
    """
    if logprobs.ndim != 1 or logprobs.shape != old_logprobs.shape or logprobs.shape != advantages.shape:
        raise GrpoInputError(
            "logprobs, old_logprobs and advantages must be 1-D of equal length, got shapes "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(advantages.shape)}"
        )
    if not 0.0 <= eps_low < 1.0:
        raise GrpoInputError(f"eps_low must be in [0, 1), got {eps_low}")
    if not eps_high >= 0.0:
        raise GrpoInputError(f"eps_high must be >= 0, got {eps_high}")
    if not dual_clip > 1.0:
        raise GrpoInputError(f"dual_clip must be > 1, got {dual_clip}")

    old = old_logprobs.detach().to(logprobs.dtype)
    adv = advantages.detach().to(logprobs.dtype)
    log_ratio = torch.clamp(logprobs - old, -_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)

    loss_unclipped = -adv * ratio
    loss_clipped = -adv * clipped_ratio
    loss_dual = -adv * dual_clip
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    negative = adv < 0
    per_token = torch.where(negative, torch.minimum(loss_ppo, loss_dual), loss_ppo)
    loss_sum = per_token.sum()

    tokens = int(logprobs.numel())
    with torch.no_grad():
        if tokens == 0:
            stats = {"tokens": 0.0, "clip_frac": 0.0, "dual_clip_frac": 0.0, "ratio_mean": 0.0, "approx_kl": 0.0}
        else:
            clipped = loss_unclipped < loss_clipped
            dual = negative & (loss_ppo > loss_dual)
            stats = {
                "tokens": float(tokens),
                "clip_frac": float(clipped.double().mean()),
                "dual_clip_frac": float(dual.double().mean()),
                "ratio_mean": float(ratio.double().mean()),
                "approx_kl": float((-log_ratio).double().mean()),
            }
    return loss_sum, stats
