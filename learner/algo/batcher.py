"""Batcher: completed groups in, training batches out; the algorithm's per-group stages.

Owns: the per-group stages between the scheduler and the trainer, each a method, run in ARPO's order by
:meth:`Batcher.add_group`: :meth:`Batcher.score` (rewards; drops), :meth:`Batcher.replay_success` (replay),
:meth:`Batcher.advantages` (advantages), following (ARPO: End-to-End Policy
Optimization for GUI Agents with Experience Replay, arXiv 2505.16282, and its code github.com/dvlab-research/ARPO):
drop what cannot be trained (ENV_ERROR / ABORTED, or staler than the bound) and compute the rewards (a reward shaping
changes learner.algo.rewards.compute_reward), inject a stored success into an all-failed
(or, with prioritized replay, low-success) group and update the replay buffer from the group as sampled, drop
zero-variance groups (they carry no gradient and cost no optimizer work; DAPO's dynamic sampling) and compute the
advantages with the advantage function (GRPO's by default; learner.algo.advantages is the seam for another). Every
drop is counted by reason in ``drops``. Then learner.algo.samples.train_samples (the "samples" stage) turns a batch
into one TrainSample per generated step.

A demonstration the replay injects (arpo_async.demos) is first tokenized as the group's rollouts were sampled, under
their grammar (``sampled_as``: learner.algo.forced_tokens.ForcedTokens.as_sampled), so the policy learns the token
sequence it samples, not the tokenizer's plain encoding of the reply.

Replayed trajectories are marked per position in ``ScoredGroup.replayed`` and on their ``TrainSample``s
(``replayed=True``); they keep the behaviour log-probs and token versions recorded when they were sampled, so the
trainer's off-policy correction applies to them like to any other data. They are never subject to the staleness
drop (that applies to fresh rollouts only).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

import numpy as np

from arpo_async.demos import is_demonstration
from arpo_async.messages import Trajectory
from arpo_async.success import DEFAULT_SUCCESS_THRESHOLD, is_success
from learner.algo.advantages import (ADVANTAGE_TIMEOUT_S, AdvantageFunction, advantages_off_loop,
                                     checked_advantages, grpo_advantages)
from learner.algo.grpo import is_zero_variance
from learner.algo.rewards import compute_reward
from learner.algo.replay import ReplayBuffer


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


class CompleteGroup(Protocol):
    """A complete group as the scheduler hands it over (learner.rollouts.scheduler.Group): its task and its
    trajectories in rollout order."""

    @property
    def task(self) -> object: ...  # has ``.id``

    def trajectories(self) -> list[Trajectory]: ...


class Batcher:
    """Runs the algorithm's per-group stages and hands out batches of ``groups_per_step`` scored groups.

    Args:
        replay: the success replay buffer (:class:`learner.algo.replay.SuccessReplay` -- ARPO or off -- or
            :class:`learner.algo.replay.PrioritizedReplay`).
        max_staleness: eta; trajectories with policy lag above it are dropped (reason "stale").
        groups_per_step: scored groups per training batch.
        format_reward_weight: ARPO's weight on the format reward.
        success_threshold: ``sampled_success`` counts scores above this (:func:`arpo_async.success.is_success`).
        stratified: batches cover distinct tasks where the ready groups allow it (see `take_batch`).
        advantage_function: the advantages stage's rule (learner.algo.advantages; GRPO's by default).
        advantage_timeout_s: the deadline of one call of a custom advantage function in :meth:`add_group_async`.
        drops: the counter drops are counted in (learner.state.RunState.drops; a new one when None).
        sampled_as: ``(demonstration, grammar) -> demonstration`` tokenized as a rollout under that regex
            (learner.algo.forced_tokens.ForcedTokens.as_sampled); applied to an injected demonstration with the
            grammar of the group's rollouts. None keeps demonstrations as loaded.
    """

    def __init__(self, replay: ReplayBuffer, *, max_staleness: int, groups_per_step: int,
                 format_reward_weight: float = 0.5, success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
                 stratified: bool = False, advantage_function: AdvantageFunction = grpo_advantages,
                 drops: collections.Counter[str] | None = None,
                 sampled_as: Callable[[Trajectory, str], Trajectory] | None = None,
                 advantage_timeout_s: float = ADVANTAGE_TIMEOUT_S) -> None:
        self.replay = replay
        self.advantage_timeout_s = advantage_timeout_s
        self.sampled_as = sampled_as
        self.stratified = stratified
        self.advantage_function = advantage_function
        self._eta = max_staleness
        self._groups_per_step = groups_per_step
        self._format_weight = format_reward_weight
        self._success_threshold = success_threshold
        self.ready: list[ScoredGroup] = []
        self.drops: collections.Counter[str] = drops if drops is not None else collections.Counter()

    def add_group(self, group: CompleteGroup, version: int) -> ScoredGroup | None:
        """Run the per-group stages on one complete group at policy ``version`` -- score, replay, advantages --
        and keep the result for a batch; None when the group was dropped (counted in ``drops``). The advantage
        function runs in this thread; the training loop runs :meth:`add_group_async`.

        Raises:
            AdvantageFunctionError: the advantage function returned something other than one finite float per
                trajectory (learner.algo.advantages).
        """
        scored = self.score(group.task.id, group.trajectories(), version)  # 1. score
        if scored is not None:
            scored = self.replay_success(scored, version)  # 2. replay
            scored = self.advantages(scored)  # 3. advantages
        return self._keep(scored)

    async def add_group_async(self, group: CompleteGroup, version: int) -> ScoredGroup | None:
        """:meth:`add_group` with a custom advantage function called off the event loop, under the deadline
        ``advantage_timeout_s`` (learner.algo.advantages.advantages_off_loop); score and replay run first, at
        ``version``, before anything is awaited.

        Raises:
            AdvantageFunctionError: as :meth:`add_group`, or the function passed its deadline.
        """
        scored = self.score(group.task.id, group.trajectories(), version)  # 1. score
        if scored is not None:
            scored = self.replay_success(scored, version)  # 2. replay
            if self._varies(scored):  # 3. advantages
                rewards = np.asarray(scored.rewards, dtype=np.float64)
                scored = replace(scored, advantages=await advantages_off_loop(
                    self.advantage_function, rewards, scored.task_id, timeout_s=self.advantage_timeout_s))
            else:
                scored = None
        return self._keep(scored)

    def _keep(self, scored: ScoredGroup | None) -> ScoredGroup | None:
        if scored is not None:
            self.ready.append(scored)
        return scored

    def _varies(self, scored: ScoredGroup) -> bool:
        """Whether the group's rewards vary; one that does not is counted (``zero_variance``)."""
        if is_zero_variance(scored.rewards):
            self.drops["zero_variance"] += 1
            return False
        return True

    def _rewards(self, trajectories: list[Trajectory]) -> list[float]:
        return [compute_reward(t.score, t.format_ok, format_weight=self._format_weight) for t in trajectories]

    def score(self, task_id: str, trajectories: list[Trajectory], version: int) -> ScoredGroup | None:
        """The "score" stage: drop what cannot be trained (its outcome, or policy lag above eta), then each kept
        trajectory's reward (learner.algo.rewards.compute_reward: score plus the weighted format reward). None when
        fewer than 2 are left (``group_too_small``). The result has no advantages yet."""
        kept: list[Trajectory] = []
        for traj in trajectories:
            if not traj.outcome.trainable:
                self.drops[traj.outcome.lower()] += 1
            elif policy_lag(traj, version) > self._eta:
                self.drops["stale"] += 1
            else:
                kept.append(traj)
        if len(kept) < 2:
            self.drops["group_too_small"] += 1
            return None
        sampled_success = sum(is_success(t.score, self._success_threshold) for t in kept) / len(kept)
        return ScoredGroup(task_id, kept, self._rewards(kept), [], False, sampled_success,
                           [policy_lag(t, version) for t in kept])

    def replay_success(self, scored: ScoredGroup, version: int) -> ScoredGroup:
        """The "replay" stage: inject a stored success into a group that qualifies (the replay buffer's rule),
        then store the group's successes as sampled (before injection); rewards and lags follow the injection. An
        injected demonstration is tokenized as the group's rollouts were (``sampled_as``)."""
        kept, scores = scored.trajectories, [t.score for t in scored.trajectories]
        injection = self.replay.inject(scored.task_id, kept, scores, version=version, rewards=scored.rewards)
        self.replay.add_group(scored.task_id, kept, scores, version=version)
        trajs = list(injection.trajectories)
        if injection.injected and self.sampled_as is not None and is_demonstration(trajs[injection.index]):
            # the group as sampled (``kept``, before injection) is the rollouts' own: their grammar is the sampler's
            trajs[injection.index] = self.sampled_as(trajs[injection.index], kept[0].grammar)
        return replace(scored, trajectories=trajs, rewards=self._rewards(trajs), injected=injection.injected,
                       policy_lag=[policy_lag(t, version) for t in trajs],
                       replayed=[i == injection.index for i in range(len(trajs))])

    def advantages(self, scored: ScoredGroup) -> ScoredGroup | None:
        """The "advantages" stage: None for a group whose rewards do not vary (``zero_variance``), else the
        advantage function's advantages (learner.algo.advantages).

        Raises:
            AdvantageFunctionError: the advantage function returned something other than one finite float per
                trajectory (learner.algo.advantages).
        """
        if not self._varies(scored):
            return None
        rewards = np.asarray(scored.rewards, dtype=np.float64)
        return replace(scored, advantages=checked_advantages(self.advantage_function, rewards, scored.task_id))

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
