"""arpo-learner: the learner process. `run_learner` wires every component in one visible function.

Dataflow: ROUTER pump -> LearnerService (admission, dedup, acks) -> GroupScheduler -> Batcher (replay,
advantages) -> training loop (Trainer.train_step in a thread -> save weights -> WeightPublisher -> announce
the version -> checkpoint) -> metrics.jsonl. Stops after ``learner.steps`` optimizer steps in all (0 = until
SIGINT/SIGTERM), then tells the actors to shut down.

Schedules (``learner.schedule``): "async" trains on each batch as soon as the batcher has one, while the
staleness rule keeps handing out work; "lockstep" is ARPO's synchronous loop: hand out ``groups_per_step``
groups, wait for all of them, train (``updates_per_batch`` optimizer steps; no step when no group had reward
variance), publish, repeat. Both write the same metrics records.

Baseline pass (``learner.baseline_k`` > 0, ARPO's "valuable tasks"): before training, k rollouts of every task
with the initial policy (rounded up to whole groups), evaluated and never trained on; training then uses only
the tasks with at least ``baseline_min_success`` successes. The result is written to ``<run>/baseline.json`` and
a restarted learner reuses it; when no task qualifies the learner stops with an error that lists the results.

Ranks: ``torchrun --nproc-per-node N -m learner.main --config run.toml`` trains with N ranks (FSDP2); rank 0
runs everything above and drives the other ranks' trainers (learner.distributed, :func:`run_ranks`).

Resume: when ``<run>/checkpoints`` holds a checkpoint, the learner continues from it (model, optimizer,
replay buffer, scheduler statistics, counters, policy version, step), republishes its weights to every
inference server under its version, and repairs metrics.jsonl to match it (learner.checkpoint).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
import zmq.asyncio

from arpo_async.config import ConfigError, LearnerConfig, RunConfig, load_config
from arpo_async.config_doc import add_config_arguments
from arpo_async.inference_client import PolicyClient
from arpo_async.process import run_until_signal, setup_logging
from arpo_async.messages import Outcome
from arpo_async.metrics import MetricsWriter
from arpo_async.tasks import Task, load_tasks
from arpo_async.transport import SocketPump, exposure_warning, router_socket, start_authenticator
from learner.batcher import Batcher, ScoredGroup, train_samples
from learner.forced_tokens import ForcedTokens
from learner.trajectory_sample import TrajectorySampler
from learner.checkpoint import Checkpointer, capture, checkpoint_folders, reconcile_metrics, restore
from learner.publisher import DistributedPublisher, WeightPublisher
from learner.replay import ReplayBuffer, make_replay
from learner.scheduler import GroupScheduler
from learner.service import LearnerService, WindowStats
from learner.staleness import LockstepAdmission, StalenessManager
from learner.task_selection import BaselinePass, TaskSelector
from learner.distributed import LeadTrainer, RankGroupError, follow, init_ranks, leave, torchrun_world
from learner.trainer import Trainer, TrainerConfig, TrainerConfigError, TrainerInputError, resolve_device

log = logging.getLogger("arpo.learner")


def select_tasks(config: LearnerConfig) -> list[Task]:
    """The task pool: the configured folder (or the built-in suite), filtered by ``task_ids`` prefixes.

    Raises:
        arpo_async.tasks.TaskFormatError: a malformed task file (names the file).
        ValueError: the filter leaves no task.
    """
    tasks = load_tasks(config.tasks or None)
    if config.task_ids:
        tasks = [t for t in tasks if any(t.id == p or t.id.startswith(p) for p in config.task_ids)]
    if not tasks:
        raise ValueError(f"no task matches learner.task_ids={list(config.task_ids)}")
    return tasks


def trainer_config(config: LearnerConfig) -> TrainerConfig:
    """The trainer's settings from the learner config (optimizer, clip ranges, off-policy correction)."""
    return TrainerConfig(lr=config.lr, weight_decay=config.weight_decay, grad_clip=config.grad_clip,
                         eps_low=config.eps_low, eps_high=config.eps_high, dual_clip=config.dual_clip,
                         torch_threads=config.torch_threads, correction=config.correction,
                         decoupled_cap=config.decoupled_cap, tis_cap=config.tis_cap, device=config.device,
                         dtype=config.dtype, gradient_checkpointing=config.gradient_checkpointing,
                         max_tokens_per_microbatch=config.max_tokens_per_microbatch)


def replay_buffer(config: LearnerConfig) -> ReplayBuffer:
    """The success replay buffer chosen by ``replay_mode`` ("off" whenever ``replay`` is false)."""
    return make_replay(config.replay_mode if config.replay else "off", capacity_per_task=config.replay_capacity,
                       max_total=config.replay_max_total, seed=config.seed, inject_below=config.replay_inject_below,
                       alpha=config.replay_alpha, tau=config.replay_age_tau, beta=config.replay_length_beta)


async def run_learner(config: RunConfig, trainer: Trainer | LeadTrainer | None = None) -> None:
    """Build and connect the learner's components, resume from a checkpoint if there is one, train until
    ``learner.steps`` steps in all, then stop the actors.

    ``trainer``: the trainer to drive (under torchrun, rank 0's :class:`LeadTrainer`); None = load one here."""
    lc = config.learner
    tasks = select_tasks(lc)
    lockstep = lc.schedule == "lockstep"
    learner_id = uuid.uuid4().hex[:12]
    if trainer is None:
        trainer = await asyncio.to_thread(Trainer, config.model_path, trainer_config(lc))
    replay = replay_buffer(lc)
    baseline_path = config.run_path / BASELINE_FILE
    baseline = plan_baseline(tasks, lc, baseline_path,
                             resuming=bool(checkpoint_folders(config.run_path / "checkpoints")))
    if baseline is None and lc.baseline_k and baseline_path.exists():
        tasks = valuable_pool(tasks, load_baseline(baseline_path))
    selector = task_selector(tasks, lc) if baseline is None else None  # built from the pass's result
    training_budget = 0 if lockstep else None
    scheduler = GroupScheduler(tasks, lc.group_size, max_retries=lc.rollout_retries, seed=lc.seed,
                               group_budget=0 if baseline is not None else training_budget,
                               id_prefix=f"{learner_id[:6]}-",
                               pick_task=baseline.pick_task if baseline is not None else selector.pick_task)
    admission = (LockstepAdmission(lc.batch_trajectories) if lockstep
                 else StalenessManager(lc.batch_trajectories, lc.max_staleness))
    batcher = Batcher(replay, max_staleness=lc.max_staleness, groups_per_step=lc.groups_per_step,
                      format_reward_weight=lc.format_reward_weight, stratified=lc.stratified)
    client = PolicyClient(list(config.actors.inference_urls), api_key=config.serve.api_key)
    publisher = weight_publisher(config, client)
    checkpointer = Checkpointer(config.run_path / "checkpoints", keep=lc.keep_checkpoints)
    ctx = zmq.asyncio.Context()
    authenticator = start_authenticator(ctx, config.transport)
    warning = exposure_warning(config.transport)
    if warning:
        log.warning("%s", warning)
    sock = router_socket(ctx, config.transport)
    service: LearnerService
    pump = SocketPump(sock, routed=True, max_bytes=config.transport.max_message_bytes,
                      on_message=lambda env: service.on_message(env), on_bad=lambda p, r: service.on_bad(p, r),
                      on_error=lambda p, r: service.on_bad(p, r, kind="handler"))
    service = LearnerService(pump, scheduler, admission, batcher, learner_id=learner_id, selector=selector,
                             vocab_size=trainer.model.config.text_config.vocab_size,
                             peer_timeout_s=config.transport.peer_timeout_s,
                             sampler=TrajectorySampler(config.run_path / "trajectories", rate=lc.sample_trajectories,
                                                       disk_mb=lc.sample_disk_mb))
    metrics: MetricsWriter | None = None
    try:
        forced = (ForcedTokens(config.model_path, trainer.model.config.text_config.vocab_size)
                  if lc.mask_forced_tokens else None)
        loop = TrainingLoop(service, trainer, publisher, checkpointer, replay, lc, forced=forced)
        await loop.resume(config.run_path / "metrics.jsonl")
        metrics = loop.metrics = MetricsWriter(config.run_path / "metrics.jsonl",
                                               tensorboard=config.run_path / "tb" if lc.tensorboard else None)
        log.info("learner %s on %s (%s): %d tasks, G=%d, B=%d, eta=%d, from step %d / version %d",
                 learner_id, config.transport.endpoint, lc.schedule, len(tasks), lc.group_size,
                 lc.batch_trajectories, lc.max_staleness, service.step, service.version)
        async with asyncio.TaskGroup() as tg:
            pump_task = tg.create_task(pump.run())
            expire_task = tg.create_task(service.expire_loop())
            status_task = tg.create_task(write_status(service, config.run_path / "status.json"))
            loops = [pump_task, expire_task, status_task, tg.create_task(watch_stall(service, lc))]
            if isinstance(trainer, LeadTrainer):
                loops.append(tg.create_task(keep_ranks_alive(trainer)))
            if baseline is not None:
                await service.run_baseline(baseline)
                kept = save_baseline(baseline_path, baseline, lc)
                service.selector = task_selector(valuable_pool(tasks, kept), lc)
                scheduler.set_task_source(service.selector.pick_task, training_budget)
                service.last_step_at = time.monotonic()  # training starts now
                await service.dispatch()
            await (loop.run_lockstep() if lockstep else loop.run_async())
            await service.shutdown_actors("training finished")
            await pump.flush()
            for task in loops:
                task.cancel()
    finally:
        if metrics is not None:
            metrics.close()
        await client.aclose()
        if authenticator is not None:
            authenticator.stop()
        ctx.destroy(linger=0)


class StalledRun(RuntimeError):
    """No optimizer step for ``learner.stall_timeout_s`` while every group came back without a reward difference."""


async def watch_stall(service: LearnerService, lc: LearnerConfig, period_s: float = 5.0) -> None:
    """Say why no optimizer step happens (every ``learner.stall_warning_s``), and raise StalledRun after
    ``learner.stall_timeout_s`` (when set)."""
    warned_at = 0.0
    while True:
        await asyncio.sleep(period_s)
        now = time.monotonic()
        service.stall = service.stall_reason(now, after_s=lc.stall_warning_s)
        if service.stall and now - warned_at >= lc.stall_warning_s:
            log.warning("%s", service.stall)
            warned_at = now
        timeout = service.stall_reason(now, after_s=lc.stall_timeout_s) if lc.stall_timeout_s else None
        if timeout:
            raise StalledRun(f"{timeout} (learner.stall_timeout_s = {lc.stall_timeout_s:g} s)")


async def keep_ranks_alive(lead: LeadTrainer) -> None:
    """Ping the other ranks whenever the trainer idles for a third of ``learner.dist_timeout_s``."""
    while True:
        await asyncio.sleep(min(lead.keepalive_s, 60.0))
        await asyncio.to_thread(lead.ping_if_idle)


def run_ranks(config: RunConfig) -> int:
    """Under torchrun (WORLD_SIZE > 1): join the process group, load and shard the policy on every rank, then
    rank 0 runs the learner (driving the others through :class:`LeadTrainer`) and the others follow it.
    Returns this rank's exit code (learner.distributed describes what happens when a rank dies)."""
    lc = config.learner
    group = init_ranks(resolve_device(lc.device), lc.dist_timeout_s)
    log.info("rank %d of %d on %s", group.rank, group.world, group.device)
    try:
        trainer = Trainer(config.model_path, trainer_config(lc), group)
        if not group.lead:
            return follow(trainer, group)
        lead = LeadTrainer(trainer, group, lc.dist_timeout_s)
        finished: list[bool] = []

        async def learn() -> None:
            await run_learner(config, lead)
            finished.append(True)

        code = run_until_signal(learn(), "arpo-learner")
        if finished:  # after a signal or an error the other ranks are stopped by torchrun, or already gone
            lead.stop()
        return code
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def sync_backend(lc: LearnerConfig) -> str:
    """``learner.sync_backend`` resolved ("auto": nccl when the learner trains on CUDA, else gloo).

    Raises:
        ConfigError: "nccl" where torch sees no CUDA device (names the key).
    """
    backend = lc.sync_backend
    if backend == "auto":
        backend = "nccl" if resolve_device(lc.device).type == "cuda" else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("learner.sync_backend = \"nccl\" needs CUDA on the learner; use \"gloo\" (arpo-serve "
                          "joins weight groups with gloo) or \"auto\"")
    return backend


def weight_publisher(config: RunConfig, client: PolicyClient) -> WeightPublisher | DistributedPublisher:
    """The publisher ``learner.weight_sync`` names (learner.publisher)."""
    lc, urls = config.learner, list(config.actors.inference_urls)
    if lc.weight_sync == "disk":
        return WeightPublisher(client, urls, config.run_path / "weights", keep=lc.keep_weights,
                               verify_every=lc.verify_weights_every)
    return DistributedPublisher(client, urls, bucket_mb=lc.sync_bucket_mb, host=lc.sync_host, backend=sync_backend(lc),
                                timeout_s=lc.sync_timeout_s, verify_every=lc.verify_weights_every,
                                load_format=None if lc.sync_load_format == "tensors" else lc.sync_load_format)


BASELINE_FILE = "baseline.json"
"""The baseline pass's results in the run folder: {"k", "results": {task id: scores}, "valuable": [ids]}."""


def task_selector(tasks: list[Task], lc: LearnerConfig) -> TaskSelector:
    """The online task selector over ``tasks`` with the configured window, retirement and revisits."""
    return TaskSelector(tasks, window=lc.task_window, retire=lc.task_retire, revisit_every=lc.task_revisit_every,
                        revisit_prob=lc.task_revisit_prob, strategy=lc.task_strategy, seed=lc.seed)


def plan_baseline(tasks: list[Task], lc: LearnerConfig, path: Path, *, resuming: bool) -> BaselinePass | None:
    """The baseline pass to run before training, or None: when ``baseline_k`` is 0, when ``path`` holds a
    finished pass of this run (a restart reuses it), or when resuming a run that trained without one."""
    if not lc.baseline_k or path.exists():
        return None
    if resuming:
        log.warning("learner.baseline_k=%d but this run already trained without a baseline pass; not running one",
                    lc.baseline_k)
        return None
    return BaselinePass(tasks, lc.baseline_k, lc.group_size)


def save_baseline(path: Path, baseline: BaselinePass, lc: LearnerConfig) -> list[str]:
    """Write the finished baseline pass to ``path`` (atomically) and return the valuable task ids.

    Raises:
        ValueError: no task met ``baseline_min_success`` (nothing to train on; the message lists the results).
    """
    results = baseline.results
    kept = baseline.valuable(lc.baseline_min_success, drop_solved=lc.baseline_drop_solved)
    summary = {task_id: f"{sum(s >= 0.5 for s in scores)}/{len(scores)}" for task_id, scores in results.items()}
    if not kept:
        raise ValueError(f"the baseline pass found no task with >= {lc.baseline_min_success} successes in "
                         f"{lc.baseline_k} rollouts (successes per task: {summary}); lower "
                         "learner.baseline_min_success or set learner.baseline_k=0")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"k": lc.baseline_k, "results": results, "valuable": kept}, indent=1))
    tmp.replace(path)
    log.info("baseline pass: kept %d of %d tasks (successes per task: %s)", len(kept), len(results), summary)
    return kept


def load_baseline(path: Path) -> list[str]:
    """The valuable task ids of a finished baseline pass saved by :func:`save_baseline`.

    Raises:
        ValueError: the file is not JSON or has no non-empty list of ids under "valuable" (names the file).
    """
    try:
        kept = json.loads(path.read_text())["valuable"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a baseline pass result ({type(exc).__name__}: {exc}); remove it to run "
                         "the pass again") from exc
    if not isinstance(kept, list) or not kept or not all(isinstance(i, str) for i in kept):
        raise ValueError(f"{path}: \"valuable\" must be a non-empty list of task ids, got {kept!r}; remove it "
                         "to run the pass again")
    return kept


def valuable_pool(tasks: list[Task], kept: list[str]) -> list[Task]:
    """The tasks of ``tasks`` whose ids are in ``kept`` (pool order).

    Raises:
        ValueError: none of them is in the pool (a baseline.json from another task set).
    """
    pool = [t for t in tasks if t.id in set(kept)]
    if not pool:
        raise ValueError(f"none of the baseline pass's valuable tasks {kept} is in the task pool; remove "
                         f"{BASELINE_FILE} from the run folder to run the pass again")
    return pool


async def write_status(service: LearnerService, path: Path, period_s: float = 1.0) -> None:
    """Rewrite ``path`` with the service's status every ``period_s`` (atomically, via a temp file)."""
    tmp = path.with_suffix(".tmp")
    while True:
        tmp.write_text(json.dumps(service.status()))
        tmp.replace(path)
        await asyncio.sleep(period_s)


def take_round(batcher: Batcher) -> list[ScoredGroup]:
    """Lockstep: every scored group waiting in the batcher (the rollout batch, however many had variance)."""
    batch, batcher.ready = batcher.ready, []
    return batch


@dataclass
class TrainingLoop:
    """The learner's training loop for both schedules; counts steps in ``service.step`` (across restarts)."""

    service: LearnerService
    trainer: Trainer
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

    def __post_init__(self) -> None:
        self._started = time.monotonic()
        self._resumed: dict[str, Any] | None = None

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

    async def run_async(self) -> None:
        """Train on each batch as soon as the batcher has one."""
        service = self.service
        while not self.done:
            await service.batch_ready.wait()
            batch = service.batcher.take_batch()
            if not service.batcher.has_batch:
                service.batch_ready.clear()
            if batch is None:
                continue
            self.rollout_batches += 1
            await self.train(batch)

    async def run_lockstep(self) -> None:
        """ARPO's loop: one rollout batch out, all of it back, train, publish; nothing handed out meanwhile."""
        service = self.service
        while not self.done:
            await service.open_round(self.lc.groups_per_step)
            await service.round_done.wait()
            batch = take_round(service.batcher)
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
        window = service.window.take()
        samples = train_samples(batch, self.forced)
        updates = min(lc.updates_per_batch, max(1, len(samples)))
        if lc.steps:
            updates = min(updates, lc.steps - service.step)
        try:
            stats = await asyncio.to_thread(self.trainer.train_batch, samples, minibatches=updates)
        except TrainerInputError as error:  # every sample unusable: nothing to learn from, nothing changes
            self.skipped_batches += 1
            service.totals["unusable_batches"] += 1
            log.error("rollout batch %d: no usable sample (%s); no optimizer step", self.rollout_batches, error)
            return
        version = service.version + 1
        publish_s = await self.publisher.publish_from(self.trainer, version)
        await service.set_version(version)
        service.step += updates
        service.last_step_at, service.stall = time.monotonic(), None
        service.zero_variance_at_step = service.batcher.drops.get("zero_variance", 0)
        record = step_record(service.step, version, batch, stats, window, service, publish_s, self.wall_s,
                             schedule=lc.schedule, updates=updates, optimizer_steps=self.trainer.steps,
                             rollout_batches=self.rollout_batches, skipped_batches=self.skipped_batches)
        if self._resumed is not None:  # the first record after a restart says what was resumed
            record["resumed_from"], self._resumed = self._resumed, None
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


CORRECTION_STATS = ("is_weight_mean", "is_weight_max", "is_capped_frac", "behaviour_kl", "replayed_tokens",
                    "replayed_is_weight_mean", "ratio_mean", "approx_kl")
"""Trainer statistics copied into each metrics record (see learner.grpo.corrected_token_loss)."""


def success_rate(outcomes: Mapping[str, int]) -> tuple[float, int]:
    """(SUCCESS count / trainable count, trainable count) of outcome counts (Outcome value -> trajectories);
    (0.0, 0) when none is trainable (ENV_ERROR and ABORTED never are)."""
    trainable = sum(n for outcome, n in outcomes.items() if Outcome(outcome).trainable)
    return (outcomes.get("SUCCESS", 0) / trainable if trainable else 0.0), trainable


def per_task_success(window: WindowStats) -> dict[str, dict[str, float | int]]:
    """Per-task and per-family success of a window, as metrics.jsonl keys.

    Returns:
        ``task_success`` {task id: success rate in [0, 1]}, ``task_trajectories`` {task id: trainable
        trajectories} and ``family_success`` {family: success rate over its tasks' trainable trajectories}; tasks
        and families with no trainable trajectory in the window are left out.
    """
    by_family: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for task_id, outcomes in window.task_outcomes.items():
        by_family[window.families[task_id]].update(outcomes)
    per_task = {task_id: success_rate(outcomes) for task_id, outcomes in sorted(window.task_outcomes.items())}
    per_family = {family: success_rate(outcomes) for family, outcomes in sorted(by_family.items())}
    return {"task_success": {k: rate for k, (rate, n) in per_task.items() if n},
            "task_trajectories": {k: n for k, (rate, n) in per_task.items() if n},
            "family_success": {k: rate for k, (rate, n) in per_family.items() if n}}


def step_record(step: int, version: int, batch: list[ScoredGroup], stats: dict[str, Any],
                window: WindowStats, service: LearnerService, publish_s: float, wall_s: float,
                **extra: Any) -> dict[str, Any]:
    """One metrics.jsonl record. success_rate (and task_success, family_success) is over every trainable
    trajectory received since the last training batch (``window``); staleness_* is the policy lag of the batch's
    fresh rollouts (replayed successes are old by design and left out); stage_s is p50/p95 of the window's per-stage
    timings (arpo_async.stage_timings) and queues the service's queue depths now; ``extra`` adds schedule-level
    counters."""
    rewards = [r for g in batch for r in g.rewards]
    lags = [lag for g in batch for lag in g.fresh_policy_lag] or [0]
    return {
        "step": step, "policy_version": version,
        "trajectories": sum(len(g.trajectories) for g in batch),
        "success_rate": success_rate(window.outcomes)[0], **per_task_success(window),
        "batch_success_rate": sum(g.sampled_success for g in batch) / len(batch),
        "reward_mean": sum(rewards) / len(rewards),
        "loss": stats["loss"], "grad_norm": stats.get("grad_norm"), "clip_frac": stats.get("clip_frac"),
        "tokens": stats.get("tokens"), "train_s": stats.get("seconds"), "publish_s": publish_s,
        "dropped_samples": stats.get("dropped_samples", 0.0),
        "replay_injections": sum(g.injected for g in batch),
        "staleness_mean": sum(lags) / len(lags), "staleness_max": max(lags), "staleness_min": min(lags),
        "correction": {k: stats[k] for k in CORRECTION_STATS if k in stats},
        "replay": service.batcher.replay.stats(),
        "task_selection": service.selector.stats() if service.selector is not None else {},
        "outcomes": dict(window.outcomes), "drops": dict(service.batcher.drops), "totals": dict(service.totals),
        "rejections": dict(service.rejections),
        "stage_s": window.stages.summary(), "queues": service.queue_depths(),
        "wall_s": round(wall_s, 3), **extra,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="arpo-learner", description="The GRPO learner: hands out rollouts to arpo-actors over ZeroMQ, trains "
        "on their trajectories, publishes weights to the inference servers and writes <run_dir>/metrics.jsonl. "
        "Under torchrun (`torchrun --nproc-per-node N -m learner.main ...`) it trains with N ranks.")
    add_config_arguments(parser, ("", "learner", "transport", "actors", "serve"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        log.error("%s", e)
        return 2
    try:
        resolve_device(config.learner.device)
        if config.learner.weight_sync == "distributed":
            sync_backend(config.learner)
    except (TrainerConfigError, ConfigError) as e:
        log.error("%s", e)
        return 2
    if torchrun_world() > 1:
        try:
            code = run_ranks(config)
        except RankGroupError as e:
            log.error("%s", e)
            code = 1
        leave(code)
    return run_until_signal(run_learner(config), "arpo-learner")


if __name__ == "__main__":
    sys.exit(main())
