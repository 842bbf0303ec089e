"""Reference tests for learner.algo.grpo: hand-computed numbers and a plain-loop reference for the loss."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from learner.algo.grpo import (
    CORRECTION_MODES,
    GrpoInputError,
    clipped_token_loss,
    corrected_token_loss,
    correction_weights,
    group_advantages,
    is_all_failed,
    is_zero_variance,
)
from learner.algo.rewards import compute_reward

# ---------------------------------------------------------------- rewards


def test_reward_is_score_when_the_reply_parses():
    assert compute_reward(1.0, True) == 1.0
    assert compute_reward(0.0, True) == 0.0


def test_reward_subtracts_half_when_the_reply_does_not_parse():
    assert compute_reward(0.0, False) == -0.5
    assert compute_reward(1.0, False) == 0.5
    assert compute_reward(0.4, False, format_weight=1.0) == pytest.approx(-0.6)


def test_reward_rejects_nan_score():
    with pytest.raises(GrpoInputError):
        compute_reward(float("nan"), True)


# ---------------------------------------------------------------- advantages


def test_advantages_one_success_in_four_unbiased_std():
    # mean 0.25; unbiased std = sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    adv = group_advantages([1, 0, 0, 0])
    expected = np.array([0.75, -0.25, -0.25, -0.25]) / (0.5 + 1e-6)
    np.testing.assert_allclose(adv, expected, rtol=0, atol=1e-12)
    np.testing.assert_allclose(adv, [1.5, -0.5, -0.5, -0.5], atol=1e-5)


def test_advantages_one_success_in_four_population_std():
    # population std = sqrt(0.75 / 4) = sqrt(3) / 4
    adv = group_advantages([1, 0, 0, 0], ddof=0)
    np.testing.assert_allclose(adv, [math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)], atol=1e-5)


def test_advantages_dr_grpo_drops_the_std_division():
    np.testing.assert_allclose(group_advantages([1, 0, 0, 0], scale_by_std=False), [0.75, -0.25, -0.25, -0.25])


@pytest.mark.parametrize("value", [0.0, 1.0, -0.5, 0.3])
@pytest.mark.parametrize("scale_by_std", [True, False])
def test_all_equal_group_has_zero_advantages(value, scale_by_std):
    adv = group_advantages([value] * 8, scale_by_std=scale_by_std)
    assert adv.shape == (8,)
    assert np.all(adv == 0.0)


def test_all_equal_group_is_zero_even_with_eps_zero():
    assert np.all(group_advantages([1.0, 1.0, 1.0], eps=0.0) == 0.0)


def test_advantages_sum_to_zero_and_keep_order():
    rewards = [0.2, 0.9, -0.5, 0.0, 1.0, 0.4, 0.4, 0.1]
    adv = group_advantages(rewards)
    assert abs(adv.sum()) < 1e-9
    assert list(np.argsort(adv, kind="stable")) == list(np.argsort(rewards, kind="stable"))


def test_advantages_match_a_loop_reference():
    rewards = [0.2, 0.9, -0.5, 0.0, 1.0]
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
    expected = [(r - mean) / (std + 1e-6) for r in rewards]
    np.testing.assert_allclose(group_advantages(rewards), expected, atol=1e-12)


@pytest.mark.parametrize("bad", [[], [1.0], [0.0, float("nan")], [[0.0, 1.0]]])
def test_advantages_reject_bad_groups(bad):
    with pytest.raises(GrpoInputError):
        group_advantages(bad)


# ---------------------------------------------------------------- group predicates


def test_zero_variance():
    assert is_zero_variance([0.5, 0.5, 0.5])
    assert is_zero_variance([1.0])
    assert not is_zero_variance([0.5, 0.5, 0.51])


def test_all_failed_rule():
    assert is_all_failed([0.0] * 8)
    assert is_all_failed([-0.5, -0.5, -0.5, -0.5])  # uniform and below the mean threshold
    assert not is_all_failed([1.0] * 8)  # uniform but successful
    assert not is_all_failed([1.0, 0, 0, 0, 0, 0, 0, 0])  # std = sqrt(7)/8 = 0.33
    assert not is_all_failed([0.2] * 8)  # uniform, but a mean of 0.2 is not < 0.2
    assert is_all_failed([0.19] * 8)


def test_all_failed_uses_population_std():
    # [0, 0.1]: population std 0.05 (not < 0.05), unbiased std 0.0707.
    # [0, 0.09]: population std 0.045 (< 0.05), unbiased std 0.0636 (not < 0.05): distinguishes the two.
    assert not is_all_failed([0.0, 0.1])
    assert is_all_failed([0.0, 0.09])


# ---------------------------------------------------------------- clipped loss


def _one_token(ratio: float, advantage: float, **kwargs):
    old = torch.tensor([math.log(0.5)], dtype=torch.float64)
    new = (old + math.log(ratio)).clone().requires_grad_(True)
    loss, stats = clipped_token_loss(new, old, torch.tensor([advantage], dtype=torch.float64), **kwargs)
    loss.backward()
    return float(loss.detach()), float(new.grad[0]), stats


def test_clip_higher_positive_advantage_inside_range():
    # ratio 1.25 < 1 + eps_high = 1.3: unclipped, loss -A*rho, d loss / d logp = -A*rho
    loss, grad, stats = _one_token(1.25, 2.0)
    assert loss == pytest.approx(-2.5)
    assert grad == pytest.approx(-2.5)
    assert stats["clip_frac"] == 0.0


def test_clip_higher_positive_advantage_above_range():
    # ratio 1.35 > 1.3: clipped at 1.3, no gradient
    loss, grad, stats = _one_token(1.35, 2.0)
    assert loss == pytest.approx(-2.6)
    assert grad == 0.0
    assert stats["clip_frac"] == 1.0
    assert stats["dual_clip_frac"] == 0.0


def test_symmetric_clip_would_have_clipped_ratio_1_25():
    # the same token under PPO's symmetric 0.2 clip is clipped: clip-higher is what keeps it
    loss, grad, _ = _one_token(1.25, 2.0, eps_high=0.2)
    assert loss == pytest.approx(-2.4)
    assert grad == 0.0


def test_negative_advantage_below_lower_bound_is_clipped():
    # A < 0, ratio 0.75 < 1 - eps_low = 0.8: loss -A * 0.8, no gradient
    loss, grad, stats = _one_token(0.75, -1.0)
    assert loss == pytest.approx(0.8)
    assert grad == 0.0
    assert stats["clip_frac"] == 1.0


def test_negative_advantage_inside_range():
    loss, grad, stats = _one_token(0.85, -1.0)
    assert loss == pytest.approx(0.85)
    assert grad == pytest.approx(0.85)
    assert stats["clip_frac"] == 0.0


def test_negative_advantage_large_ratio_unclipped_below_dual_bound():
    # ratio 2.5 > 1.3 but A < 0: PPO keeps the larger (unclipped) loss; 2.5 < c = 3 so no dual clip
    loss, grad, stats = _one_token(2.5, -1.0)
    assert loss == pytest.approx(2.5)
    assert grad == pytest.approx(2.5)
    assert stats["dual_clip_frac"] == 0.0


def test_dual_clip_bounds_negative_advantage_loss():
    # ratio 4 > c = 3 with A < 0: loss bounded at -A * c = 3, no gradient
    loss, grad, stats = _one_token(4.0, -1.0)
    assert loss == pytest.approx(3.0)
    assert grad == 0.0
    assert stats["dual_clip_frac"] == 1.0
    assert stats["clip_frac"] == 0.0


def test_dual_clip_does_not_apply_to_positive_advantage():
    loss, grad, _ = _one_token(4.0, 1.0)
    assert loss == pytest.approx(-1.3)
    assert grad == 0.0


def test_zero_advantage_gives_zero_loss_and_gradient():
    loss, grad, _ = _one_token(1.1, 0.0)
    assert loss == 0.0
    assert grad == 0.0


def _loop_reference(logprobs, old, adv, eps_low, eps_high, dual_clip):
    total = 0.0
    clipped = dual = 0
    for lp, lo, a in zip(logprobs, old, adv):
        rho = math.exp(max(-20.0, min(20.0, lp - lo)))
        l1 = -a * rho
        l2 = -a * min(max(rho, 1 - eps_low), 1 + eps_high)
        loss = max(l1, l2)
        if l1 < l2:
            clipped += 1
        if a < 0 and loss > -a * dual_clip:
            loss = -a * dual_clip
            dual += 1
        total += loss
    n = len(logprobs)
    return total, clipped / n, dual / n


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vectorised_loss_equals_plain_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    n = 257
    old = -torch.rand(n, generator=gen, dtype=torch.float64) * 5
    new = old + torch.randn(n, generator=gen, dtype=torch.float64) * 0.6  # ratios from ~0.15 to ~6
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    adv[::7] = 0.0
    loss, stats = clipped_token_loss(new, old, adv, eps_low=0.2, eps_high=0.28, dual_clip=3.0)
    ref, clip_frac, dual_frac = _loop_reference(new.tolist(), old.tolist(), adv.tolist(), 0.2, 0.28, 3.0)
    assert float(loss.detach()) == pytest.approx(ref, rel=1e-12, abs=1e-12)
    assert stats["clip_frac"] == pytest.approx(clip_frac)
    assert stats["dual_clip_frac"] == pytest.approx(dual_frac)
    assert 0 < clip_frac < 1 and 0 < dual_frac < 1  # the sample exercises every branch
    assert stats["tokens"] == n
    assert stats["ratio_mean"] == pytest.approx(float(torch.exp(new - old).mean()))


def test_gradient_does_not_flow_into_old_logprobs_or_advantages():
    old = torch.tensor([-1.0, -2.0], requires_grad=True)
    adv = torch.tensor([1.0, -1.0], requires_grad=True)
    new = torch.tensor([-1.1, -1.9], requires_grad=True)
    loss, _ = clipped_token_loss(new, old, adv)
    loss.backward()
    assert old.grad is None and adv.grad is None
    assert new.grad is not None


def test_extreme_log_ratio_stays_finite():
    new = torch.tensor([0.0, -200.0], requires_grad=True)
    old = torch.tensor([-200.0, 0.0])
    loss, stats = clipped_token_loss(new, old, torch.tensor([-1.0, 1.0]))
    loss.backward()
    assert math.isfinite(float(loss.detach())) and torch.isfinite(new.grad).all()
    assert math.isfinite(stats["ratio_mean"])


def test_empty_rollout_gives_zero_loss():
    loss, stats = clipped_token_loss(torch.zeros(0), torch.zeros(0), torch.zeros(0))
    assert float(loss) == 0.0 and stats["tokens"] == 0


@pytest.mark.parametrize(
    "kwargs",
    [{"eps_low": 1.0}, {"eps_low": -0.1}, {"eps_high": -0.1}, {"dual_clip": 1.0}],
)
def test_loss_rejects_bad_clip_parameters(kwargs):
    with pytest.raises(GrpoInputError):
        clipped_token_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), **kwargs)


def test_loss_rejects_mismatched_shapes():
    with pytest.raises(GrpoInputError):
        clipped_token_loss(torch.zeros(3), torch.zeros(2), torch.zeros(3))
    with pytest.raises(GrpoInputError):
        clipped_token_loss(torch.zeros(3), torch.zeros(3), torch.zeros(()))


# ---------------------------------------------------------------- off-policy correction

# Three tokens: pi_prox / pi_behav = 0.5/0.25 = 2, 0.6/0.1 = 6 and 0.1/0.4 = 0.25.
PROX = torch.tensor([math.log(0.5), math.log(0.6), math.log(0.1)], dtype=torch.float64)
BEHAV = torch.tensor([math.log(0.25), math.log(0.1), math.log(0.4)], dtype=torch.float64)
ADV = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64)


def test_decoupled_weights_filter_tokens_above_the_cap():
    # AReaL: weight rho where rho <= cap, 0 (token filtered out) where rho > cap
    w, capped = correction_weights(PROX, BEHAV, mode="decoupled", cap=5.0)
    assert w.tolist() == pytest.approx([2.0, 0.0, 0.25])
    assert capped.tolist() == [False, True, False]


def test_tis_weights_truncate_at_the_cap():
    # slime TIS: min(rho, 2); rho = 2 exactly is not capped
    w, capped = correction_weights(PROX, BEHAV, mode="tis", cap=2.0)
    assert w.tolist() == pytest.approx([2.0, 2.0, 0.25])
    assert capped.tolist() == [False, True, False]


@pytest.mark.parametrize("mode", ["arpo", "behaviour"])
def test_no_correction_modes_weigh_every_token_one(mode):
    w, capped = correction_weights(PROX, BEHAV, mode=mode, cap=2.0)
    assert w.tolist() == [1.0, 1.0, 1.0] and not capped.any()


def _corrected(mode, logprobs=PROX, cap=5.0):
    new = logprobs.clone().requires_grad_(True)
    loss, stats = corrected_token_loss(new, PROX, BEHAV, ADV, mode=mode, cap=cap)
    loss.backward()
    return float(loss.detach()), new.grad.tolist(), stats


def test_decoupled_loss_at_the_proximal_policy_is_the_weighted_policy_gradient():
    # pi_theta = pi_prox: ratio 1, no clip; loss = sum w * (-A) = 2*(-1) + 0*(-1) + 0.25*(+1) = -1.75
    loss, grad, stats = _corrected("decoupled")
    assert loss == pytest.approx(-1.75)
    assert grad == pytest.approx([-2.0, 0.0, 0.25])  # d/dlogp of -w*A*rho at rho = 1
    assert stats["is_weight_mean"] == pytest.approx(0.75)
    assert stats["is_weight_max"] == pytest.approx(2.0)
    assert stats["is_capped_frac"] == pytest.approx(1 / 3)
    assert stats["ratio_mean"] == pytest.approx(1.0) and stats["clip_frac"] == 0.0
    # behaviour_kl = mean(log behav - log prox) = mean(-log 2, -log 6, -log 0.25)
    assert stats["behaviour_kl"] == pytest.approx((-math.log(2) - math.log(6) + math.log(4)) / 3)


def test_tis_loss_at_the_proximal_policy():
    # weights [2, 2, 0.25]: loss = -2 - 2 + 0.25 = -3.75
    loss, grad, stats = _corrected("tis", cap=2.0)
    assert loss == pytest.approx(-3.75)
    assert grad == pytest.approx([-2.0, -2.0, 0.25])
    assert stats["is_weight_mean"] == pytest.approx(4.25 / 3)
    assert stats["is_capped_frac"] == pytest.approx(1 / 3)


def test_arpo_loss_ignores_the_behaviour_policy():
    # ARPO: old log-probs recomputed by the current policy, no weight: loss = -1 - 1 + 1 = -1
    loss, grad, stats = _corrected("arpo")
    assert loss == pytest.approx(-1.0)
    assert grad == pytest.approx([-1.0, -1.0, 1.0])
    assert stats["is_weight_mean"] == 1.0 and stats["is_capped_frac"] == 0.0


def test_behaviour_mode_clips_against_the_sampler_log_probs():
    # ratios pi_theta/pi_behav = [2, 6, 0.25]: tokens 1-2 (A=1) clipped at 1.3, token 3 (A=-1) at 0.8
    # loss = -1.3 - 1.3 + 0.8 = -1.8; every token clipped, so no gradient
    loss, grad, stats = _corrected("behaviour")
    assert loss == pytest.approx(-1.8)
    assert grad == pytest.approx([0.0, 0.0, 0.0])
    assert stats["clip_frac"] == 1.0


def test_decoupled_clips_against_the_proximal_policy_and_keeps_the_weight():
    # token 0 only (w = 2, A = 1); pi_theta / pi_prox = 1.2 inside the clip: loss -2 * 1.2, grad -2.4
    new = (PROX[:1] + math.log(1.2)).clone().requires_grad_(True)
    loss, _ = corrected_token_loss(new, PROX[:1], BEHAV[:1], ADV[:1], mode="decoupled", cap=5.0)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-2.4) and float(new.grad[0]) == pytest.approx(-2.4)
    # pi_theta / pi_prox = 1.5 > 1.3: clipped, loss -2 * 1.3, no gradient
    new = (PROX[:1] + math.log(1.5)).clone().requires_grad_(True)
    loss, stats = corrected_token_loss(new, PROX[:1], BEHAV[:1], ADV[:1], mode="decoupled", cap=5.0)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-2.6) and float(new.grad[0]) == 0.0
    assert stats["clip_frac"] == 1.0


def _corrected_loop(logprobs, prox, behav, adv, mode, cap, eps_low=0.2, eps_high=0.28, dual_clip=3.0):
    total = 0.0
    for lp, lx, lb, a in zip(logprobs, prox, behav, adv):
        old = lb if mode == "behaviour" else lx
        rho = math.exp(max(-20.0, min(20.0, lp - old)))
        loss = max(-a * rho, -a * min(max(rho, 1 - eps_low), 1 + eps_high))
        if a < 0:
            loss = min(loss, -a * dual_clip)
        w = math.exp(max(-20.0, min(20.0, lx - lb)))
        if mode == "decoupled":
            w = 0.0 if w > cap else w
        elif mode == "tis":
            w = min(w, cap)
        else:
            w = 1.0
        total += w * loss
    return total


@pytest.mark.parametrize("mode", CORRECTION_MODES)
def test_vectorised_corrected_loss_equals_plain_loop(mode):
    gen = torch.Generator().manual_seed(7)
    n = 301
    behav = -torch.rand(n, generator=gen, dtype=torch.float64) * 5
    prox = behav + torch.randn(n, generator=gen, dtype=torch.float64) * 1.2  # weights ~0.03 .. 30
    new = prox + torch.randn(n, generator=gen, dtype=torch.float64) * 0.4
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    cap = 2.0 if mode == "tis" else 5.0
    loss, stats = corrected_token_loss(new, prox, behav, adv, mode=mode, eps_high=0.28, cap=cap)
    ref = _corrected_loop(new.tolist(), prox.tolist(), behav.tolist(), adv.tolist(), mode, cap)
    assert float(loss.detach()) == pytest.approx(ref, rel=1e-12, abs=1e-12)
    if mode in ("decoupled", "tis"):
        assert 0 < stats["is_capped_frac"] < 1  # the sample exercises the cap


def test_correction_rejects_bad_input():
    with pytest.raises(GrpoInputError, match="unknown correction"):
        corrected_token_loss(PROX, PROX, BEHAV, ADV, mode="none")
    with pytest.raises(GrpoInputError, match="proximal"):
        corrected_token_loss(PROX, None, BEHAV, ADV, mode="decoupled")
    with pytest.raises(GrpoInputError, match="behaviour"):
        corrected_token_loss(PROX, PROX, None, ADV, mode="tis")
    with pytest.raises(GrpoInputError, match="cap"):
        correction_weights(PROX, BEHAV, mode="tis", cap=0.0)
    with pytest.raises(GrpoInputError):
        corrected_token_loss(PROX, PROX, BEHAV[:2], ADV, mode="decoupled")


def test_corrected_loss_on_empty_step_is_zero():
    empty = torch.zeros(0)
    loss, stats = corrected_token_loss(empty, empty, empty, empty, mode="decoupled")
    assert float(loss) == 0.0 and stats["is_weight_mean"] == 0.0 and stats["tokens"] == 0
