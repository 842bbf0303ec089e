"""GRPO math for the learner: group-relative advantages, the all-failed rule, the clipped token loss (the reward
is learner.algo.rewards').

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
    "CORRECTION_MODES",
    "GrpoInputError",
    "clipped_token_loss",
    "corrected_token_loss",
    "correction_weights",
    "group_advantages",
    "is_all_failed",
    "is_zero_variance",
]

CORRECTION_MODES: tuple[str, ...] = ("arpo", "decoupled", "tis", "behaviour")
"""Off-policy correction modes of :func:`corrected_token_loss` (see its docstring for each formula)."""

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


def _check_clip(eps_low: float, eps_high: float, dual_clip: float) -> None:
    if not 0.0 <= eps_low < 1.0:
        raise GrpoInputError(f"eps_low must be in [0, 1), got {eps_low}")
    if not eps_high >= 0.0:
        raise GrpoInputError(f"eps_high must be >= 0, got {eps_high}")
    if not dual_clip > 1.0:
        raise GrpoInputError(f"dual_clip must be > 1, got {dual_clip}")


def _ppo_per_token(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
    eps_low: float, eps_high: float, dual_clip: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token clipped-surrogate loss (shape (T,)) and its PPO statistics; see :func:`clipped_token_loss`."""
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
    return per_token, stats


def _check_1d_equal(**tensors: torch.Tensor | None) -> None:
    given = {name: t for name, t in tensors.items() if t is not None}
    shapes = {name: tuple(t.shape) for name, t in given.items()}
    first = next(iter(given.values()))
    if first.ndim != 1 or any(t.shape != first.shape for t in given.values()):
        names = ", ".join(given)
        raise GrpoInputError(f"{names} must be 1-D of equal length, got shapes {shapes}")


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
        old_logprobs: log-probs of the policy the ratio is taken against, shape (T,). No gradient flows through
            it. :func:`corrected_token_loss` chooses it (proximal or behaviour) by correction mode.
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
    _check_1d_equal(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    _check_clip(eps_low, eps_high, dual_clip)
    per_token, stats = _ppo_per_token(logprobs, old_logprobs, advantages, eps_low, eps_high, dual_clip)
    return per_token.sum(), stats


def correction_weights(
    proximal_logprobs: torch.Tensor | None,
    behaviour_logprobs: torch.Tensor | None,
    *,
    mode: str,
    cap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token off-policy correction weights ``w`` and which tokens the cap acted on (no gradient).

    With ``rho_b = pi_prox / pi_behav = exp(proximal - behaviour)`` (log-ratio clamped to [-20, 20]):

    - ``"arpo"`` and ``"behaviour"``: ``w = 1`` (no correction; nothing capped).
    - ``"decoupled"`` (AReaL decoupled PPO): ``w = rho_b`` where ``rho_b <= cap``, and ``w = 0`` where
      ``rho_b > cap``: AReaL FILTERS such tokens out of the loss rather than truncating them
      (``areal/utils/functional.py`` ``ppo_actor_loss_fn``: ``behav_mask = behav_imp_weight <= cap``;
      ``behav_imp_weight_cap`` is None by default there; AReaL's example configs use 5.0, our default).
    - ``"tis"`` (truncated importance sampling, slime ``--use-tis``; the same weight as verl's TIS and the
      "off-policy RL" blog by F. Yao et al.): ``w = clamp(rho_b, tis_clip_low, tis_clip) = min(rho_b, cap)``
      with slime's defaults ``tis_clip_low = 0`` and ``tis_clip = 2``.

    ``capped`` marks tokens whose weight the cap changed (``rho_b > cap``) in "decoupled" and "tis".

    Args:
        proximal_logprobs: log pi_prox (the pre-update policy) of each sampled token, shape (T,); may be None for
            "arpo" and "behaviour".
        behaviour_logprobs: log pi_behav (the sampler's log-probs when the token was generated), shape (T,);
            may be None for "arpo" and "behaviour".
        mode: one of :data:`CORRECTION_MODES`.
        cap: the weight cap C > 0 ("decoupled": filter threshold; "tis": truncation); unused otherwise.

    Returns:
        ``(w, capped)``: float tensor and bool tensor of shape (T,), detached.

    Raises:
        GrpoInputError: unknown mode, cap <= 0, a missing or mis-shaped log-prob tensor.
    """
    if mode not in CORRECTION_MODES:
        raise GrpoInputError(f"unknown correction mode {mode!r}; expected one of {CORRECTION_MODES}")
    if mode in ("arpo", "behaviour"):
        ref = proximal_logprobs if proximal_logprobs is not None else behaviour_logprobs
        if ref is None:
            raise GrpoInputError("correction_weights needs at least one log-prob tensor to know T")
        return torch.ones_like(ref, dtype=torch.float64).detach(), torch.zeros(ref.shape, dtype=torch.bool)
    if not (cap > 0 and math.isfinite(cap)):
        raise GrpoInputError(f"the correction cap must be a finite number > 0, got {cap}")
    if proximal_logprobs is None or behaviour_logprobs is None:
        raise GrpoInputError(f"correction mode {mode!r} needs both proximal and behaviour log-probs")
    _check_1d_equal(proximal_logprobs=proximal_logprobs, behaviour_logprobs=behaviour_logprobs)
    with torch.no_grad():
        log_rho = torch.clamp(
            proximal_logprobs.detach().double() - behaviour_logprobs.detach().double(),
            -_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT,
        )
        rho = torch.exp(log_rho)
        capped = rho > cap
        if mode == "decoupled":
            weights = torch.where(capped, torch.zeros_like(rho), rho)
        else:  # tis
            weights = torch.clamp(rho, max=cap)
    return weights, capped


def corrected_token_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor | None,
    behaviour_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    *,
    mode: str,
    eps_low: float = 0.2,
    eps_high: float = 0.3,
    dual_clip: float = 3.0,
    cap: float = 5.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped token loss with an off-policy correction, summed over the tokens of one rollout step.

    Per token, ``loss = w * l_ppo(pi_theta / pi_old, A)`` with ``l_ppo`` the clipped surrogate of
    :func:`clipped_token_loss` (clip-higher, dual-clip) and ``w`` from :func:`correction_weights`:

    ============  ==================  =======================================  =======================================
    mode          pi_old (clipped)    w                                        source
    ============  ==================  =======================================  =======================================
    "arpo"        pi_prox             1                                        ARPO/EasyR1: old log-probs recomputed
                                                                               by the current policy for the whole
                                                                               batch, replayed rows included
    "decoupled"   pi_prox             pi_prox/pi_behav, 0 where > cap          AReaL decoupled PPO (arXiv 2505.24298
                                                                               eq. 5; ``ppo_actor_loss_fn``)
    "tis"         pi_prox             min(pi_prox/pi_behav, cap)               slime ``--use-tis`` (tis_clip 2,
                                                                               tis_clip_low 0); verl TIS
    "behaviour"   pi_behav            1                                        plain PPO on sampler log-probs
                                                                               (no recompute; AReaL with
                                                                               recompute_logprob=False)
    ============  ==================  =======================================  =======================================

    pi_prox is the policy before this optimizer step (no gradient); pi_behav the sampler's log-probs as recorded
    with each token (for a replayed trajectory, those of the policy that sampled it, possibly many versions ago).
    With one optimizer step per batch pi_prox equals pi_theta's values at the step, so the ratio is 1 and the
    clip is inactive; the clip acts when a batch is split into several optimizer steps.

    Args:
        logprobs: log pi_theta, shape (T,), carries the gradient.
        proximal_logprobs: log pi_prox, shape (T,); required except in "behaviour" mode.
        behaviour_logprobs: log pi_behav, shape (T,); required except in "arpo" mode.
        advantages: per-token advantages, shape (T,).
        mode: one of :data:`CORRECTION_MODES`.
        eps_low, eps_high, dual_clip: as in :func:`clipped_token_loss`.
        cap: correction weight cap ("decoupled": AReaL example configs 5.0; "tis": slime 2.0).

    Returns:
        ``(loss_sum, stats)``: the weighted per-token losses summed (0-dim tensor); ``stats`` has
        :func:`clipped_token_loss`'s keys plus ``is_weight_mean``, ``is_weight_max``, ``is_capped_frac``
        (fraction of tokens the cap filtered or truncated) and ``behaviour_kl`` (mean of behaviour - proximal
        log-probs, an estimate of KL(pi_behav || pi_prox); 0 when either is missing). All 0 when T = 0.

    Raises:
        GrpoInputError: unknown mode, missing or mis-shaped log-probs, or a clip or cap parameter out of range.
    """
    if mode not in CORRECTION_MODES:
        raise GrpoInputError(f"unknown correction mode {mode!r}; expected one of {CORRECTION_MODES}")
    old = behaviour_logprobs if mode == "behaviour" else proximal_logprobs
    if old is None:
        raise GrpoInputError(f"correction mode {mode!r} needs {'behaviour' if mode == 'behaviour' else 'proximal'}"
                             " log-probs")
    _check_1d_equal(logprobs=logprobs, proximal_logprobs=proximal_logprobs,
                    behaviour_logprobs=behaviour_logprobs, advantages=advantages)
    _check_clip(eps_low, eps_high, dual_clip)
    weights, capped = correction_weights(proximal_logprobs, behaviour_logprobs, mode=mode, cap=cap)
    per_token, stats = _ppo_per_token(logprobs, old, advantages, eps_low, eps_high, dual_clip)
    loss_sum = (per_token * weights.to(per_token.dtype)).sum()
    tokens = int(logprobs.numel())
    with torch.no_grad():
        if tokens == 0:
            stats.update(is_weight_mean=0.0, is_weight_max=0.0, is_capped_frac=0.0, behaviour_kl=0.0)
        else:
            kl = 0.0
            if proximal_logprobs is not None and behaviour_logprobs is not None:
                kl = float((behaviour_logprobs.detach().double() - proximal_logprobs.detach().double()).mean())
            stats.update(
                is_weight_mean=float(weights.mean()),
                is_weight_max=float(weights.max()),
                is_capped_frac=float(capped.double().mean()),
                behaviour_kl=kl,
            )
    return loss_sum, stats
