"""arpo-learner: the learner process. `main` wires every component in one visible function.

Dataflow: ROUTER pump -> LearnerService (admission, dedup, acks) -> GroupScheduler -> Batcher (replay,
advantages) -> training loop (Trainer.train_step in a thread -> save weights -> WeightPublisher -> announce
the version) -> metrics.jsonl. Stops after ``learner.steps`` optimizer steps (0 = until SIGINT/SIGTERM),
then tells the actors to shut down.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import zmq.asyncio

from actors.policy_client import PolicyClient
from arpo_async.config import ConfigError, LearnerConfig, RunConfig, load_config
from arpo_async.process import run_until_signal, setup_logging
from arpo_async.metrics import MetricsWriter
from arpo_async.tasks import Task, load_tasks
from arpo_async.transport import SocketPump, router_socket
from learner.batcher import Batcher, ScoredGroup, train_samples
from learner.publisher import WeightPublisher
from learner.replay import SuccessReplay
from learner.scheduler import GroupScheduler
from learner.service import LearnerService
from learner.staleness import StalenessManager
from learner.trainer import Trainer, TrainerConfig

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
    return TrainerConfig(lr=config.lr, weight_decay=config.weight_decay, grad_clip=config.grad_clip,
                         eps_low=config.eps_low, eps_high=config.eps_high, dual_clip=config.dual_clip,
                         torch_threads=config.torch_threads)


async def run_learner(config: RunConfig) -> None:
    """Build and connect the learner's components, train ``learner.steps`` steps, then stop the actors."""
    lc = config.learner
    tasks = select_tasks(lc)
    trainer = await asyncio.to_thread(Trainer, config.model_path, trainer_config(lc))
    replay = SuccessReplay(capacity_per_task=lc.replay_capacity, enabled=lc.replay, seed=lc.seed)
    scheduler = GroupScheduler(tasks, lc.group_size, max_retries=lc.rollout_retries, seed=lc.seed)
    staleness = StalenessManager(lc.batch_trajectories, lc.max_staleness)
    batcher = Batcher(replay, max_staleness=lc.max_staleness, groups_per_step=lc.groups_per_step,
                      format_reward_weight=lc.format_reward_weight)
    client = PolicyClient(list(config.actors.inference_urls))
    publisher = WeightPublisher(client, list(config.actors.inference_urls), config.run_path / "weights",
                                keep=lc.keep_weights)
    metrics = MetricsWriter(config.run_path / "metrics.jsonl")
    ctx = zmq.asyncio.Context()
    sock = router_socket(ctx, config.transport)
    service: LearnerService
    pump = SocketPump(sock, routed=True, max_bytes=config.transport.max_message_bytes,
                      on_message=lambda env: service.on_message(env), on_bad=lambda p, r: service.on_bad(p, r))
    service = LearnerService(pump, scheduler, staleness, batcher)
    log.info("learner %s on %s: %d tasks, G=%d, B=%d, eta=%d", service.learner_id, config.transport.endpoint,
             len(tasks), lc.group_size, lc.batch_trajectories, lc.max_staleness)
    try:
        async with asyncio.TaskGroup() as tg:
            pump_task = tg.create_task(pump.run())
            expire_task = tg.create_task(service.expire_loop())
            status_task = tg.create_task(write_status(service, config.run_path / "status.json"))
            await training_loop(service, trainer, publisher, metrics, lc)
            await service.shutdown_actors("training finished")
            await pump.flush()
            pump_task.cancel()
            expire_task.cancel()
            status_task.cancel()
    finally:
        metrics.close()
        await client.aclose()
        ctx.destroy(linger=0)


async def write_status(service: LearnerService, path: Path, period_s: float = 1.0) -> None:
    """Rewrite ``path`` with the service's status every ``period_s`` (atomically, via a temp file)."""
    tmp = path.with_suffix(".tmp")
    while True:
        tmp.write_text(json.dumps(service.status()))
        tmp.replace(path)
        await asyncio.sleep(period_s)


async def training_loop(service: LearnerService, trainer: Trainer, publisher: WeightPublisher,
                        metrics: MetricsWriter, lc: LearnerConfig) -> None:
    """Train on each batch as it becomes ready; publish and announce every new version."""
    started = time.monotonic()
    step = 0
    while lc.steps == 0 or step < lc.steps:
        await service.batch_ready.wait()
        batch = service.batcher.take_batch()
        if not service.batcher.has_batch:
            service.batch_ready.clear()
        if batch is None:
            continue
        stats = await asyncio.to_thread(trainer.train_step, train_samples(batch))
        version = service.version + 1
        await asyncio.to_thread(trainer.save_weights, publisher.folder(version))
        publish_s = await publisher.publish(version)
        await service.set_version(version)
        step += 1
        record = step_record(step, version, batch, stats, service, publish_s, time.monotonic() - started)
        metrics.write(record)
        log.info("step %d: version %d, success %.2f, loss %.4f, lag %.2f", step, version,
                 record["success_rate"], record["loss"], record["staleness_mean"])


def step_record(step: int, version: int, batch: list[ScoredGroup], stats: dict[str, Any],
                service: LearnerService, publish_s: float, wall_s: float) -> dict[str, Any]:
    """One metrics.jsonl record. success_rate is over every trainable trajectory received since the last step."""
    window = service.window.take()
    trainable = sum(n for outcome, n in window.items() if outcome not in ("ENV_ERROR", "ABORTED"))
    rewards = [r for g in batch for r in g.rewards]
    lags = [lag for g in batch for lag in g.policy_lag]
    return {
        "step": step, "policy_version": version,
        "trajectories": sum(len(g.trajectories) for g in batch),
        "success_rate": window.get("SUCCESS", 0) / trainable if trainable else 0.0,
        "batch_success_rate": sum(g.sampled_success for g in batch) / len(batch),
        "reward_mean": sum(rewards) / len(rewards),
        "loss": stats["loss"], "grad_norm": stats.get("grad_norm"), "clip_frac": stats.get("clip_frac"),
        "tokens": stats.get("tokens"), "train_s": stats.get("seconds"), "publish_s": publish_s,
        "replay_injections": sum(g.injected for g in batch),
        "staleness_mean": sum(lags) / len(lags), "staleness_max": max(lags), "staleness_min": min(lags),
        "outcomes": dict(window), "drops": dict(service.batcher.drops), "totals": dict(service.totals),
        "wall_s": round(wall_s, 3),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="arpo-learner", description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, help="run TOML file (see arpo_async.config)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set learner.steps=10 (repeatable)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        log.error("%s", e)
        return 2
    return run_until_signal(run_learner(config), "arpo-learner")


if __name__ == "__main__":
    sys.exit(main())
