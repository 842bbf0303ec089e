"""How many EnvActors one actor process drives: achieved over ideal steps/s, and actor CPU time per step.

What runs, in this process: N real `EnvActor`s with the real `EpisodeRunner` (UI-TARS prompt, `PromptEncoder`
chat template + tokenizer, /generate call, UI-TARS reply parser, xdotool mapping, evaluator) and the real
`LearnerLink` over a real DEALER `SocketPump`. Stand-ins, as issue 4 allows:

- the desktop is instant and in-process: ``screenshot()`` returns pre-made 1280x720 desktop-like PNGs in turn,
  ``execute()`` returns ``{"status": "success", "returncode": 0, ...}`` at once;
- the policy waits a fixed latency (``asyncio.sleep``) and returns a `Generation` with a valid UI-TARS click
  (40 output tokens with log-probs and versions), so the parser and the action path run every step;
- the learner (a child process, real ROUTER pump + codec) answers every work request with an assignment at once
  and acknowledges every trajectory.

Episodes run ARPO's 15-step budget with the last 2 screenshots in the prompt. Actors start staggered over one
latency period (as a pool's staggered starts do) and each actor's first episode has a random budget of 1..15
steps, so episode ends spread evenly over time; figures are measured over a window after a warm-up of at
least two latency periods.
ideal steps/s = actors / latency; ratio = achieved / ideal (target >= 0.95 at 1024 actors, 1 s).
CPU per step = this process's CPU time (all threads: event loop, ZeroMQ I/O, thread pool) / steps (target <= 1 ms).
Each configuration runs with the real `PromptEncoder` and again with it replaced by a precomputed prompt of the
same length ("no encoder"), to show what the chat template and the tokenizer cost.

Last line, e.g.: ``ratio_1024_1s=... cpu_ms_per_step_1024_1s=... ratio_256_0.1s=...``

    python -m bench.bench_actor_loop            # 20 s window per configuration (about 5 minutes)
    python -m bench.bench_actor_loop --quick    # 5 s window per configuration
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import multiprocessing as mp
import os
import random
import socket
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
    encoding and sending) spread evenly over time, as in a fleet whose episodes differ in length."""

    def __init__(self, first, full) -> None:
        self._first, self._full = first, full

    async def run(self, *args, **kwargs):
        runner, self._first = self._first or self._full, None
        return await runner.run(*args, **kwargs)


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

    @property
    def ratio(self) -> float:
        return self.steps_per_s / self.ideal_steps_per_s


async def run_config(endpoint: str, encoder, pngs: list[bytes], output_ids: list[int], *, actors: int, latency_s: float,
                     warmup_s: float, window_s: float, label: str) -> Result:
    """Run ``actors`` EnvActors against the stand-ins; measure steps and CPU over ``window_s`` after warm-up."""
    from actors.env_actor import EnvActor
    from actors.episode import EpisodeRunner
    from actors.link import LearnerLink
    from arpo_async.config import ActorConfig, TransportConfig
    from arpo_async.transport import INBOX_SIZE, Outbox, SocketPump, dealer_socket

    config = ActorConfig(actors=actors, max_steps=MAX_STEPS, history_images=HISTORY_IMAGES)
    transport = TransportConfig(endpoint=endpoint)
    policy = FixedLatencyPolicy(latency_s, output_ids)
    runners = [EpisodeRunner(encoder, policy, dataclasses.replace(config, max_steps=n)) for n in range(1, MAX_STEPS + 1)]
    pool = InstantPool(pngs)
    ctx = zmq.asyncio.Context()
    actor_id = f"bench-{uuid.uuid4().hex[:6]}"
    inbox, outbox = asyncio.Queue(INBOX_SIZE), Outbox(routed=False)
    pump = SocketPump(dealer_socket(ctx, transport, actor_id), inbox=inbox, outbox=outbox,
                      max_bytes=transport.max_message_bytes)
    link = LearnerLink(outbox, actor_id, actors, transport)
    rng = random.Random(0)
    env_actors = [EnvActor(i, link, pool, FirstEpisodeShorter(rng.choice(runners), runners[-1]))
                  for i in range(actors)]

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
            await asyncio.sleep(window_s)
            s1, e1, c1, t1 = policy.steps, sum(a.episodes for a in env_actors), time.process_time(), time.perf_counter()
            for t in tasks + infra:
                t.cancel()
    finally:
        ctx.destroy(linger=0)
    steps = s1 - s0
    return Result(actors, latency_s, label, steps / (t1 - t0), actors / latency_s,
                  1e3 * (c1 - c0) / max(steps, 1), e1 - e0, os.getloadavg()[0])


async def run_all(endpoint: str, model_dir: Path, configs, *, warmup_s: float, window_s: float,
                  no_encoder: bool) -> list[Result]:
    from arpo_async.model.inputs import PromptEncoder

    encoder = PromptEncoder(model_dir)
    pngs = [desktop_png(i) for i in range(MAX_STEPS + 1)]
    output_ids = (encoder.tokenize(REPLY) + encoder.eos_token_ids[:1] + [0] * OUTPUT_TOKENS)[:OUTPUT_TOKENS]
    results = []
    for actors, latency_s in configs:
        variants = [("encoder", encoder)] + ([("no encoder", PrecomputedEncoder(encoder))] if no_encoder else [])
        for label, enc in variants:
            gc.collect()
            r = await run_config(endpoint, enc, pngs, output_ids, actors=actors, latency_s=latency_s,
                                 warmup_s=max(warmup_s, 2 * latency_s), window_s=window_s, label=label)
            print(f"{r.actors:>6} {r.latency_s:>7.2f} {r.encoder:>11} {r.steps_per_s:>9.1f} "
                  f"{r.ideal_steps_per_s:>9.1f} {r.ratio:>6.3f} {r.cpu_ms_per_step:>12.3f} {r.episodes:>8} {r.load:>5.1f}",
                  flush=True)
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
    args = parser.parse_args(argv)
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
            print(f"{'actors':>6} {'latency':>7} {'prompt':>11} {'steps/s':>9} {'ideal':>9} {'ratio':>6} "
                  f"{'cpu ms/step':>12} {'episodes':>8} {'load':>5}")
            configs = [(a, lat) for lat in args.latency for a in args.actors]
            results = asyncio.run(run_all(endpoint, model_dir, configs, warmup_s=warmup_s, window_s=window_s,
                                          no_encoder=not args.no_baseline))
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
    print(result_line(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
