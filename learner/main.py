"""arpo-learner: the learner process. `run_learner` wires every component in one visible function; the run it
builds (learner.run.Run) owns the run's state and drives its phases.

Rooms, from the bottom up: learner.state (RunState), learner.algo (the RL algorithm, no torch trainer),
learner.rollouts (the conversation with actors), learner.train (the loop, the trainer, publication, checkpoints),
learner.run (the run's phases), and this module (validation and wiring).
Dataflow (every queue and task is made in `run_learner`): ROUTER SocketPump -> inbox -> LearnerService.serve
(admission, dedup, acks, replies on the outbox) -> GroupScheduler (complete groups) -> ``groups`` ->
TrainingLoop (learner.train.loop: score -> replay -> advantages per group (learner.algo.batcher), then per batch
samples -> optimizer steps in a thread -> WeightPublisher -> RunState.advance -> ``service.on_trained()``
announces the version -> checkpoint -> metrics.jsonl via learner.train.records).
Phases (learner.run): resume, the first held-out evaluation, the task pre-pass (``learner.prepass_k`` > 0,
learner.algo.prepass), training until ``learner.steps`` optimizer steps in all (0 = until SIGINT/SIGTERM) or every
task solved (``learner.stop_when_solved``; the line saying so is logged and kept in status.json as ``stopped``),
the final evaluation, then the actors are told to shut down.

Validation: ``main`` builds the run's inputs (:func:`load_inputs`: tasks, evaluation tasks, the replay with its
demonstrations, the advantage function, the task plan) once, before the model loads, and the run uses them.

Ranks: ``torchrun --nproc-per-node N -m learner.main --config run.toml`` trains with N ranks (FSDP2); rank 0
runs everything above and drives the other ranks' trainers (learner.train.distributed, :func:`run_ranks`).

Resume: when ``<run>/checkpoints`` holds a checkpoint, the learner continues from it (model, optimizer,
replay buffer, scheduler statistics, counters, policy version, step), republishes its weights to every
inference server under its version, and repairs metrics.jsonl to match it (learner.train.checkpoint).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import functools
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

from arpo_async.config import ConfigError, LearnerConfig, RunConfig, load_config
from arpo_async.config_doc import add_config_arguments
from arpo_async.demos import DemonstrationError, load_demonstrations
from arpo_async.engine import InferenceEngine
from arpo_async.inference_client import PolicyClient, admin_api_key
from arpo_async.metrics import import_wandb
from arpo_async.model.inputs import PromptEncoder
from arpo_async.process import run_until_signal, setup_logging
from arpo_async.sglang_engine import sglang_engines
from arpo_async.task_sets import select_tasks
from arpo_async.tasks import Task, TaskFormatError
from arpo_async.transport import INBOX_SIZE, Envelope, Outbox, SocketPump, learner_socket
from learner.algo.advantages import AdvantageFunction, load_advantage_function
from learner.algo.batcher import Batcher
from learner.algo.forced_tokens import ForcedTokens
from learner.algo.prepass import TaskPlan, plan_tasks
from learner.algo.replay import ReplayBuffer, ReplayError, make_replay
from learner.rollouts.evaluation_rounds import EvaluationRounds, evaluation_tasks
from learner.rollouts.scheduler import GroupScheduler
from learner.rollouts.rounds import GroupQueue
from learner.rollouts.service import LearnerService
from learner.rollouts.staleness import LockstepAdmission, StalenessManager
from learner.rollouts.trajectory_sample import TrajectorySampler
from learner.run import Run
from learner.state import RunState
from learner.train.checkpoint import Checkpointer, checkpoint_folders
from learner.train.distributed import RankGroupError, init_ranks, leave, torchrun_world
from learner.train.lead_trainer import LeadTrainer, follow
from learner.train.loop import TrainingLoop, keep_ranks_alive
from learner.train.publish_dtype import PublishDtypes
from learner.train.publisher import DistributedPublisher, WeightPublisher
from learner.train.train_engine import TrainEngine
from learner.train.trainer import Trainer, resolve_device

log = logging.getLogger("arpo.learner")


def replay_buffer(config: LearnerConfig) -> ReplayBuffer:
    """The success replay buffer chosen by ``replay_mode`` ("off" whenever ``replay`` is false)."""
    return make_replay(config.replay_mode if config.replay else "off", capacity_per_task=config.replay_capacity,
                       max_total=config.replay_max_total, seed=config.seed, inject_below=config.replay_inject_below,
                       alpha=config.replay_alpha, tau=config.replay_age_tau, beta=config.replay_length_beta,
                       success_threshold=config.success_threshold)


def seed_demonstrations(config: RunConfig, replay: ReplayBuffer, task_ids: list[str]) -> int:
    """Put the demonstrations of ``learner.replay_demos`` (arpo_async.demos) in ``replay`` as stored successes of
    their tasks; returns how many (0 when the key is empty). A resumed run's checkpoint then replaces the replay's
    contents, demonstrations still held included.

    Raises:
        ConfigError: the replay is off, or the folder holds no usable demonstration of the run's tasks, or one that
            cannot be used (one line naming the file and why, e.g. another screen size, a symbolic link, a score
            that is no success: arpo_async.demos).
    """
    lc, ac = config.learner, config.actors
    if not lc.replay_demos:
        return 0
    if replay.mode == "off":
        raise ConfigError("learner.replay_demos needs the success replay (learner.replay = true and replay_mode "
                          "\"arpo\" or \"prioritized\"): demonstrations reach training only through it")
    try:
        demos = load_demonstrations(lc.replay_demos, PromptEncoder(config.model_path), screen_size=ac.screen_size,
                                    history_images=ac.history_images, prompt_style=ac.prompt_style,
                                    task_ids=task_ids, success_threshold=lc.success_threshold)
        for task_id, trajectories in demos.items():
            replay.add_group(task_id, trajectories, [t.score for t in trajectories])
    except (DemonstrationError, ReplayError) as error:  # one line naming the file, never a traceback
        raise ConfigError(f"learner.replay_demos: {error}" if isinstance(error, ReplayError) else str(error)) \
            from error
    count = sum(map(len, demos.values()))
    log.info("%d demonstrations of %d tasks in the success replay (from %s)", count, len(demos), lc.replay_demos)
    return count


@dataclass
class RunInputs:
    """What a run is built from besides the model, loaded and checked once, before the model loads
    (:func:`load_inputs`; ``main`` validates a configuration by building this, and the run uses the same object).

    Attributes:
        tasks: the training task set (``learner.tasks``, ``learner.task_ids``).
        eval_tasks: the held-out evaluation task set (``[eval]``; empty: the run does not evaluate).
        replay: the success replay buffer, holding ``learner.replay_demos``'s demonstrations on a fresh run.
        advantage_function: ``learner.advantage_function`` loaded (learner.algo.advantages).
        plan: where the run's tasks come from: a task pre-pass first, or training at once (learner.algo.prepass).
        resuming: the run folder holds a checkpoint (the run continues from it).
    """

    tasks: list[Task]
    eval_tasks: list[Task]
    replay: ReplayBuffer
    advantage_function: AdvantageFunction
    plan: TaskPlan
    resuming: bool


def load_inputs(config: RunConfig) -> RunInputs:
    """Load and check everything a run needs but the model: a bad task filter, ``[eval]`` task set, advantage
    function, demonstration folder or <run>/prepass.json stops here, before the model loads.

    Raises:
        ConfigError: a bad task set, ``[eval]`` section or demonstration (one line naming it).
        ValueError: a bad advantage function path, or a malformed <run>/prepass.json (names the file).
    """
    lc, run = config.learner, config.run_path
    tasks, eval_tasks = select_tasks(lc), evaluation_tasks(config)
    advantage_function = load_advantage_function(lc.advantage_function)
    replay, resuming = replay_buffer(lc), bool(checkpoint_folders(run / "checkpoints"))
    if not resuming:  # a checkpoint holds the replay, demonstrations included
        seed_demonstrations(config, replay, [task.id for task in tasks])
    return RunInputs(tasks, eval_tasks, replay, advantage_function, plan_tasks(tasks, lc, run, resuming=resuming),
                     resuming)


async def run_learner(config: RunConfig, trainer: TrainEngine | None = None, inputs: RunInputs | None = None) -> None:
    """Wire the learner's components into a :class:`learner.run.Run` and run it (the run's phases and state live
    there): every queue, socket and component of the process is made here, and handed to what uses it.

    ``trainer``: the trainer to drive (under torchrun, rank 0's LeadTrainer); None = load one here. ``inputs``:
    :func:`load_inputs`'s result (None = load them here)."""
    lc, run, learner_id = config.learner, config.run_path, uuid.uuid4().hex[:12]
    inputs = inputs if inputs is not None else load_inputs(config)
    lockstep, plan, prefix = lc.schedule == "lockstep", inputs.plan, f"{learner_id[:6]}-"
    if trainer is None:
        trainer = await asyncio.to_thread(Trainer, config.model_path, lc)
    state = RunState()  # the run's step, published version and counters: every component below counts into it
    scheduler = GroupScheduler(plan.pool, lc.group_size, max_retries=lc.rollout_retries, seed=lc.seed,
                               group_budget=0 if plan.prepass or lockstep else None, id_prefix=prefix,
                               pick_task=plan.pick_task)
    admission = (LockstepAdmission(lc.batch_trajectories) if lockstep
                 else StalenessManager(lc.batch_trajectories, lc.max_staleness))
    # the grammar's view of the tokens: the forced-token loss mask, and demonstrations tokenized as sampled
    tokens = ForcedTokens(config.model_path, trainer.vocab_size) if lc.mask_forced_tokens or lc.replay_demos else None
    batcher = Batcher(inputs.replay, max_staleness=lc.max_staleness, groups_per_step=lc.groups_per_step,
                      format_reward_weight=lc.format_reward_weight, success_threshold=lc.success_threshold,
                      stratified=lc.stratified, advantage_function=inputs.advantage_function,
                      drops=state.drops, sampled_as=tokens.as_sampled if tokens else None)
    evaluation = (EvaluationRounds(inputs.eval_tasks, config.eval, final_step=lc.steps, id_prefix=prefix, state=state)
                  if inputs.eval_tasks else None)
    inbox: asyncio.Queue[Envelope] = asyncio.Queue(INBOX_SIZE)  # ROUTER pump -> service
    outbox = Outbox(routed=True)  # service -> ROUTER pump
    groups = GroupQueue()  # service -> training loop: complete groups
    with learner_socket(config.transport) as socket:
        pump = SocketPump(socket, inbox=inbox, outbox=outbox, max_bytes=config.transport.max_message_bytes)
        service = LearnerService(outbox, scheduler, admission, groups, state=state, rounds=lockstep,
                                 learner_id=learner_id, selector=plan.selector, vocab_size=trainer.vocab_size,
                                 peer_timeout_s=config.transport.peer_timeout_s, run_id=config.resolved_run_id,
                                 max_slots_per_peer=config.transport.max_slots_per_peer,
                                 sampler=TrajectorySampler(run / "trajectories", rate=lc.sample_trajectories,
                                                           disk_mb=lc.sample_disk_mb),
                                 message_counts=pump.message_counts, evaluation=evaluation,
                                 ready_groups=lambda: len(batcher.ready) + len(groups.pending()))
        async with PolicyClient(list(config.actors.inference_urls), api_key=config.serve.api_key,
                                admin_api_key=admin_api_key(config.serve.admin_api_key)) as client:
            # the inference engine (arpo_async.engine; another is chosen here); the run owns its weight sessions
            engines = sglang_engines(client, owner=f"arpo-learner-{config.resolved_run_id}")
            loop = TrainingLoop(service, groups, batcher, state, trainer, weight_publisher(config, engines),
                                Checkpointer(run / "checkpoints", keep=lc.keep_checkpoints), lc,
                                on_discard=admission.on_discard, forced=tokens if lc.mask_forced_tokens else None,
                                final_eval_timeout_s=config.eval.final_timeout_s)
            ranks = functools.partial(keep_ranks_alive, trainer) if isinstance(trainer, LeadTrainer) else None
            await Run(config, state, plan, pump, inbox, outbox, service, loop, ranks).run()


def run_ranks(config: RunConfig, inputs: RunInputs | None) -> int:
    """Under torchrun (WORLD_SIZE > 1): join the process group, load and shard the policy on every rank, then
    rank 0 runs the learner (driving the others through :class:`LeadTrainer`) and the others follow it.
    Returns this rank's exit code (learner.train.distributed describes what happens when a rank dies)."""
    lc = config.learner
    group = init_ranks(resolve_device(lc.device), lc.dist_timeout_s)
    log.info("rank %d of %d on %s", group.rank, group.world, group.device)
    try:
        trainer = Trainer(config.model_path, lc, group)
        if not group.lead:
            return follow(trainer, group)
        lead = LeadTrainer(trainer, group, lc.dist_timeout_s)
        finished: list[bool] = []

        async def learn() -> None:
            await run_learner(config, lead, inputs)
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


def weight_publisher(config: RunConfig, engines: list[InferenceEngine]) -> WeightPublisher | DistributedPublisher:
    """The publisher ``learner.weight_sync`` names (learner.train.publisher), over ``engines`` (one per server)."""
    lc = config.learner
    dtypes = PublishDtypes(served=lc.publish_dtype == "served")
    if lc.weight_sync == "disk":
        return WeightPublisher(engines, config.run_path / "weights", keep=lc.keep_weights,
                               verify_every=lc.verify_weights_every, dtypes=dtypes)
    return DistributedPublisher(engines, bucket_mb=lc.sync_bucket_mb, host=lc.sync_host, backend=sync_backend(lc),
                                timeout_s=lc.sync_timeout_s, verify_every=lc.verify_weights_every,
                                load_format=None if lc.sync_load_format == "tensors" else lc.sync_load_format,
                                dtypes=dtypes)


def build_parser() -> argparse.ArgumentParser:
    """arpo-learner's command line: ``--config`` and ``--set`` over the sections the learner reads."""
    parser = argparse.ArgumentParser(
        prog="arpo-learner", description="The GRPO learner: hands out rollouts to arpo-actors over ZeroMQ, trains "
        "on their trajectories, publishes weights to the inference servers and writes <run_dir>/metrics.jsonl. "
        "Under torchrun (`torchrun --nproc-per-node N -m learner.main ...`) it trains with N ranks.")
    add_config_arguments(parser, ("", "learner", "transport", "actors", "serve", "eval"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        log.error("%s", e)
        return 2
    try:  # everything but the model, built once: a bad input stops here, before the model loads
        resolve_device(config.learner.device)
        if config.learner.weight_sync == "distributed":
            sync_backend(config.learner)
        try:
            inputs: RunInputs | None = load_inputs(config)
        except TaskFormatError:  # a task filter naming no task stays the run's own error: exit 1 with its
            inputs = None  # traceback, which `arpo run`'s crash excerpt quotes (run_learner loads the inputs)
        if config.learner.wandb_project:
            import_wandb(config.learner.wandb_project)  # before the model loads, not after
    except (ConfigError, RuntimeError, ValueError) as e:  # TrainerConfigError too; wandb missing; advantage_function
        log.error("%s", e)
        return 2
    if torchrun_world() > 1:
        try:
            code = run_ranks(config, inputs)
        except RankGroupError as e:
            log.error("%s", e)
            code = 1
        leave(code)
    return run_until_signal(run_learner(config, inputs=inputs), "arpo-learner")


if __name__ == "__main__":
    sys.exit(main())
