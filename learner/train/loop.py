"""The training loop: complete groups in, optimizer steps, published weights, checkpoints and metrics records out.

Role: runs the algorithm as named stages, in this order (each a call in :meth:`TrainingLoop.collect` and
:meth:`TrainingLoop.train`):

1. score: drop what cannot be trained, compute each trajectory's reward (learner.algo.batcher.Batcher.score);
2. replay: inject a stored success into a group that qualifies, store the group's successes (``replay_success``);
3. advantages: drop a group without reward variance, compute the advantages (``advantages``; the advantage
   function is ``learner.advantage_function``, learner.algo.advantages);
4. samples: one TrainSample per generated step of the batch (learner.algo.samples.train_samples);
5. train: ``updates_per_batch`` optimizer steps in a thread (learner.train.trainer);
6. publish: the weights as the next policy version (learner.train.publisher);
7. advance the state: step and version in learner.state.RunState, then one call back to the rollouts side,
   :meth:`learner.rollouts.rounds.RoundControl.on_trained` (it announces the version to the actors and admits more
   work); then a checkpoint every ``learner.checkpoint_every`` steps and one metrics.jsonl record
   (learner.train.records).

Stages 1-3 run per group as each complete group arrives from the service (:meth:`TrainingLoop.collect`, at the
policy version current then, as ARPO scores a group when it is sampled), while a batch trains; 4-7 per batch.
Schedules (``learner.schedule``): "async" trains on ``groups_per_step`` scored groups as soon as they are ready,
while the staleness rule keeps handing out work; "lockstep" is ARPO's synchronous loop: open a rollout batch of
``groups_per_step`` groups, wait for all of it, train (no step when no group had reward variance), publish,
repeat. Both write the same records. Held-out evaluation (``[eval]``, learner.rollouts.evaluation_rounds): a record
carries the newest evaluation round completed since the previous record (``eval_success``, ...). The round on the
final weights is a phase of its own, after training (:meth:`TrainingLoop.final_evaluation`, run by learner.run.Run):
the last batch's record is held back for it, waits for it at most ``eval.final_timeout_s`` and carries its result;
a run that stops as solved writes that round's result in an evaluation record after its last batch's.

Owns: the loop's counters (rollout and skipped batches, wall time across restarts), resuming from the newest
checkpoint (learner.train.checkpoint), and keeping the servers current: every ``learner.resync_interval_s`` a server
behind the current policy version (restarted after a publication) gets the current weights (``catch_up``), never
while a batch trains or publishes.

Ends early when every task is solved (``learner.stop_when_solved``): the task selector
(learner.algo.task_selection) has retired every task, so every group it can hand out would have no reward difference
and be dropped (DAPO's dynamic sampling, arXiv:2503.14476, which this loop follows by waiting for
``groups_per_step`` groups with one); the loop then says so in one line (``stopped``) and returns as at
``learner.steps``; the final evaluation then runs the held-out round on the final weights, checkpoints the last step
again (with the selector's solved state) and writes the round's result as one more record.

Invariants: never trains past ``learner.steps`` optimizer steps in all; a version is announced only after its
weights reached every inference server; the first record after a restart says what was resumed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

from arpo_async.config import LearnerConfig
from arpo_async.messages import Outcome
from arpo_async.metrics import MetricsWriter
from learner.algo.advantages import AdvantageFunctionError
from learner.algo.batcher import Batcher, ScoredGroup
from learner.algo.samples import train_samples
from learner.algo.forced_tokens import ForcedTokens
from learner.algo.replay import ReplayBuffer
from learner.rollouts.rounds import ROUND_END, GroupQueue
from learner.rollouts.service import LearnerService
from learner.state import RunState
from learner.train.checkpoint import Checkpointer, capture, reconcile_metrics, restore
from learner.train.lead_trainer import LeadTrainer
from learner.train.publisher import DistributedPublisher, WeightPublisher
from learner.train.records import evaluation_record, step_record
from learner.train.train_engine import TrainEngine
from learner.train.trainer_errors import TrainerInputError

log = logging.getLogger("arpo.learner")


def optimizer_steps(lc: LearnerConfig, samples: int, steps_done: int) -> int:
    """Optimizer steps for a batch of ``samples`` TrainSamples: ``min(learner.updates_per_batch, samples)``, at
    least 1, and never past ``learner.steps`` in all (``steps_done`` taken so far, across restarts; it must be below
    ``learner.steps`` when that is set)."""
    updates = min(lc.updates_per_batch, max(1, samples))
    return min(updates, lc.steps - steps_done) if lc.steps else updates


@dataclass
class TrainingLoop:
    """The learner's training loop for both schedules (see the module docstring).

    Counts optimizer steps in ``state.step`` (across restarts), which only its last stage,
    :meth:`learner.state.RunState.advance`, changes.
    """

    service: LearnerService
    """The rollouts side: opens lockstep rounds, is told of each step (``on_trained``), gives its counters."""
    groups: GroupQueue
    """Complete groups from the service (the same queue as ``service.groups``)."""
    batcher: Batcher
    """The per-group stages (score, replay, advantages) and the scored groups waiting for a batch."""
    state: RunState
    trainer: TrainEngine
    publisher: WeightPublisher | DistributedPublisher
    checkpointer: Checkpointer
    lc: LearnerConfig
    on_discard: Callable[[int], None] = lambda count: None
    """Told how many accepted trajectories the per-group stages dropped (the admission rule's ``on_discard``)."""
    metrics: MetricsWriter | None = None
    rollout_batches: int = 0
    """Lockstep: rollout batches handed out and collected; async: batches trained."""
    skipped_batches: int = 0
    """Lockstep rollout batches with no reward variance in any group (no optimizer step)."""
    wall_offset_s: float = 0.0
    """Training wall time before this process (from the checkpoint resumed)."""
    forced: ForcedTokens | None = None
    """Finds the grammar-forced tokens left out of the loss (None: every token counts; learner.mask_forced_tokens)."""
    final_eval_timeout_s: float = 0.0
    """How long the last batch's record waits for the evaluation round on the final weights (eval.final_timeout_s)."""
    stopped: str = ""
    """Why training ended before ``learner.steps``: the task selector's solved line (:meth:`stop_solved`); "" else."""

    def __post_init__(self) -> None:
        self._started = time.monotonic()
        self._resumed: dict[str, Any] | None = None
        self._weights = asyncio.Lock()
        """Held while the trainer's weights change or go out (a batch's training and publication, a catch-up)."""
        self._scored = asyncio.Event()
        """Set whenever :meth:`collect` scored a group (or, lockstep, reached the end of a rollout batch)."""
        self._round_ends = 0
        """Lockstep: rollout batches whose every group :meth:`collect` has scored and not yet trained."""
        self._last_record: dict[str, Any] | None = None
        """The metrics record of the last batch this process trained (checkpointed again after a solved stop)."""
        self._held: tuple[dict[str, Any], int] | None = None
        """The last batch's record and its optimizer steps, held back for the final evaluation's result."""

    @property
    def replay(self) -> ReplayBuffer:
        """The success replay buffer (the batcher's)."""
        return self.batcher.replay

    @property
    def extra_state(self) -> dict[str, Any]:
        """Components saved in checkpoints besides the service and the replay buffer."""
        selector = self.service.control.selector
        return {"task_selection": selector} if selector is not None else {}

    @property
    def done(self) -> bool:
        return self.lc.steps != 0 and self.state.step >= self.lc.steps

    @property
    def solved(self) -> bool:
        """Whether the run should end as solved: ``learner.stop_when_solved`` and every task the selector holds is
        retired (learner.algo.task_selection.TaskSelector.solved; never during a task pre-pass)."""
        selector = self.service.control.selector
        return self.lc.stop_when_solved and selector is not None and selector.solved

    @property
    def wall_s(self) -> float:
        return self.wall_offset_s + time.monotonic() - self._started

    def ready_groups(self) -> int:
        """Complete groups not yet trained on: scored and waiting for a batch, or still on ``groups``."""
        return len(self.batcher.ready) + len(self.groups.pending())

    async def resume(self, metrics_path: Path) -> None:
        """Continue from the newest checkpoint, if any: restore every component, repair metrics.jsonl, and
        republish the checkpoint's weights to every inference server under its version."""
        found = await asyncio.to_thread(self.checkpointer.load_latest, self.trainer)
        if found is None:
            return
        folder, saved, meta = found
        restore(saved, self.service, self.replay, self.extra_state)
        self.rollout_batches = int(meta.get("rollout_batches", 0))
        self.skipped_batches = int(meta.get("skipped_batches", 0))
        self.wall_offset_s = float(meta.get("wall_s", 0.0))
        state = self.state
        moved = reconcile_metrics(metrics_path, state.step, meta.get("records", []))
        self._resumed = {"checkpoint": folder.name, "step": state.step, "policy_version": state.published_version,
                         "trainer_steps": self.trainer.steps, "replay": self.replay.stats(),
                         "rolled_back_records": moved}
        await self.publisher.publish_from(self.trainer, state.published_version)
        log.warning("resumed from %s: step %d, policy version %d, %d trainer steps, replay %s%s", folder,
                    state.step, state.published_version, self.trainer.steps, self.replay.stats(),
                    f"; {moved} metrics records after it moved to metrics.rolled_back.jsonl" if moved else "")

    async def run(self, metrics: MetricsWriter) -> None:
        """Train until ``learner.steps`` steps in all (0: until cancelled) on the configured schedule, writing one
        record per batch to ``metrics``; :meth:`collect` and (with ``learner.resync_interval_s``)
        :meth:`keep_servers_current` run beside it.

        Raises:
            AdvantageFunctionError: the advantage function returned something unusable (learner.algo.advantages).
            SyncRejected, WeightsMismatch: a publication or a catch-up failed (the learner stops).
        """
        self.metrics = metrics
        if self.state.published_version == 0:  # a new run: keep the weights it starts from (weights/v0, never pruned)
            await self.publisher.keep_initial(self.trainer)
        await self._with_helpers(self.run_lockstep() if self.lc.schedule == "lockstep" else self.run_async())

    async def final_evaluation(self) -> None:
        """The final evaluation (:meth:`evaluate_final_weights`) after :meth:`run` returned, with :meth:`collect` and
        (with ``learner.resync_interval_s``) :meth:`keep_servers_current` beside it, as during training.

        Raises:
            SyncRejected, WeightsMismatch: a catch-up failed (the learner stops).
        """
        await self._with_helpers(self.evaluate_final_weights())

    async def _with_helpers(self, work: Awaitable[None]) -> None:
        """Run ``work`` with the loop's helpers beside it until it returns (or a helper fails: its error is raised)."""
        training = asyncio.ensure_future(work)
        helpers = [asyncio.create_task(self.collect())]
        if self.lc.resync_interval_s > 0:
            helpers.append(asyncio.create_task(self.keep_servers_current()))
        try:
            await asyncio.wait([training, *helpers], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (training, *helpers):
                task.cancel()
            await asyncio.gather(training, *helpers, return_exceptions=True)
        for task in helpers:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()
        return training.result()

    async def collect(self) -> None:
        """Stages 1-3 for every complete group from the service, as it arrives, at the current policy version:
        score, replay, advantages (:meth:`Batcher.add_group_async`: a custom advantage function runs off the event
        loop, under its deadline); what they drop is reported through ``on_discard``. A group whose stages raise is
        logged, counted in ``drops["unscorable"]`` and dropped. Runs until cancelled.

        Raises:
            AdvantageFunctionError: the advantage function returned something unusable or passed its deadline (the
                learner stops).
        """
        while True:
            group = await self.groups.get()
            if group is ROUND_END:
                self._round_ends += 1
            else:
                self.state.totals["groups"] += 1  # the share dropped for no reward difference: drops / groups
                accepted = sum(Outcome(t.outcome).trainable for t in group.trajectories())
                try:
                    # 1-3. score, replay, advantages (a custom advantage function off the event loop)
                    scored = await self.batcher.add_group_async(group, self.state.published_version)
                except AdvantageFunctionError:
                    raise  # every later group would fail alike: the learner stops
                except Exception as error:  # noqa: BLE001 - one group that cannot be scored never stops training
                    log.error("group %s of task %s cannot be scored, dropped: %s: %s", group.group_id, group.task.id,
                              type(error).__name__, error)
                    self.state.drops["unscorable"] += 1
                    scored = None
                self.on_discard(accepted - (len(scored.trajectories) if scored else 0))
            self._scored.set()

    async def _ready(self, due: Callable[[], bool]) -> None:
        """Wait until ``due()`` holds, re-checked whenever :meth:`collect` scored a group."""
        while not due():
            self._scored.clear()
            await self._scored.wait()

    async def keep_servers_current(self) -> None:
        """Every ``learner.resync_interval_s``, send the current weights to each server behind the current policy
        version (``publisher.catch_up``). Runs until cancelled; a check that fails is logged and tried again.

        The check (``publisher.behind``, learner.train.server_book: every server at once, each for at most
        ``CHECK_TIMEOUT_S``, a bad or slow answer skipping that server for the round; and the servers a publication
        left with part of a version) runs outside the training loop's weights lock, so training never waits on it;
        the lock is taken only to resume the servers a publication left paused and to send weights to the servers
        found behind, unless a publication came in between (the next round checks again).

        Raises:
            SyncRejected, WeightsMismatch: as from a publication (the learner stops).
        """
        while True:
            await asyncio.sleep(self.lc.resync_interval_s)
            version = self.state.published_version
            behind = await self.publisher.behind(version) if version > 0 else []
            if not behind and not self.publisher.paused:
                continue
            async with self._weights:
                if self.state.published_version == version:
                    await self.publisher.catch_up(self.trainer, version, behind)

    async def run_async(self) -> None:
        """Train on ``groups_per_step`` scored groups as soon as they are ready; stop when the run is solved."""
        while not self.done:
            await self._ready(lambda: self.batcher.has_batch or self.solved)
            if self.solved:
                return await self.stop_solved()
            self.rollout_batches += 1
            await self.train(self.batcher.take_batch())

    async def run_lockstep(self) -> None:
        """ARPO's loop: one rollout batch out, all of it back, train, publish; nothing handed out meanwhile."""
        while not self.done:
            if self.solved:
                return await self.stop_solved()
            await self.service.control.open_round(self.lc.groups_per_step)
            await self._ready(lambda: self._round_ends > 0)
            self._round_ends -= 1
            batch = self.batcher.take_all()
            self.rollout_batches += 1
            if not batch:
                self.skipped_batches += 1
                log.info("rollout batch %d: no group with reward variance; no optimizer step", self.rollout_batches)
                continue
            await self.train(batch)

    async def train(self, batch: list[ScoredGroup]) -> None:
        """Stages 4-7 on one batch: its samples, ``updates_per_batch`` optimizer steps (never past
        ``learner.steps``), publish the new weights once as the next version, advance the state; then checkpoint
        and write the batch's metrics record (its ``step`` is the optimizer step count after the batch;
        ``updates`` the steps it took)."""
        service, state, lc = self.service, self.state, self.lc
        window = service.stats.window.take()
        async with self._weights:
            samples = await asyncio.to_thread(train_samples, batch, self.forced)  # 4. samples
            updates = optimizer_steps(lc, len(samples), state.step)
            try:
                stats = await asyncio.to_thread(self.trainer.train_batch, samples, minibatches=updates)  # 5. train
            except TrainerInputError as error:  # every sample unusable: nothing to learn from, nothing changes
                self.skipped_batches += 1
                service.control.on_unusable_batch()
                log.error("rollout batch %d: no usable sample (%s); no optimizer step", self.rollout_batches, error)
                return
            version = state.published_version + 1
            publish_s = await self.publisher.publish_from(self.trainer, version)  # 6. publish
            state.advance(updates, version)  # 7. advance the state
            await service.control.on_trained()
        counters = {**service.report.counters(), "replay": self.replay.stats()}
        record = step_record(state.step, version, batch, stats, window, counters, publish_s, self.wall_s,
                             schedule=lc.schedule, updates=updates, optimizer_steps=self.trainer.steps,
                             rollout_batches=self.rollout_batches, skipped_batches=self.skipped_batches)
        if self._resumed is not None:  # the first record after a restart says what was resumed
            record["resumed_from"], self._resumed = self._resumed, None
        if service.evaluation is not None:
            if self.done and self.final_eval_timeout_s > 0:  # the final evaluation completes and writes it
                self._held = (record, updates)
                return
            record.update(service.evaluation.take_result())
        await self.close_batch(record, updates)

    async def close_batch(self, record: dict[str, Any], updates: int) -> None:
        """Checkpoint when ``learner.checkpoint_every`` falls within the batch's ``updates`` steps, then write the
        batch's metrics ``record`` and its log line.

        Raises:
            RuntimeError: ``metrics`` is not set.
        """
        step, every = self.state.step, self.lc.checkpoint_every
        if every and step // every > (step - updates) // every:
            await self.checkpoint(record)
        self._last_record = record
        if self.metrics is None:
            raise RuntimeError("TrainingLoop.metrics must be set before training")
        self.metrics.write(record)
        log.info("step %d: version %d, success %.2f, loss %.4f, lag %.2f", step, record["policy_version"],
                 record["success_rate"], record["loss"], record["staleness_mean"])

    async def checkpoint(self, record: dict[str, Any]) -> None:
        """Snapshot the learner now and write it in a thread (the service keeps serving actors meanwhile).
        ``record`` is the metrics record of the batch just trained (kept in the checkpoint's meta.json)."""
        waiting = sum(len(group.trajectories) for group in self.batcher.ready)
        state = capture(self.service, self.replay, self.extra_state, waiting=waiting)
        meta = {"policy_version": self.state.published_version, "wall_s": record["wall_s"],
                "rollout_batches": self.rollout_batches, "skipped_batches": self.skipped_batches,
                "replay": self.replay.stats(), "totals": dict(self.state.totals), "records": [record]}
        started = time.perf_counter()
        folder = await asyncio.to_thread(self.checkpointer.save, self.state.step, self.trainer, state, meta)
        record["checkpoint_s"] = round(time.perf_counter() - started, 3)
        log.info("checkpoint %s (%.1f s)", folder, record["checkpoint_s"])

    async def stop_solved(self) -> None:
        """End training as solved: set and log ``stopped`` (one line) and freeze the task selector; the final
        evaluation follows (:meth:`evaluate_final_weights`)."""
        selector = self.service.control.selector
        self.stopped = selector.solved_reason() if selector is not None else "every task is solved"
        if selector is not None:
            selector.freeze()  # groups still in flight must not reactivate a task after the run said it is solved
        log.warning("%s", self.stopped)

    async def evaluate_final_weights(self) -> None:
        """The final evaluation, after training returned.

        At ``learner.steps`` with ``[eval]`` and ``eval.final_timeout_s`` > 0: the last batch's record (held back by
        :meth:`train`) waits for the round on the final weights, at most ``eval.final_timeout_s``, takes its result
        (``eval_*``), is checkpointed when due and written (:meth:`close_batch`).

        Stopped as solved (:meth:`stop_solved`) after a step of this process, as a run at ``learner.steps`` ends (the
        step's weights are already on every server: each step publishes before it is announced):

        1. with ``[eval]`` and ``eval.final_timeout_s`` > 0, the held-out round on the final weights starts
           (:meth:`learner.rollouts.rounds.RoundControl.start_final_evaluation`: an older round still running is
           abandoned; a round of these weights already running, or complete and not yet recorded, is the final one), its
           episodes handed out while the service keeps serving the actors (they are told to shut down only after this
           returns);
        2. with ``learner.checkpoint_every`` on, the last step is checkpointed again, so the checkpoint holds the
           task selector's solved windows and a resumed run stops at once too;
        3. the round is waited for, at most ``eval.final_timeout_s`` (:meth:`write_final_evaluation`), and its result
           is written as the evaluation record (learner.train.records.evaluation_record): the last batch's record
           went out before the run knew it was the last.

        Nothing else: a run that stopped as solved with no step in this process (resumed after it stopped as solved,
        or solved before its first step) had its weights evaluated before, by the process that trained them or the
        round of the initial weights.

        Raises:
            RuntimeError: ``metrics`` is not set.
        """
        if self._held is not None:
            (record, updates), self._held = self._held, None
            await self.service.control.finish_evaluation(self.final_eval_timeout_s)
            record.update(self.service.evaluation.take_result())
            return await self.close_batch(record, updates)
        if not self.stopped or self._last_record is None:
            return
        final = self.service.evaluation is not None and self.final_eval_timeout_s > 0
        if final:
            await self.service.control.start_final_evaluation()
        if self.lc.checkpoint_every:
            await self.checkpoint(dict(self._last_record))
        if final:
            await self.write_final_evaluation()

    async def write_final_evaluation(self) -> None:
        """Wait for the round on the final weights, at most ``eval.final_timeout_s`` (logged either way), then write
        the newest complete round not yet recorded (the final one, unless it timed out) as the evaluation record:
        ``step`` and ``policy_version`` of the final weights, ``wall_s`` now, and the round's ``eval_*`` fields. No
        record when no round is left to record.

        Raises:
            RuntimeError: ``metrics`` is not set.
        """
        if self.metrics is None:
            raise RuntimeError("TrainingLoop.metrics must be set before training")
        service = self.service
        await service.control.finish_evaluation(self.final_eval_timeout_s)
        result = service.evaluation.take_result()
        if not result:
            return
        record = evaluation_record(self.state.step, self.state.published_version, result, self.wall_s)
        self.metrics.write(record)
        log.info("evaluation record after step %d (version %d): held-out success %.2f on the weights of step %d",
                 record["step"], record["policy_version"], record["eval_success"], record["eval_step"])


async def keep_ranks_alive(lead: LeadTrainer) -> None:
    """Ping the other ranks whenever the trainer idles for a third of ``learner.dist_timeout_s``."""
    while True:
        await asyncio.sleep(min(lead.keepalive_s, 60.0))
        await asyncio.to_thread(lead.ping_if_idle)
