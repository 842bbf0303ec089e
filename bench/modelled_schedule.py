"""One schedule of bench/bench_gpu_model.py: the real actor and learner stack wired around the modelled GPUs and
desktops, run for a warm-up and a measured window, and the figures of that window (:class:`Result`).

What runs, in one process (see bench_gpu_model's docstring for what each figure means): N real ``EnvActor``s with
the real ``EpisodeRunner`` and ``LearnerLink`` over a real DEALER socket; the real learner's ROUTER socket,
``LearnerService``, ``GroupScheduler``, ``Batcher`` and ``TrainingLoop``; the modelled SGLang servers, trainer and
weight publication of bench/gpu_stand_ins.py, and the in-process modelled desktops (or a PaddedPool of real ones)
of bench/desktop_stand_ins.py.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import zmq.asyncio

from bench.bench_actor_loop import TASK, free_port
from bench.desktop_stand_ins import ModelledPool, PaddedPool
from bench.gpu_model import GpuTimingModel
from bench.gpu_stand_ins import (REPLY, BarrierStalled, ModelledPolicy, ModelledPublisher, ModelledServer,
                                 ModelledTrainer, StepBarrier)

SCHEDULES = {"lockstep": ("lockstep", 0), "arpo": ("lockstep", 0), "eta1": ("async", 1), "eta2": ("async", 2),
             "eta4": ("async", 4)}
"""Schedule name -> (learner.schedule, learner.max_staleness); ``arpo`` adds the step barrier (bench_gpu_model's
docstring)."""
SYNCHRONOUS = ("lockstep", "arpo")
"""The schedules whose rounds wait for every trajectory of a batch (the others are async)."""
SAMPLES = ("work_s", "click_s", "shot_s", "reset_s")
"""The real desktops' timings (PaddedPool.samples) whose medians over the window a Result reports."""
TASKS = 16
"""Task ids the learner hands out (copies of bench_actor_loop.TASK)."""


@dataclass
class Result:
    """One schedule's figures (modelled time)."""

    name: str
    traj_per_min: float
    inference_busy: float
    training_busy: float
    ideal_per_min: float
    rollout_per_min: float
    training_per_min: float
    staleness_mean: float
    cpu_cores: float
    lag_p50_modelled_ms: float
    lag_p99_modelled_ms: float
    cached_share: float
    action_inflation: float
    """Modelled time the app actions took in fact / their modelled length (1 = no event-loop lag)."""
    load: float
    late_share: float = float("nan")
    """Real desktops: share of the app actions whose real click + screenshot outlasted the modelled time."""
    work_p50_s: float = float("nan")
    """Real desktops: median seconds of an action's real click + screenshot (before the pad)."""
    click_p50_s: float = float("nan")
    """Real desktops: median seconds of one real command (POST /execute: the xdotool click)."""
    shot_p50_s: float = float("nan")
    """Real desktops: median seconds of one real screenshot (GET /screenshot, 1280x720 PNG)."""
    reset_p50_s: float = float("nan")
    """Real desktops: median seconds of the in-place reset (POST /reset) between episodes."""

    @property
    def achieved_over_ideal(self) -> float:
        return self.traj_per_min / self.ideal_per_min if self.ideal_per_min else float("nan")


class Records:
    """Stands in for MetricsWriter: keeps each training batch's record with the time it was written."""

    def __init__(self) -> None:
        self.items: list[tuple[float, dict]] = []

    def write(self, record: dict) -> None:
        self.items.append((time.monotonic(), record))


def busy_in(log: list[tuple[float, float]], start: float, end: float, scale: float) -> float:
    """Modelled seconds of ``log``'s intervals ((real end time, modelled length)) inside [start, end] (real)."""
    total = 0.0
    for t_end, seconds in log:
        t_start = t_end - seconds / scale
        total += max(0.0, min(end, t_end) - max(start, t_start)) * scale
    return total


def run_config(schedule: str, eta: int, actors: int, endpoint: str, groups_per_step: int = 16,
               max_steps: int = 15, extra: tuple[str, ...] = ()):
    """The RunConfig of one schedule: G = 8, ``groups_per_step`` groups per batch (ARPO: 16), 2 optimizer steps per
    batch, the UI-TARS prompt with 2 screenshots, ``max_steps`` steps (the episode model's); ``extra``: more
    overrides."""
    from arpo_async.config import load_config

    return load_config(None, [
        f'learner.schedule="{schedule}"', f"learner.max_staleness={max(eta, 1)}", "learner.group_size=8",
        f"learner.groups_per_step={groups_per_step}", "learner.updates_per_batch=2", "learner.steps=0",
        "learner.checkpoint_every=0", "learner.mask_forced_tokens=false", "learner.tensorboard=false",
        "learner.sample_trajectories=0", f'transport.endpoint="{endpoint}"',
        f"transport.max_slots_per_peer={max(actors, 1024)}", f"actors.max_steps={max_steps}",
        "actors.history_images=2", 'actors.prompt_style="uitars"', f"actors.actors={actors}", *extra])


async def run_schedule(name: str, model: GpuTimingModel, encoder, pngs: list[bytes], *, actors: int,
                       warmup_s: float, window_s: float, groups_per_step: int = 16, seed: int = 0,
                       desktops: PaddedPool | None = None) -> Result:
    """Run one schedule with ``actors`` desktops; measure over ``window_s`` modelled seconds after ``warmup_s``.

    ``desktops``: real desktops (a PaddedPool over a started DesktopPool holding ``actors`` of them, time scale 1);
    None = ``actors`` in-process modelled desktops."""
    from actors.env_actor import EnvActor
    from actors.episode import EpisodeRunner
    from actors.link import LearnerLink
    from arpo_async.tasks import Task
    from arpo_async.transport import INBOX_SIZE, Outbox, SocketPump, dealer_socket, router_socket
    from learner.algo.batcher import Batcher
    from learner.main import replay_buffer
    from learner.rollouts.scheduler import GroupScheduler
    from learner.rollouts.rounds import GroupQueue
    from learner.rollouts.service import LearnerService
    from learner.rollouts.staleness import LockstepAdmission, StalenessManager
    from learner.state import RunState
    from learner.train.checkpoint import Checkpointer
    from learner.train.loop import TrainingLoop

    schedule, eta = SCHEDULES[name]
    scale = model.time_scale
    config = run_config(schedule, eta, actors, f"tcp://127.0.0.1:{free_port()}", groups_per_step,
                        model.episode.max_steps)
    lc, lockstep = config.learner, schedule == "lockstep"
    tasks = [Task.from_dict(dict(TASK, id=f"bench-task-{i}")) for i in range(TASKS)]
    scheduler = GroupScheduler(tasks, lc.group_size, seed=seed, group_budget=0 if lockstep else None,
                               id_prefix="bench-")
    admission = (LockstepAdmission(lc.batch_trajectories) if lockstep
                 else StalenessManager(lc.batch_trajectories, lc.max_staleness))
    state = RunState()
    batcher = Batcher(replay_buffer(lc), max_staleness=lc.max_staleness, groups_per_step=lc.groups_per_step,
                      format_reward_weight=lc.format_reward_weight, stratified=lc.stratified, drops=state.drops)
    inbox_l, outbox_l, groups = asyncio.Queue(INBOX_SIZE), Outbox(routed=True), GroupQueue()
    service = LearnerService(outbox_l, scheduler, admission, groups, state=state, rounds=lockstep,
                             max_slots_per_peer=config.transport.max_slots_per_peer)
    servers = [ModelledServer(model.inference, scale) for _ in range(model.inference.servers)]
    trainer = ModelledTrainer(model.training, scale, model.inference.image_tokens,
                              encoder.image_token_count(*config.actors.screen_size), model.inference.output_tokens)
    publisher = ModelledPublisher(servers, model.training)
    records = Records()
    tmp = tempfile.TemporaryDirectory(prefix="bench-gpu-model-")
    loop = TrainingLoop(service, groups, batcher, state, trainer, publisher,
                        Checkpointer(Path(tmp.name) / "checkpoints", keep=1), lc, on_discard=admission.on_discard)

    output_ids = (encoder.tokenize(REPLY) + [0] * 40)[:40]
    barrier = StepBarrier(lc.batch_trajectories) if name == "arpo" else None
    policy = ModelledPolicy(servers, model.episode, encoder.image_pad_id, output_ids, seed=seed,
                            screens_by_step=desktops is not None, barrier=barrier)
    runner = EpisodeRunner(encoder, policy, config.actors)
    pool = desktops or ModelledPool(pngs, model.episode, scale, seed=seed)
    if desktops is not None:
        desktops.stopping = False
    ctx = zmq.asyncio.Context()
    actor_id = f"bench-{uuid.uuid4().hex[:6]}"
    inbox_a, outbox_a = asyncio.Queue(INBOX_SIZE), Outbox(routed=False)
    pump_l = SocketPump(router_socket(ctx, config.transport), inbox=inbox_l, outbox=outbox_l,
                        max_bytes=config.transport.max_message_bytes)
    pump_a = SocketPump(dealer_socket(ctx, config.transport, actor_id), inbox=inbox_a, outbox=outbox_a,
                        max_bytes=config.transport.max_message_bytes)
    link = LearnerLink(outbox_a, actor_id, actors, config.transport)
    env_actors = [EnvActor(i, link, pool, runner) for i in range(actors)]
    rng = random.Random(seed)
    lags: list[float] = []

    async def staggered(actor: EnvActor) -> None:
        await asyncio.sleep(rng.random() * 10.0 / scale)
        await actor.run()

    async def lag_probe() -> None:
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(0.01)
            lags.append(time.monotonic() - t0 - 0.01)

    def snapshot() -> dict[str, float]:
        return {"t": time.monotonic(), "cpu": time.process_time(), "traj": service.state.totals["trajectories"],
                "busy": sum(s.busy_s for s in servers), "sat": sum(s.saturated_s for s in servers),
                "episodes": pool.totals["episodes"], "action_s": pool.totals["action_s"],
                "action_real_s": pool.totals["action_real_s"], "desktop_s": pool.totals["desktop_s"],
                "actions": pool.totals["actions"], "late": pool.totals["late_actions"],
                **{key: len(desktops.samples[key]) if desktops else 0 for key in SAMPLES},
                "prompt": policy.prompt_tokens, "cached": policy.cached_tokens}

    try:
        async with asyncio.TaskGroup() as tg:
            infra = [tg.create_task(pump_l.run()), tg.create_task(service.serve(inbox_l)),
                     tg.create_task(pump_a.run()), tg.create_task(link.serve(inbox_a)),
                     tg.create_task(link.keepalive()), tg.create_task(lag_probe())]
            infra += [tg.create_task(s.run()) for s in servers]
            infra.append(tg.create_task(loop.run(records)))
            await asyncio.wait_for(link.connected.wait(), 30)
            infra += [tg.create_task(staggered(a)) for a in env_actors]
            await asyncio.sleep(warmup_s / scale)
            lags.clear()
            a = snapshot()
            await asyncio.sleep(window_s / scale)
            b = snapshot()
            if desktops is not None:
                desktops.stopping = True  # the cancelled episodes' desktops are reset in place, not replaced
            for task in infra:
                task.cancel()
    finally:
        ctx.destroy(linger=0)
        tmp.cleanup()

    if barrier is not None and barrier.stalled:
        raise BarrierStalled(f"{name}: {barrier.stalled}")
    span = (b["t"] - a["t"]) * scale  # modelled seconds
    traj = b["traj"] - a["traj"]
    in_window = [r for t, r in records.items if a["t"] <= t <= b["t"]]
    trained = sum(r["trajectories"] for r in in_window)
    train_cost = sum(r["train_s"] + r["publish_s"] for r in in_window)
    training_busy = (busy_in(trainer.log, a["t"], b["t"], scale) + busy_in(publisher.log, a["t"], b["t"], scale)) / span
    episodes = max(b["episodes"] - a["episodes"], 1)
    desktop_s = (b["desktop_s"] - a["desktop_s"]) / episodes
    inference_s = (b["sat"] - a["sat"]) / max(traj, 1)
    rollout = 60 * min(actors / desktop_s, model.inference.servers / inference_s) if traj else float("nan")
    training = 60 * trained / train_cost if train_cost else float("nan")
    lags_sorted = sorted(lags) or [0.0]
    prompt = b["prompt"] - a["prompt"]
    real: dict[str, float] = {}
    if desktops is not None:
        real = {"late_share": (b["late"] - a["late"]) / max(b["actions"] - a["actions"], 1)}
        for key in SAMPLES:  # the window's samples
            window = desktops.samples[key][a[key]:b[key]]
            real[key.replace("_s", "_p50_s")] = statistics.median(window) if window else float("nan")
    return Result(
        name, 60 * traj / span, (b["busy"] - a["busy"]) / (model.inference.servers * span), training_busy,
        min(rollout, training), rollout, training,
        statistics.fmean([r["staleness_mean"] for r in in_window]) if in_window else float("nan"),
        (b["cpu"] - a["cpu"]) / (b["t"] - a["t"]), 1e3 * scale * lags_sorted[len(lags_sorted) // 2],
        1e3 * scale * lags_sorted[int(0.99 * (len(lags_sorted) - 1))],
        (b["cached"] - a["cached"]) / prompt if prompt else 0.0,
        (b["action_real_s"] - a["action_real_s"]) / max(b["action_s"] - a["action_s"], 1e-9), os.getloadavg()[0],
        **real)
