"""Batcher: completed groups in, training batches out.

Owns: the per-group pipeline between the scheduler and the trainer, in ARPO's order (ARPO: End-to-End Policy
Optimization for GUI Agents with Experience Replay, arXiv 2505.16282, and its code github.com/dvlab-research/ARPO):
drop what cannot be trained (ENV_ERROR / ABORTED, or staler than the bound), inject a stored success into an
all-failed (or, with prioritized replay, low-success) group, update the replay buffer from the group as sampled,
compute group-relative advantages, and drop zero-variance groups (they carry no gradient and cost no optimizer
work; DAPO's dynamic sampling). Every drop is counted by reason in ``drops``.

Replayed trajectories are marked per position in ``ScoredGroup.replayed`` and on their ``TrainSample``s
(``replayed=True``); they keep the behaviour log-probs and token versions recorded when they were sampled, so the
trainer's off-policy correction applies to them like to any other data. They are never subject to the staleness
drop (that applies to fresh rollouts only).
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

from arpo_async.messages import Trajectory
from arpo_async.success import DEFAULT_SUCCESS_THRESHOLD, is_success
from learner.algo.forced_tokens import ForcedTokens
from learner.algo.grpo import compute_reward, group_advantages, is_zero_variance
from learner.algo.replay import ReplayBuffer
from learner.rollouts.scheduler import Group
from learner.algo.train_sample import TrainSample


@dataclass
class ScoredGroup:
    """A group ready for training. ``trajectories`` are after injection; ``sampled_success`` before it."""

    task_id: str
    trajectories: list[Trajectory]
    rewards: list[float]
    advantages: list[float]
    injected: bool
    sampled_success: float
    policy_lag: list[int]
    """Per trajectory: version at scoring minus the oldest token version in it."""
    replayed: list[bool] = field(default_factory=list)
    """Per trajectory: True where the replay buffer injected it (empty = none replayed)."""

    @property
    def fresh_policy_lag(self) -> list[int]:
        """``policy_lag`` of the trajectories sampled for this group (replayed ones left out)."""
        flags = self.replayed or [False] * len(self.policy_lag)
        return [lag for lag, replayed in zip(self.policy_lag, flags) if not replayed]


def policy_lag(traj: Trajectory, version: int) -> int:
    """Policy lag of a trajectory at ``version``: version minus the oldest version among its tokens."""
    oldest = traj.oldest_version()
    return 0 if oldest is None else version - oldest


class Batcher:
    """Turns complete groups into ScoredGroups and hands out batches of ``groups_per_step`` of them.

    Args:
        replay: the success replay buffer (:class:`learner.algo.replay.SuccessReplay` -- ARPO or off -- or
            :class:`learner.algo.replay.PrioritizedReplay`).
        max_staleness: eta; trajectories with policy lag above it are dropped (reason "stale").
        groups_per_step: scored groups per training batch.
        format_reward_weight: ARPO's weight on the format reward.
        success_threshold: ``sampled_success`` counts scores above this (:func:`arpo_async.success.is_success`).
        stratified: batches cover distinct tasks where the ready groups allow it (see `take_batch`).
    """

    def __init__(self, replay: ReplayBuffer, *, max_staleness: int, groups_per_step: int,
                 format_reward_weight: float = 0.5, success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
                 stratified: bool = False) -> None:
        self.replay = replay
        self.stratified = stratified
        self._eta = max_staleness
        self._groups_per_step = groups_per_step
        self._format_weight = format_reward_weight
        self._success_threshold = success_threshold
        self.ready: list[ScoredGroup] = []
        self.drops: collections.Counter[str] = collections.Counter()

    def add_group(self, group: Group, version: int) -> ScoredGroup | None:
        """Score one complete group at policy ``version``; None when the whole group was dropped."""
        kept: list[Trajectory] = []
        for traj in group.trajectories():
            if not traj.outcome.trainable:
                self.drops[traj.outcome.lower()] += 1
            elif policy_lag(traj, version) > self._eta:
                self.drops["stale"] += 1
            else:
                kept.append(traj)
        if len(kept) < 2:
            self.drops["group_too_small"] += 1
            return None
        scores = [t.score for t in kept]
        sampled_success = sum(is_success(s, self._success_threshold) for s in scores) / len(scores)
        sampled_rewards = [compute_reward(t.score, t.format_ok, format_weight=self._format_weight) for t in kept]
        injection = self.replay.inject(group.task.id, kept, scores, version=version, rewards=sampled_rewards)
        self.replay.add_group(group.task.id, kept, [t.score for t in kept], version=version)
        trajs = injection.trajectories
        rewards = [compute_reward(t.score, t.format_ok, format_weight=self._format_weight) for t in trajs]
        if is_zero_variance(rewards):
            self.drops["zero_variance"] += 1
            return None
        advantages = group_advantages(rewards).tolist()
        replayed = [i == injection.index for i in range(len(trajs))]
        scored = ScoredGroup(group.task.id, list(trajs), rewards, advantages, injection.injected, sampled_success,
                             [policy_lag(t, version) for t in trajs], replayed)
        self.ready.append(scored)
        return scored

    @property
    def has_batch(self) -> bool:
        return len(self.ready) >= self._groups_per_step

    def take_batch(self) -> list[ScoredGroup] | None:
        """The next batch of ``groups_per_step`` groups, or None while too few are ready.

        Not stratified: the oldest groups. Stratified: the oldest group of each task, oldest first, until the
        batch is full; only when fewer distinct tasks are ready than the batch needs, the oldest of the rest
        fill it. Groups left out stay ready, in order, for the next batch. (ARPO's batches draw distinct tasks
        too: its dataloader samples a batch of task ids without replacement.)
        """
        if len(self.ready) < self._groups_per_step:
            return None
        if not self.stratified:
            picked = list(range(self._groups_per_step))
        else:
            seen: set[str] = set()
            picked = [i for i, g in enumerate(self.ready) if not (g.task_id in seen or seen.add(g.task_id))]
            picked = picked[: self._groups_per_step]
            rest = [i for i in range(len(self.ready)) if i not in set(picked)]
            picked = sorted(picked + rest[: self._groups_per_step - len(picked)])
        chosen = set(picked)
        batch = [self.ready[i] for i in picked]
        self.ready = [g for i, g in enumerate(self.ready) if i not in chosen]
        return batch

    def take_all(self) -> list[ScoredGroup]:
        """Every ready group, oldest first (lockstep: the whole rollout batch, however many had variance)."""
        batch, self.ready = self.ready, []
        return batch


class BatchQueue(asyncio.Queue):
    """The bounded queue of training batches (each a list of ScoredGroup) from the learner service to the
    training loop; :meth:`pending` shows what waits on it (queue depths, and what a checkpoint cannot keep)."""

    def pending(self) -> list[list[ScoredGroup]]:
        """The batches waiting, oldest first (a copy)."""
        return list(self._queue)


def train_samples(batch: list[ScoredGroup], forced: ForcedTokens | None = None) -> list[TrainSample]:
    """One TrainSample per generated step of every trajectory, carrying its trajectory's advantage.

    Tokens in, tokens out: the exact prompt and output ids the sampler used, its behaviour log-probs, and the
    screenshots the prompt referenced, in prompt order. With ``forced``, each sample's ``loss_mask`` leaves out
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
                    loss_mask=forced.loss_mask(traj.grammar, step.output_ids) if forced is not None else None,
                ))
    return samples
