"""Samples: a training batch as the trainer takes it. The algorithm's "samples" stage (learner.train.loop).

Role: turns the scored groups of one batch (learner.algo.batcher.ScoredGroup) into TrainSamples
(learner.algo.train_sample), one per generated step, each carrying its trajectory's advantage and, with
``learner.mask_forced_tokens``, a loss mask that leaves out the tokens the action grammar forced
(learner.algo.forced_tokens). Pure: no state, no I/O.
"""

from __future__ import annotations

from arpo_async.demos import is_demonstration
from learner.algo.batcher import ScoredGroup
from learner.algo.forced_tokens import ForcedTokens
from learner.algo.train_sample import TrainSample


def train_samples(batch: list[ScoredGroup], forced: ForcedTokens | None = None) -> list[TrainSample]:
    """One TrainSample per generated step of every trajectory, carrying its trajectory's advantage.

    Tokens in, tokens out: the exact prompt and output ids the sampler used, its behaviour log-probs, and the
    screenshots the prompt referenced, in prompt order; a demonstration's steps are marked ``demonstration`` (their
    log-probs are not ours: the trainer replaces them). With ``forced``, each sample's ``loss_mask`` leaves out
    the tokens its trajectory's grammar forced (`learner.algo.forced_tokens`); without it every token counts.
    """
    samples: list[TrainSample] = []
    for group in batch:
        flags = group.replayed or [False] * len(group.trajectories)
        for traj, advantage, replayed in zip(group.trajectories, group.advantages, flags):
            for step in traj.steps:
                if not len(step.output_ids):
                    continue
                samples.append(TrainSample(
                    prompt_ids=step.prompt_ids,
                    images=[traj.screenshots[i] for i in step.image_indices],
                    output_ids=step.output_ids,
                    behaviour_logprobs=step.logprobs,
                    advantage=advantage,
                    replayed=replayed,
                    demonstration=is_demonstration(traj),
                    loss_mask=forced.loss_mask(traj.grammar, step.output_ids) if forced is not None else None,
                ))
    return samples
