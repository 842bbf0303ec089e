"""The run: one learner run's state and its phases, from the first message to the actors' shutdown.

Role: :class:`Run` owns the run's state (learner.state.RunState: step, published policy version, counters; saved
and restored with every checkpoint) and drives the phases of a run in one function, :meth:`Run.run`, in this order:

1. resume: continue from the newest checkpoint of ``<run>/checkpoints`` when there is one (learner.train.loop);
2. first evaluation: a fresh run hands out the held-out evaluation round of its initial weights (``[eval]``,
   learner.rollouts.evaluation_rounds); its episodes go out ahead of other work and run beside the next phases;
3. task pre-pass: ARPO's pass over every task with the initial policy, when ``learner.prepass_k`` > 0 and the run
   folder holds no finished one (learner.algo.prepass); then training switches to the tasks it kept;
4. training: the training loop until ``learner.steps`` optimizer steps in all, or every task solved
   (learner.train.loop.TrainingLoop.run);
5. final evaluation: the held-out round on the final weights, waited for at most ``eval.final_timeout_s``
   (learner.train.loop.TrainingLoop.final_evaluation): at ``learner.steps`` the last batch's metrics record, held
   back by the loop, carries the round's result and is then checkpointed and written; a run stopped as solved
   checkpoints its last step again and writes the round's result as one more record;
6. shutdown: status.json's last word (why the run stopped), the actors told to stop, the outbox flushed.

Each phase is timed, as AReaL's trainer times its stages (``stats_tracker.record_timing(...)`` around rollout,
advantages, update, weight update, save and eval in ``RLTrainer.train``, areal/experimental/trainer/rl.py,
github.com/inclusionAI/AReaL at ea73679): the seconds of each are logged when it ends and kept in status.json as
``phase_s``. The rollouts room (learner.rollouts.service.LearnerService) only takes messages in and dispatches them;
the run's background tasks (the ROUTER pump, the service, peer expiry, status.json, the stall check, the loop-lag
probe, the queue-depth peaks, and under torchrun the other ranks' keep-alive) are started in :meth:`Run.run` and end
with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from arpo_async.config import LearnerConfig, RunConfig, to_dict
from arpo_async.metrics import MetricsWriter, WandbSettings
from arpo_async.transport import Envelope, Outbox, SocketPump
from learner.algo.prepass import TaskPlan
from learner.rollouts.run_stats import write_status, write_status_now
from learner.rollouts.service import LearnerService
from learner.state import RunState
from learner.train.loop import TrainingLoop

log = logging.getLogger("arpo.learner")

PHASES = ("resume", "first_evaluation", "prepass", "training", "final_evaluation", "shutdown")
"""The timed phases of a run, in order (status.json ``phase_s``)."""


@dataclass
class Run:
    """One learner run: its state and the components that serve and train it, wired by learner.main.run_learner.

    Attributes:
        config: the run's configuration.
        state: the run's state, the one RunState every component was built with.
        plan: where the run's tasks come from (a pre-pass first, or training at once).
        pump: the ROUTER socket's pump (``inbox`` in, ``outbox`` out).
        inbox: messages from actors, for the service.
        outbox: messages to actors.
        service: the rollouts room: intake and dispatch.
        loop: the training loop.
        keep_ranks_alive: under torchrun, the task that pings the other ranks while the trainer idles
            (learner.train.loop.keep_ranks_alive); None with one rank.
        phase_s: seconds each phase of :data:`PHASES` took in this process, as they end.
    """

    config: RunConfig
    state: RunState
    plan: TaskPlan
    pump: SocketPump
    inbox: asyncio.Queue[Envelope]
    outbox: Outbox
    service: LearnerService
    loop: TrainingLoop
    keep_ranks_alive: Callable[[], Awaitable[None]] | None = None
    phase_s: dict[str, float] = field(default_factory=dict)

    @property
    def folder(self) -> Path:
        """The run folder (``run_dir``)."""
        return self.config.run_path

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Time one phase: its seconds go in :attr:`phase_s` and a log line when it ends (or fails)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.phase_s[phase] = round(time.perf_counter() - started, 3)
            log.info("phase %s: %.1f s", phase, self.phase_s[phase])

    def status(self) -> dict:
        """status.json now: the service's snapshot and the phases' seconds so far (``phase_s``)."""
        return {**self.service.report.status(), "phase_s": dict(self.phase_s)}

    async def run(self) -> None:
        """Run every phase in order (see the module docstring), writing metrics records to <run>/metrics.jsonl
        (and TensorBoard, W&B when configured).

        Raises:
            ValueError: the pre-pass kept no task (learner.algo.prepass.save_prepass).
            whatever a background task or the training loop raises (the run stops; learner.train.loop,
            learner.rollouts.run_stats.StalledRun, learner.algo.task_selection.NoTaskLeft).
        """
        config, lc, service = self.config, self.config.learner, self.service
        with self.timed("resume"):  # before metrics.jsonl opens: resuming repairs it
            await self.loop.resume(self.folder / "metrics.jsonl")
        log.info("learner %s on %s (%s): %d tasks, G=%d, B=%d, eta=%d, from step %d / version %d%s",
                 service.learner_id, config.transport.endpoint, lc.schedule, len(self.plan.pool), lc.group_size,
                 lc.batch_trajectories, lc.max_staleness, self.state.step, self.state.published_version,
                 f"; evaluating {len(service.evaluation.tasks)} tasks x {config.eval.repeats}"
                 if service.evaluation is not None else "")
        wandb = (WandbSettings(lc.wandb_project, config.resolved_run_id, self.folder, to_dict(config))
                 if lc.wandb_project else None)
        with MetricsWriter(self.folder / "metrics.jsonl", tensorboard=self.folder / "tb" if lc.tensorboard else None,
                           wandb=wandb) as metrics:
            await self.phases(metrics)

    async def phases(self, metrics: MetricsWriter) -> None:
        """Phases 2-6 with the run's background tasks running beside them (see the module docstring)."""
        lc, service = self.config.learner, self.service
        async with asyncio.TaskGroup() as tg:
            background = [tg.create_task(self.pump.run()), tg.create_task(service.serve(self.inbox)),
                          tg.create_task(service.peers.expire_loop()),
                          tg.create_task(write_status(self.folder / "status.json", self.status)),
                          tg.create_task(service.stats.watch_stall(lc.stall_warning_s, lc.stall_timeout_s)),
                          tg.create_task(service.stats.lag.run()),
                          tg.create_task(service.stats.watch_depths(service.report.queue_depths))]
            if self.keep_ranks_alive is not None:
                background.append(tg.create_task(self.keep_ranks_alive()))
            with self.timed("first_evaluation"):
                await service.control.begin_evaluation()
            with self.timed("prepass"):
                await run_prepass(self.plan, service, lc)
            with self.timed("training"):
                await self.loop.run(metrics)
            with self.timed("final_evaluation"):
                await self.loop.final_evaluation()
            with self.timed("shutdown"):
                service.report.stopped = self.loop.stopped
                write_status_now(self.folder / "status.json", self.status)  # `arpo run` says why it stopped
                await service.shutdown_actors(self.loop.stopped or "training finished")
                await self.outbox.flush()
            for task in background:
                task.cancel()


async def run_prepass(plan: TaskPlan, service: LearnerService, lc: LearnerConfig) -> None:
    """The task pre-pass, when ``plan`` has one due: hand out its groups through ``service`` until every one came
    back (learner.rollouts.rounds.RoundControl.run_prepass), save it (<run>/prepass.json), then switch the
    service to training on the tasks it kept (lockstep: only the rounds the training loop opens). Nothing when none
    is due.

    Raises:
        ValueError: no task met ``learner.prepass_min_success`` (learner.algo.prepass.save_prepass).
    """
    if plan.prepass is None:
        return
    await service.control.run_prepass(plan.prepass)
    selector = plan.finish_prepass(lc)
    await service.control.start_training(selector, 0 if lc.schedule == "lockstep" else None)
