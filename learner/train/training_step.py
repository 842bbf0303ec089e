"""The learner's training step: one training batch in, its optimizer steps taken, their stats out.

Role: the part of the training loop (learner.train.loop) that touches the model, as one function of values,
so that every caller trains exactly as the learner does (tests/learning_probe.py and the learnability test call it
instead of a copy). Blocking: torch on CPU or GPU; the training loop runs it in a thread.

Invariants: ``min(learner.updates_per_batch, samples)`` optimizer steps (at least 1), never past ``learner.steps``
optimizer steps in all; the forced tokens are left out of the loss when a ForcedTokens is given.
"""

from __future__ import annotations

from arpo_async.config import LearnerConfig
from learner.algo.batcher import ScoredGroup, train_samples
from learner.train.distributed import LeadTrainer
from learner.algo.forced_tokens import ForcedTokens
from learner.train.trainer import Trainer


def train_on_batch(trainer: Trainer | LeadTrainer, batch: list[ScoredGroup], lc: LearnerConfig,
                   forced: ForcedTokens | None, steps_done: int) -> tuple[dict[str, float], int]:
    """Train ``trainer`` on ``batch``: one TrainSample per generated step (learner.algo.batcher.train_samples, the
    forced tokens masked with ``forced``), split into ``updates`` mini-batches, one optimizer step each
    (Trainer.train_batch).

    Args:
        steps_done: optimizer steps taken so far in the run (across restarts); with ``lc.steps`` > 0 the batch
            takes at most ``lc.steps - steps_done`` steps. Must be below ``lc.steps`` then.
    Returns:
        (the stats of Trainer.train_batch, ``updates``: the optimizer steps taken, >= 1).
    Raises:
        TrainerInputError: no usable sample in the batch (nothing changed), as Trainer.train_batch.
    """
    samples = train_samples(batch, forced)
    updates = min(lc.updates_per_batch, max(1, len(samples)))
    if lc.steps:
        updates = min(updates, lc.steps - steps_done)
    return trainer.train_batch(samples, minibatches=updates), updates
