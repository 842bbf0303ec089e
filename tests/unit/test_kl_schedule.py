"""learner.algo.kl_schedule: the KL of a batch's update and the learning rate it sets."""
from __future__ import annotations

import math

import numpy as np
import pytest

from learner.algo.kl_schedule import LR_FACTOR, LR_FLOOR, adapt_lr, batch_kl


def test_batch_kl_is_the_k3_mean_over_counted_tokens():
    before = [[-1.0, -2.0], [-0.5]]
    after = [[-1.5, -2.0], [0.0 - 0.1]]
    k3 = lambda b, a: math.expm1(a - b) - (a - b)  # noqa: E731
    assert batch_kl(before, after) == pytest.approx((k3(-1, -1.5) + 0 + k3(-0.5, -0.1)) / 3)
    assert batch_kl(before, after, [[True, False], None]) == pytest.approx((k3(-1, -1.5) + k3(-0.5, -0.1)) / 2)
    assert batch_kl(before, before) == 0.0
    assert batch_kl([[-1.0]], [[-1.0]], [[False]]) == 0.0  # nothing counted


def test_batch_kl_matches_the_exact_kl_when_tokens_come_from_the_old_policy():
    rng = np.random.default_rng(0)
    p, q = np.array([0.5, 0.3, 0.2]), np.array([0.4, 0.4, 0.2])
    tokens = rng.choice(3, size=200_000, p=p)
    estimate = batch_kl([np.log(p[tokens])], [np.log(q[tokens])])
    assert estimate == pytest.approx(float(np.sum(p * np.log(p / q))), rel=0.05)


@pytest.mark.parametrize("before, after, masks", [([[-1.0]], [[-1.0], [-2.0]], None),
                                                  ([[-1.0, -2.0]], [[-1.0]], None),
                                                  ([[-1.0]], [[math.nan]], None),
                                                  ([[-1.0]], [[-1.0]], [None, None])])
def test_batch_kl_refuses_mismatched_or_non_finite_input(before, after, masks):
    with pytest.raises(ValueError):
        batch_kl(before, after, masks)


def test_adapt_lr_follows_the_adaptive_schedule_within_its_band():
    lr_max = 1e-3
    assert adapt_lr(1e-4, kl=0.5, target=0.1, lr_max=lr_max) == pytest.approx(1e-4 / LR_FACTOR)  # > 2 target
    assert adapt_lr(1e-4, kl=0.01, target=0.1, lr_max=lr_max) == pytest.approx(1e-4 * LR_FACTOR)  # < target / 2
    assert adapt_lr(1e-4, kl=0.1, target=0.1, lr_max=lr_max) == 1e-4  # in band
    assert adapt_lr(lr_max, kl=0.0, target=0.1, lr_max=lr_max) == lr_max  # never above learner.lr
    assert adapt_lr(LR_FLOOR * lr_max, kl=9.0, target=0.1, lr_max=lr_max) == pytest.approx(LR_FLOOR * lr_max)
    assert adapt_lr(1e-4, kl=9.0, target=0.0, lr_max=lr_max) == 1e-4  # off
