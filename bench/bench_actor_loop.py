"""How many EnvActors one actor process drives: achieved over ideal steps/s, and actor CPU time per step.

What runs, in this process: N real `EnvActor`s with the real `EpisodeRunner` (UI-TARS prompt, `PromptEncoder`
chat template + tokenizer, /generate call, UI-TARS reply parser, xdotool mapping, evaluator) and the real
`LearnerLink` over a real DEALER `SocketPump`. Stand-ins, as issue 4 allows:

- the desktop is in-process and settles as a real one does: ``execute()`` returns ``{"status": "success",
  "returncode": 0, ...}`` at once and starts a redraw; for a drawing time drawn per action from ``--draw-s``
  (default 0-0.2 s) ``screenshot()`` returns images in motion (each differs from the one before), then the
  action's settled image (pre-made 1280x720 desktop-like PNGs, a new one per action) until the next action. The
  real ``actors.settle`` wait (two equal screenshots ``actors.settle_interval_s`` = 0.1 s apart) then takes
  0.1-0.3 s a step, as on real apps (xterm, gedit, LibreOffice Writer and chromium settle in 0.14-0.31 s a step;
  issue 49). A stand-in whose every screenshot differs never settles: each step waits ``actors.settle_timeout_s``
  (2 s), and the benchmark measured that timeout instead of the actor loop;
- the policy waits a fixed latency (``asyncio.sleep``) and returns a `Generation` with a valid UI-TARS click
  (40 output tokens with log-probs and versions), so the parser and the action path run every step;
- the learner (a child process, real ROUTER pump + codec) answers every work request with an assignment at once
  and acknowledges every trajectory.

Episodes run ARPO's 15-step budget with the last 2 screenshots in the prompt. Actors start staggered over one
latency period (as a pool's staggered starts do) and each actor's first episode has a random budget of 1..15
steps, so episode ends spread evenly over time; figures are measured over a window after a warm-up of at
least two latency periods.
ideal steps/s = actors x the steps/s per actor of a reference run of ``--reference-actors`` (32) actors at the same
latency in the same run (a light load: its steps take the latency, the settle wait and the loop's own time);
ratio = achieved / ideal (target >= 0.95 at 1024 actors, 1 s). "of N/lat" is achieved / (actors / latency), the
ideal before screenshots settled. "settle p50" is the median settle wait per action (Step.settle_s) and
"timeouts" the share of waits that hit the 2 s timeout, of the episodes that ended in the window.
CPU per step = this process's CPU time (all threads: event loop, ZeroMQ I/O, thread pool) / steps (target <= 1 ms).
Each configuration runs with the real `PromptEncoder` and again with it replaced by a precomputed prompt of the
same length ("no encoder"), to show what the chat template and the tokenizer cost.

Last line, e.g.: ``ratio_1024_1s=... cpu_ms_per_step_1024_1s=... settle_p50_1024_1s=... ratio_256_0.1s=...``

    python -m bench.bench_actor_loop            # 20 s window per configuration (about 6 minutes)
    python -m bench.bench_actor_loop --quick    # 5 s window per configuration
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import math
import multiprocessing as mp
import os
import random
import socket
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio

from bench._common import desktop_png, result_line

MAX_STEPS = 15
HISTORY_IMAGES = 2
OUTPUT_TOKENS = 40
REPLY = "Thought: I click the red button.\nAction: click(start_box='<|box_start|>(640,360)<|box_end|>')"
TASK = {"id": "bench-grid4-red", "instruction": "Click the button labelled red.", "config": [],
        "evaluator": {"func": "exact_match", "result": {"type": "vm_command_line", "command": ["cat", "/tmp/r"]},
                      "expected": {"type": "rule", "rules": {"expected": "red"}}}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ stand-ins

class InstantController:
    """Quacks like ControllerClient for what an episode calls; every call answers at once.

    ``screenshot`` returns the pre-made PNGs in turn (all different, so a trajectory carries a realistic number
    of screenshots: an unchanged screen would be stored once)."""

    def __init__(self, pngs: list[bytes]) -> None:
        self._pngs = pngs
        self._next = 0

    async def screenshot(self, format: str = "png", quality: int = 85) -> bytes:
        self._next = (self._next + 1) % len(self._pngs)
        return self._pngs[self._next]

    async def execute(self, command, *, shell: bool = False, timeout: float = 120, setup: bool = False) -> dict:
        return {"status": "success", "output": "red", "error": "", "returncode": 0}

    async def get_file(self, path: str) -> bytes | None:
        return b"red"


class SettlingController(InstantController):
    """An in-process desktop that settles as a real one does: each ``execute`` (an action) starts a redraw of
    ``draw_s`` seconds (drawn from ``draw_range_s`` with ``rng``); while it lasts, ``screenshot`` alternates between
    two images in motion, then returns the action's settled image (the next of ``pngs``: a new one per action)
    until the next action. ``actors.settle`` thus waits about ``draw_s`` plus one or two
    ``actors.settle_interval_s``, as on a real app (0.14-0.31 s a step measured on xterm, gedit, LibreOffice Writer
    and chromium, issue 49).

    Args:
        pngs: the settled images, in turn (the first is the screen before any action).
        motion: two images, different from each other and from every one of ``pngs``.
        draw_range_s: (lowest, highest) seconds of a redraw, drawn uniformly.
        rng: draws each redraw's seconds.
    """

    def __init__(self, pngs: list[bytes], motion: tuple[bytes, bytes], draw_range_s: tuple[float, float],
                 rng: random.Random) -> None:
        super().__init__(pngs)
        self._motion, self._range, self._rng = motion, draw_range_s, rng
        self._next = 0
        self._drawn_at = 0.0  # loop time when the current redraw ends
        self._frame = 0

    async def screenshot(self, format: str = "png", quality: int = 85) -> bytes:
        if asyncio.get_running_loop().time() < self._drawn_at:
            self._frame ^= 1
            return self._motion[self._frame]
        return self._pngs[self._next]

    async def execute(self, command, *, shell: bool = False, timeout: float = 120, setup: bool = False) -> dict:
        self._next = (self._next + 1) % len(self._pngs)
        self._drawn_at = asyncio.get_running_loop().time() + self._rng.uniform(*self._range)
        return await super().execute(command, shell=shell, timeout=timeout, setup=setup)


@dataclass
class InstantDesktop:
    name: str
    controller: InstantController


class InstantPool:
    """Quacks like DesktopPool: ``acquire`` hands out an instant desktop, ``release`` forgets it.

    ``controller``: makes each desktop's controller from the PNGs (InstantController, or a subclass)."""

    def __init__(self, pngs: list[bytes], controller=InstantController) -> None:
        self._pngs = pngs
        self._controller = controller
        self._ids = iter(range(1 << 62))

    async def acquire(self) -> InstantDesktop:
        return InstantDesktop(f"instant-{next(self._ids)}", self._controller(self._pngs))

    async def release(self, desktop: InstantDesktop, *, reusable: bool = True) -> None:
        """DesktopPool.release's signature; an instant desktop needs no reset or removal."""
        return None


class FixedLatencyPolicy:
    """Quacks like PolicyClient.generate: waits ``latency_s``, returns a valid UI-TARS click."""

    def __init__(self, latency_s: float, output_ids: list[int]) -> None:
        from arpo_async.inference_client import Generation

        self._generation = Generation
        self.latency_s = latency_s
        self.output_ids = output_ids
        self.logprobs = [-0.05 * (i % 7) for i in range(len(output_ids))]
        self.steps = 0

    async def generate(self, *, input_ids, images, sampling_params, rid=None, episode_id=None, **_):
        await asyncio.sleep(self.latency_s)
        self.steps += 1
        n = len(self.output_ids)
        # prompt_tokens 0: not reported. A server reports the prompt with every image's pads expanded, which the
        # stand-in cannot count without the image processor; len(input_ids) (one pad per image) made the episode
        # runner's prompt check abort every episode after its first step.
        return self._generation(text=REPLY, output_ids=list(self.output_ids), logprobs=list(self.logprobs),
                                weight_version=0, token_versions=[0] * n, finish_reason="stop",
                                prompt_tokens=0, latency_s=self.latency_s)


class PrecomputedEncoder:
    """The real PromptEncoder for sizes and counts, but ``encode`` returns a prompt computed once per
    (number of images, number of past replies): no chat template, no tokenizer per step."""

    def __init__(self, encoder) -> None:
        self._encoder = encoder
        self._cache: dict[tuple[int, int], list[int]] = {}

    def __getattr__(self, name):
        return getattr(self._encoder, name)

    def encode(self, messages, image_sizes):
        key = (len(image_sizes), len(messages))
        ids = self._cache.get(key)
        if ids is None:
            ids = self._cache[key] = self._encoder.encode(messages, image_sizes)
        return list(ids)


class FirstEpisodeShorter:
    """An EpisodeRunner whose first episode has a budget of ``first_steps`` (then the full one), so that actors
    started together do not all end their episodes in the same second: episode ends (evaluation, trajectory
    encoding and sending) spread evenly over time, as in a fleet whose episodes differ in length.

    ``settles``: when not None, each finished episode's settle waits (``(Step.settle_s, Step.settle_timed_out)`` of
    every step with an action settled after it) are appended to it."""

    def __init__(self, first, full, settles: list[tuple[float, bool]] | None = None) -> None:
        self._first, self._full = first, full
        self.settles = settles

    async def run(self, *args, **kwargs):
        runner, self._first = self._first or self._full, None
        traj = await runner.run(*args, **kwargs)
        if self.settles is not None:
            self.settles.extend((step.settle_s, step.settle_timed_out) for step in traj.steps if step.settle_s > 0)
        return traj


# ------------------------------------------------------------------ learner stand-in (child process)

def _learner(endpoint: str, ready, stop) -> None:
    asyncio.run(_learner_async(endpoint, ready, stop))


async def _learner_async(endpoint: str, ready, stop) -> None:
    from arpo_async.config import TransportConfig
    from arpo_async.messages import Ack, Assignment, Heartbeat, Hello, LearnerStatus, Trajectory, WorkRequest
    from arpo_async.transport import INBOX_SIZE, Outbox, SocketPump, router_socket

    config = TransportConfig(endpoint=endpoint)
    ctx = zmq.asyncio.Context()
    learner_id = uuid.uuid4().hex[:12]
    groups = iter(range(1 << 62))

    inbox, outbox = asyncio.Queue(INBOX_SIZE), Outbox(routed=True)

    async def serve() -> None:
        while True:
            env = await inbox.get()
            m = env.message
            if isinstance(m, WorkRequest):
                await outbox.send(Assignment(m.request_id, TASK, f"g{next(groups)}", 0, 0), env.peer)
            elif isinstance(m, Trajectory):
                await outbox.send(Ack([m.trajectory_id]), env.peer)
            elif isinstance(m, (Hello, Heartbeat)):
                await outbox.send(LearnerStatus(learner_id, 0), env.peer)

    pump = SocketPump(router_socket(ctx, config), inbox=inbox, outbox=outbox, max_bytes=config.max_message_bytes)
    tasks = [asyncio.create_task(pump.run()), asyncio.create_task(serve())]
    ready.set()
    try:
        while not stop.is_set():
            await asyncio.sleep(0.2)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        ctx.destroy(linger=0)


def _make_model(out_dir: str) -> None:
    from arpo_async.model.init_model import create_tiny_model

    create_tiny_model(Path(out_dir))


# ------------------------------------------------------------------ one configuration

@dataclass
class Result:
    actors: int
    latency_s: float
    encoder: str
    steps_per_s: float
    ideal_steps_per_s: float
    cpu_ms_per_step: float
    episodes: int
    load: float
    """The machine's 1-minute load average at the end of the window (other processes compete for the CPU)."""
    settle_p50_s: float
    """Median settle wait per action (Step.settle_s) of the episodes that ended in the window (nan: none)."""
    settle_timeout_share: float
    """Share of those waits that hit actors.settle_timeout_s (nan: none)."""

    @property
    def ratio(self) -> float:
        return self.steps_per_s / self.ideal_steps_per_s

    @property
    def ratio_latency_only(self) -> float:
        """Achieved over actors / latency: the ideal before screenshots waited for the screen to settle."""
        return self.steps_per_s * self.latency_s / self.actors


async def run_config(endpoint: str, encoder, pngs: list[bytes], output_ids: list[int], *, actors: int, latency_s: float,
                     warmup_s: float, window_s: float, label: str, draw_range_s: tuple[float, float]) -> Result:
    """Run ``actors`` EnvActors against the stand-ins (SettlingController desktops, redraws of ``draw_range_s``);
    measure steps, CPU and settle waits over ``window_s`` after warm-up. The result's ideal is actors / latency
    (run_all replaces it with the reference run's)."""
    from actors.env_actor import EnvActor
    from actors.episode import EpisodeRunner
    from actors.link import LearnerLink
    from arpo_async.config import ActorConfig, TransportConfig
    from arpo_async.transport import INBOX_SIZE, Outbox, SocketPump, dealer_socket

    config = ActorConfig(actors=actors, max_steps=MAX_STEPS, history_images=HISTORY_IMAGES)
    transport = TransportConfig(endpoint=endpoint)
    policy = FixedLatencyPolicy(latency_s, output_ids)
    runners = [EpisodeRunner(encoder, policy, dataclasses.replace(config, max_steps=n)) for n in range(1, MAX_STEPS + 1)]
    motion = (desktop_png(1 << 20), desktop_png((1 << 20) + 1))
    draws = random.Random(1)
    pool = InstantPool(pngs, lambda images: SettlingController(images, motion, draw_range_s, draws))
    ctx = zmq.asyncio.Context()
    actor_id = f"bench-{uuid.uuid4().hex[:6]}"
    inbox, outbox = asyncio.Queue(INBOX_SIZE), Outbox(routed=False)
    pump = SocketPump(dealer_socket(ctx, transport, actor_id), inbox=inbox, outbox=outbox,
                      max_bytes=transport.max_message_bytes)
    link = LearnerLink(outbox, actor_id, actors, transport)
    rng = random.Random(0)
    shorters = [FirstEpisodeShorter(rng.choice(runners), runners[-1]) for _ in range(actors)]
    env_actors = [EnvActor(i, link, pool, shorter) for i, shorter in enumerate(shorters)]
    settles: list[tuple[float, bool]] = []

    async def staggered(actor: EnvActor) -> None:
        await asyncio.sleep(rng.random() * latency_s)
        await actor.run()

    try:
        async with asyncio.TaskGroup() as tg:  # cancelled children end the group quietly
            infra = [tg.create_task(pump.run()), tg.create_task(link.serve(inbox)), tg.create_task(link.keepalive())]
            await asyncio.wait_for(link.connected.wait(), 30)
            tasks = [tg.create_task(staggered(a)) for a in env_actors]
            await asyncio.sleep(warmup_s)
            s0, e0, c0, t0 = policy.steps, sum(a.episodes for a in env_actors), time.process_time(), time.perf_counter()
            for shorter in shorters:
                shorter.settles = settles
            await asyncio.sleep(window_s)
            s1, e1, c1, t1 = policy.steps, sum(a.episodes for a in env_actors), time.process_time(), time.perf_counter()
            for shorter in shorters:
                shorter.settles = None
            for t in tasks + infra:
                t.cancel()
    finally:
        ctx.destroy(linger=0)
    steps = s1 - s0
    waits = [seconds for seconds, _ in settles]
    return Result(actors, latency_s, label, steps / (t1 - t0), actors / latency_s,
                  1e3 * (c1 - c0) / max(steps, 1), e1 - e0, os.getloadavg()[0],
                  statistics.median(waits) if waits else math.nan,
                  sum(timed_out for _, timed_out in settles) / len(settles) if settles else math.nan)


async def run_all(endpoint: str, model_dir: Path, actor_counts: list[int], latencies: list[float], *,
                  warmup_s: float, window_s: float, no_encoder: bool, reference_actors: int,
                  draw_range_s: tuple[float, float]) -> list[Result]:
    """Per latency: the reference run (``reference_actors``, the real PromptEncoder), then each actor count with the
    PromptEncoder and (``no_encoder``) with a precomputed prompt; every result's ideal is actors x the reference's
    steps/s per actor. Prints one row per run, the reference's first."""
    from arpo_async.model.inputs import PromptEncoder

    encoder = PromptEncoder(model_dir)
    pngs = [desktop_png(i) for i in range(MAX_STEPS + 1)]
    output_ids = (encoder.tokenize(REPLY) + encoder.eos_token_ids[:1] + [0] * OUTPUT_TOKENS)[:OUTPUT_TOKENS]
    results = []

    async def run(actors: int, latency_s: float, label: str, enc) -> Result:
        gc.collect()
        return await run_config(endpoint, enc, pngs, output_ids, actors=actors, latency_s=latency_s,
                                warmup_s=max(warmup_s, 2 * latency_s), window_s=window_s, label=label,
                                draw_range_s=draw_range_s)

    for latency_s in latencies:
        reference = await run(reference_actors, latency_s, "reference", encoder)
        per_actor = reference.steps_per_s / reference.actors
        variants = [("encoder", encoder)] + ([("no encoder", PrecomputedEncoder(encoder))] if no_encoder else [])
        for r in [reference] + [await run(actors, latency_s, label, enc)
                                for actors in actor_counts for label, enc in variants]:
            r = dataclasses.replace(r, ideal_steps_per_s=r.actors * per_actor)
            print(f"{r.actors:>6} {r.latency_s:>7.2f} {r.encoder:>11} {r.steps_per_s:>9.1f} "
                  f"{r.ideal_steps_per_s:>9.1f} {r.ratio:>6.3f} {r.ratio_latency_only:>8.3f} {r.settle_p50_s:>10.3f} "
                  f"{r.settle_timeout_share:>8.3f} {r.cpu_ms_per_step:>12.3f} {r.episodes:>8} {r.load:>5.1f}",
                  flush=True)
            if r.encoder != "reference":
                results.append(r)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 s window per configuration (default 20 s)")
    parser.add_argument("--window", type=float, default=None, help="measured seconds per configuration")
    parser.add_argument("--model", type=Path, default=None,
                        help="checkpoint folder for the PromptEncoder (default: a tiny model made in a temp dir)")
    parser.add_argument("--actors", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--latency", type=float, nargs="+", default=[1.0, 0.1])
    parser.add_argument("--no-baseline", action="store_true", help="skip the runs without the PromptEncoder")
    parser.add_argument("--reference-actors", type=int, default=32,
                        help="actors of the reference run per latency, whose steps/s per actor sets the ideal")
    parser.add_argument("--draw-s", type=float, nargs=2, default=[0.0, 0.2], metavar=("LOW", "HIGH"),
                        help="seconds the stand-in desktop redraws after an action, drawn uniformly (default 0 0.2)")
    args = parser.parse_args(argv)
    if args.reference_actors < 1 or not 0 <= args.draw_s[0] <= args.draw_s[1]:
        parser.error("--reference-actors must be >= 1 and --draw-s LOW HIGH must satisfy 0 <= LOW <= HIGH")
    window_s = args.window or (5.0 if args.quick else 20.0)
    warmup_s = 2.0 if args.quick else 5.0
    spawn = mp.get_context("spawn")

    with tempfile.TemporaryDirectory(prefix="bench-actor-loop-") as tmp:
        model_dir = args.model
        if model_dir is None:
            model_dir = Path(tmp) / "tiny-model"
            maker = spawn.Process(target=_make_model, args=(str(model_dir),))  # keeps torch out of this process
            maker.start()
            maker.join()
            if maker.exitcode != 0:
                raise RuntimeError(f"creating the tiny model failed (exit code {maker.exitcode})")
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        ready, stop = spawn.Event(), spawn.Event()
        learner = spawn.Process(target=_learner, args=(endpoint, ready, stop), daemon=True)
        learner.start()
        try:
            if not ready.wait(60):
                raise RuntimeError("the learner stand-in did not start within 60 s")
            print(f"{MAX_STEPS}-step episodes, {HISTORY_IMAGES} screenshots in the prompt, "
                  f"{window_s:.0f} s window per configuration; {os.cpu_count()} CPUs (load: 1-minute load average)")
            print(f"stand-in desktops redraw {args.draw_s[0]:g}-{args.draw_s[1]:g} s after each action; ideal = "
                  f"actors x steps/s per actor of the reference run ({args.reference_actors} actors, same latency)")
            print(f"{'actors':>6} {'latency':>7} {'prompt':>11} {'steps/s':>9} {'ideal':>9} {'ratio':>6} "
                  f"{'of N/lat':>8} {'settle p50':>10} {'timeouts':>8} {'cpu ms/step':>12} {'episodes':>8} {'load':>5}")
            results = asyncio.run(run_all(endpoint, model_dir, args.actors, args.latency, warmup_s=warmup_s,
                                          window_s=window_s, no_encoder=not args.no_baseline,
                                          reference_actors=args.reference_actors, draw_range_s=tuple(args.draw_s)))
        finally:
            stop.set()
            learner.join(10)
            if learner.is_alive():
                learner.terminate()

    figures: dict[str, float] = {}
    for r in results:
        suffix = f"{r.actors}_{r.latency_s:g}s" + ("" if r.encoder == "encoder" else "_noenc")
        figures[f"ratio_{suffix}"] = r.ratio
        figures[f"cpu_ms_per_step_{suffix}"] = r.cpu_ms_per_step
        figures[f"settle_p50_{suffix}"] = r.settle_p50_s
    print(result_line(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
