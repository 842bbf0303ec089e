"""The training loop: batches in, optimizer steps, published weights, checkpoints and metrics records out.

Role: for each batch the learner service puts on the bounded ``batches`` queue: ``updates_per_batch`` optimizer
steps in a thread (learner.train.training_step) -> publish the weights as the next policy version (learner.train.publisher) ->
report back with one call, :meth:`LearnerService.on_trained` (the service announces the version to the actors and
admits more work) -> checkpoint every ``learner.checkpoint_every`` steps -> one metrics.jsonl record
(learner.train.records). Schedules (``learner.schedule``): "async" trains on each batch as soon as the service has one,
while the staleness rule keeps handing out work; "lockstep" is ARPO's synchronous loop: open a rollout batch of
``groups_per_step`` groups, wait for all of it, train (no step when no group had reward variance), publish,
repeat. Both write the same records. Held-out evaluation (``[eval]``, learner.rollouts.evaluation_rounds): a record carries
the newest evaluation round completed since the previous record (``eval_success``, ...); the last batch's record
waits for the round on the final weights, at most ``eval.final_timeout_s``.

Owns: the loop's counters (rollout and skipped batches, wall time across restarts), resuming from the newest
checkpoint (learner.train.checkpoint), and keeping the servers current: every ``learner.resync_interval_s`` a server
behind the current policy version (restarted after a publication) gets the current weights (``catch_up``), never
while a batch trains or publishes.

Invariants: never trains past ``learner.steps`` optimizer steps in all; a version is announced only after its
weights reached every inference server; the first record after a restart says what was resumed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arpo_async.config import LearnerConfig
from arpo_async.metrics import MetricsWriter
from learner.algo.batcher import BatchQueue, ScoredGroup
from learner.train.checkpoint import Checkpointer, capture, reconcile_metrics, restore
from learner.train.distributed import LeadTrainer
from learner.algo.forced_tokens import ForcedTokens
from learner.train.publisher import DistributedPublisher, WeightPublisher
from learner.train.records import step_record
from learner.algo.replay import ReplayBuffer
from learner.rollouts.service import LearnerService
from learner.train.trainer import Trainer, TrainerInputError
from learner.train.training_step import train_on_batch

log = logging.getLogger("arpo.learner")


@dataclass
class TrainingLoop:
    """The learner's training loop for both schedules (see the module docstring).

    Counts optimizer steps in ``service.step`` (across restarts), which only :meth:`LearnerService.on_trained`
    changes.
    """

    service: LearnerService
    batches: BatchQueue
    """Training batches from the service (the same queue as ``service.batches``)."""
    trainer: Trainer | LeadTrainer
    publisher: WeightPublisher | DistributedPublisher
    checkpointer: Checkpointer
    replay: ReplayBuffer
    lc: LearnerConfig
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

    def __post_init__(self) -> None:
        self._started = time.monotonic()
        self._resumed: dict[str, Any] | None = None
        self._weights = asyncio.Lock()
        """Held while the trainer's weights change or go out (a batch's training and publication, a catch-up)."""

    @property
    def extra_state(self) -> dict[str, Any]:
        """Components saved in checkpoints besides the service and the replay buffer."""
        return {"task_selection": self.service.selector} if self.service.selector is not None else {}

    @property
    def done(self) -> bool:
        return self.lc.steps != 0 and self.service.step >= self.lc.steps

    @property
    def wall_s(self) -> float:
        return self.wall_offset_s + time.monotonic() - self._started

    async def resume(self, metrics_path: Path) -> None:
        """Continue from the newest checkpoint, if any: restore every component, repair metrics.jsonl, and
        republish the checkpoint's weights to every inference server under its version."""
        found = await asyncio.to_thread(self.checkpointer.load_latest, self.trainer)
        if found is None:
            return
        folder, state, meta = found
        restore(state, self.service, self.replay, self.extra_state)
        self.rollout_batches = int(meta.get("rollout_batches", 0))
        self.skipped_batches = int(meta.get("skipped_batches", 0))
        self.wall_offset_s = float(meta.get("wall_s", 0.0))
        moved = reconcile_metrics(metrics_path, self.service.step, meta.get("records", []))
        version = self.service.version
        self._resumed = {"checkpoint": folder.name, "step": self.service.step, "policy_version": version,
                         "trainer_steps": self.trainer.steps, "replay": self.replay.stats(),
                         "rolled_back_records": moved}
        await self.publisher.publish_from(self.trainer, version)
        log.warning("resumed from %s: step %d, policy version %d, %d trainer steps, replay %s%s", folder,
                    self.service.step, version, self.trainer.steps, self.replay.stats(),
                    f"; {moved} metrics records after it moved to metrics.rolled_back.jsonl" if moved else "")

    async def run(self, metrics: MetricsWriter) -> None:
        """Train until ``learner.steps`` steps in all (0: until cancelled) on the configured schedule, writing one
        record per batch to ``metrics``."""
        self.metrics = metrics
        training = asyncio.ensure_future(self.run_lockstep() if self.lc.schedule == "lockstep" else self.run_async())
        if self.lc.resync_interval_s <= 0:
            return await training
        keeper = asyncio.create_task(self.keep_servers_current())
        try:
            await asyncio.wait([training, keeper], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (training, keeper):
                task.cancel()
            await asyncio.gather(training, keeper, return_exceptions=True)
        if keeper.done() and not keeper.cancelled() and keeper.exception() is not None:
            raise keeper.exception()  # SyncRejected or WeightsMismatch: the learner stops, as after a publication
        return training.result()

    async def keep_servers_current(self) -> None:
        """Every ``learner.resync_interval_s``, send the current weights to each server behind the current policy
        version (``publisher.catch_up``). Runs until cancelled; a check that fails is logged and tried again.

        Raises:
            SyncRejected, WeightsMismatch: as from a publication (the learner stops).
        """
        while True:
            await asyncio.sleep(self.lc.resync_interval_s)
            async with self._weights:
                if self.service.version > 0:
                    await self.publisher.catch_up(self.trainer, self.service.version)

    async def run_async(self) -> None:
        """Train on each batch as soon as the service has one."""
        while not self.done:
            batch = await self.batches.get()
            self.rollout_batches += 1
            await self.train(batch)

    async def run_lockstep(self) -> None:
        """ARPO's loop: one rollout batch out, all of it back, train, publish; nothing handed out meanwhile."""
        while not self.done:
            await self.service.open_round(self.lc.groups_per_step)
            batch = await self.batches.get()
            self.rollout_batches += 1
            if not batch:
                self.skipped_batches += 1
                log.info("rollout batch %d: no group with reward variance; no optimizer step", self.rollout_batches)
                continue
            await self.train(batch)

    async def train(self, batch: list[ScoredGroup]) -> None:
        """``updates_per_batch`` optimizer steps on ``batch`` (never past ``learner.steps``), then publish the
        new weights once as the next version, announce it, checkpoint, and write the batch's metrics record
        (its ``step`` is the optimizer step count after the batch; ``updates`` the steps it took)."""
        service, lc = self.service, self.lc
        window = service.stats.window.take()
        async with self._weights:
            try:
                stats, updates = await asyncio.to_thread(train_on_batch, self.trainer, batch, lc, self.forced,
                                                         service.step)
            except TrainerInputError as error:  # every sample unusable: nothing to learn from, nothing changes
                self.skipped_batches += 1
                service.on_unusable_batch()
                log.error("rollout batch %d: no usable sample (%s); no optimizer step", self.rollout_batches, error)
                return
            version = service.version + 1
            publish_s = await self.publisher.publish_from(self.trainer, version)
            await service.on_trained(service.step + updates, version)
        record = step_record(service.step, version, batch, stats, window, service.counters(), publish_s, self.wall_s,
                             schedule=lc.schedule, updates=updates, optimizer_steps=self.trainer.steps,
                             rollout_batches=self.rollout_batches, skipped_batches=self.skipped_batches)
        if self._resumed is not None:  # the first record after a restart says what was resumed
            record["resumed_from"], self._resumed = self._resumed, None
        if service.evaluation is not None:
            if self.done and self.final_eval_timeout_s > 0:
                await service.finish_evaluation(self.final_eval_timeout_s)
            record.update(service.evaluation.take_result())
        every = lc.checkpoint_every
        if every and service.step // every > (service.step - updates) // every:
            await self.checkpoint(record)
        if self.metrics is None:
            raise RuntimeError("TrainingLoop.metrics must be set before training")
        self.metrics.write(record)
        log.info("step %d: version %d, success %.2f, loss %.4f, lag %.2f", service.step, version,
                 record["success_rate"], record["loss"], record["staleness_mean"])

    async def checkpoint(self, record: dict[str, Any]) -> None:
        """Snapshot the learner now and write it in a thread (the service keeps serving actors meanwhile).
        ``record`` is the metrics record of the batch just trained (kept in the checkpoint's meta.json)."""
        state = capture(self.service, self.replay, self.extra_state)
        meta = {"policy_version": self.service.version, "wall_s": record["wall_s"],
                "rollout_batches": self.rollout_batches, "skipped_batches": self.skipped_batches,
                "replay": self.replay.stats(), "totals": dict(self.service.totals), "records": [record]}
        started = time.perf_counter()
        folder = await asyncio.to_thread(self.checkpointer.save, self.service.step, self.trainer, state, meta)
        record["checkpoint_s"] = round(time.perf_counter() - started, 3)
        log.info("checkpoint %s (%.1f s)", folder, record["checkpoint_s"])


async def keep_ranks_alive(lead: LeadTrainer) -> None:
    """Ping the other ranks whenever the trainer idles for a third of ``learner.dist_timeout_s``."""
    while True:
        await asyncio.sleep(min(lead.keepalive_s, 60.0))
        await asyncio.to_thread(lead.ping_if_idle)
