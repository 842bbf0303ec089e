"""AReaL's admission rule with hand-computed numbers: accepted + running < (eta + version + 1) x B."""

import pytest

from learner.rollouts.staleness import StalenessManager


def test_capacity_hand_computed():
    s = StalenessManager(batch_size=8, max_staleness=1)
    assert s.capacity(version=0) == 16  # (1 + 0 + 1) * 8
    for _ in range(16):
        s.on_start()
    assert not s.can_admit(0)
    for _ in range(8):
        s.on_finish(accepted=True)
    assert s.capacity(0) == 0  # 8 accepted + 8 running
    assert s.capacity(1) == 8  # (1 + 1 + 1) * 8 - 16


def test_synchronous_when_eta_is_zero():
    s = StalenessManager(batch_size=4, max_staleness=0)
    for _ in range(4):
        s.on_start()
    assert not s.can_admit(0)
    for _ in range(4):
        s.on_finish(accepted=True)
    assert not s.can_admit(0)  # the batch must be trained first
    assert s.capacity(1) == 4


def test_rejected_and_discarded_trajectories_free_capacity():
    s = StalenessManager(batch_size=4, max_staleness=0)
    for _ in range(4):
        s.on_start()
    s.on_finish(accepted=False)  # ENV_ERROR
    assert s.capacity(0) == 1
    for _ in range(3):
        s.on_finish(accepted=True)
    s.on_discard(3)  # zero-variance group dropped
    assert s.capacity(0) == 4


def test_misuse_is_an_error():
    with pytest.raises(ValueError):
        StalenessManager(batch_size=0, max_staleness=1)
    with pytest.raises(RuntimeError):
        StalenessManager(batch_size=1, max_staleness=0).on_finish(accepted=True)
