"""The training loop's per-batch stages: the samples a batch gets (learner.algo.samples.train_samples) and the
optimizer steps it takes (learner.train.loop.optimizer_steps), handed to the trainer as the loop hands them."""

import pytest

from arpo_async.config import load_config
from arpo_async.messages import Step, Trajectory
from learner.algo.batcher import ScoredGroup
from learner.algo.samples import train_samples
from learner.train.loop import optimizer_steps


class RecordingTrainer:
    """Stands in for Trainer: records what train_batch was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[list, int]] = []

    def train_batch(self, samples, *, minibatches: int = 1) -> dict[str, float]:
        self.calls.append((list(samples), minibatches))
        return {"loss": 0.5, "optimizer_steps": float(minibatches)}


def group(task_id: str, advantages: list[float]) -> ScoredGroup:
    trajectories = [Trajectory(f"{task_id}-{k}", "a", task_id, f"g-{task_id}", k, "FAILURE", 0.0, True,
                               [Step([1, 2], [0], [5, 6], [-1.0, -1.0], [0, 0], "t", "click")], [b"png"])
                    for k in range(len(advantages))]
    return ScoredGroup(task_id, trajectories, [0.0] * len(advantages), advantages, False, 0.0,
                       [0] * len(advantages))


def lc(*overrides: str):
    return load_config(None, list(overrides)).learner


@pytest.mark.parametrize("overrides, steps_done, samples, updates", [
    (["learner.updates_per_batch=2", "learner.steps=0"], 0, 4, 2),  # ARPO: 2 steps per batch
    (["learner.updates_per_batch=3", "learner.steps=0"], 0, 2, 2),  # never more steps than samples
    (["learner.updates_per_batch=2", "learner.steps=10"], 9, 4, 1),  # never past learner.steps
    (["learner.updates_per_batch=1", "learner.steps=0"], 50, 4, 1),
])
def test_a_batch_takes_updates_per_batch_steps_within_the_samples_and_the_run(overrides, steps_done, samples,
                                                                               updates):
    trainer = RecordingTrainer()
    batch = [group("a", [1.0, -1.0]), group("b", [0.5, -0.5])][:samples // 2]  # one sample per trajectory
    samples_given = train_samples(batch)
    taken = optimizer_steps(lc(*overrides), len(samples_given), steps_done)
    stats = trainer.train_batch(samples_given, minibatches=taken)
    assert taken == updates and stats["optimizer_steps"] == updates
    [(given, minibatches)] = trainer.calls
    assert minibatches == updates
    assert [s.advantage for s in given] == [a for g in batch for a in g.advantages]  # one sample per step, in order
    assert all(s.loss_mask is None for s in given)  # no ForcedTokens: every token counts
