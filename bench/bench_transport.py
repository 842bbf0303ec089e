"""Trajectory throughput of the actor -> learner transport against raw ZeroMQ, over TCP loopback.

What runs (two processes, as in a deployment: the learner's side in a child process):

- stack: ``LearnerLink.submit`` -> DEALER `SocketPump` (codec.encode, send) ==TCP 127.0.0.1==> ROUTER
  `SocketPump` (receive a burst, codec.decode) -> the real ``LearnerService.handle`` (de-duplicate; one Ack per
  burst, or per 10 ms of trajectories) -> Ack back -> ``LearnerLink`` forgets the trajectories. A round is timed
  from the first submit until every trajectory is acknowledged. The trajectories carry no live group, so the service
  counts them as "late" after the ack: the scheduler's and batcher's per-trajectory bookkeeping (dict operations)
  is not measured.
- raw: the same multipart frames (codec output: header, the steps' prompt ids, one frame per screenshot) sent with
  a blocking DEALER -> ROUTER pair, receiving with ``copy=False``, no codec, one "done" reply per round.

Trajectories are realistic: 15 steps, 15 distinct 1280x720 PNG screenshots drawn like desktops (100-200 KB
each), 3,000 prompt token ids per step, 40 output tokens with log-probs and versions (2.9 MB per trajectory),
valid for the learner (version 0, ids inside its vocabulary), so it runs every check.

CPU per trajectory on each side (process time, all threads, ZeroMQ's I/O thread included, per trajectory of a
stack round): ``actor_cpu_ms_per_traj`` (encode + send + the link's bookkeeping and the Ack) and
``learner_cpu_ms_per_traj`` (receive + decode + validate + the service's handling and the Ack); target <= 2 ms
each. Their codec part alone, in this process: ``encode_ms`` (codec.encode) and ``decode_validate_ms``
(codec.decode + validation.check_trajectory).

Last line: ``traj_per_s=... mb_per_s=... raw_mb_per_s=... ratio=... actor_cpu_ms_per_traj=...
learner_cpu_ms_per_traj=... encode_ms=... decode_validate_ms=...`` (medians over rounds; MB = 10^6 bytes; ratio =
stack MB/s / raw MB/s, target >= 0.8).

    python -m bench.bench_transport            # 7 rounds x 200 trajectories per mode
    python -m bench.bench_transport --quick    # 3 rounds x 60
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import multiprocessing as mp
import os
import socket
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import zmq
import zmq.asyncio

from bench._common import desktop_png, median, result_line

STEPS = 15
PROMPT_TOKENS = 3000
OUTPUT_TOKENS = 40
VOCAB = 151_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_trajectory(seed: int = 0):
    """One realistic 15-step trajectory (see the module docstring)."""
    from arpo_async.messages import Step, Trajectory

    rng = np.random.default_rng(seed)
    shots = [desktop_png(seed * 100 + i) for i in range(STEPS)]
    steps = []
    for i in range(STEPS):
        steps.append(Step(prompt_ids=rng.integers(0, VOCAB, PROMPT_TOKENS, dtype=np.int32),
                          image_indices=[max(0, i - 1), i],
                          output_ids=rng.integers(0, VOCAB, OUTPUT_TOKENS, dtype=np.int32),
                          logprobs=-3 * rng.random(OUTPUT_TOKENS), versions=np.zeros(OUTPUT_TOKENS, np.int32),
                          text="Thought: click the red button.\nAction: click(start_box='(640,360)')",
                          action="click(640,360)", generate_s=0.8, act_s=0.02, observe_s=0.01))
    # version 0, the learner's: the trajectory passes every check of the learner's validation (a newer version
    # would be refused at its first check and skip the rest of the receive path)
    return Trajectory(trajectory_id="t", actor_id="bench/0", task_id="grid4-red", group_id="g-none",
                      rollout_index=0, outcome="FAILURE", score=0.0, format_ok=True, steps=steps,
                      screenshots=shots, timings={"episode_s": 12.0}, assigned_version=0, desktop="d0")


# ------------------------------------------------------------------ learner side (child process)

def _stack_learner(endpoint: str, ready) -> None:
    asyncio.run(_stack_learner_async(endpoint, ready))


async def _stack_learner_async(endpoint: str, ready) -> None:
    from arpo_async.config import TransportConfig
    from arpo_async.tasks import Task
    from arpo_async.transport import INBOX_SIZE, Outbox, SocketPump, router_socket
    from learner.rollouts.scheduler import GroupScheduler
    from learner.rollouts.service import LearnerService
    from learner.rollouts.staleness import StalenessManager

    task = Task.from_dict({"id": "grid4-red", "instruction": "click red", "config": [],
                           "evaluator": {"func": "exact_match", "result": {"type": "vm_file", "path": "/r"},
                                         "expected": {"type": "rule", "rules": {"expected": "red"}}}})
    config = TransportConfig(endpoint=endpoint)
    ctx = zmq.asyncio.Context()
    inbox, outbox = asyncio.Queue(INBOX_SIZE), Outbox(routed=True)
    pump = SocketPump(router_socket(ctx, config), inbox=inbox, outbox=outbox, max_bytes=config.max_message_bytes)
    service = LearnerService(outbox, GroupScheduler([task], group_size=8), StalenessManager(8, 1), vocab_size=VOCAB)
    ready.set()
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(pump.run())
            tg.create_task(service.serve(inbox))
    finally:
        ctx.destroy(linger=0)


def _raw_learner(endpoint: str, high_water_mark: int, ready) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, high_water_mark)
    sock.setsockopt(zmq.RCVHWM, high_water_mark)
    sock.bind(endpoint)
    ready.set()
    expected, got = -1, 0
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 2 and frames[1].bytes.startswith(b"BEGIN "):
            expected, got = int(frames[1].bytes[6:]), 0
        else:
            got += 1
        if got == expected:
            sock.send_multipart([frames[0].bytes, b"done"])
            expected = -1


def _start(target, *args) -> mp.Process:
    spawn = mp.get_context("spawn")
    ready = spawn.Event()
    proc = spawn.Process(target=target, args=(*args, ready), daemon=True)
    proc.start()
    if not ready.wait(60):
        proc.terminate()
        raise RuntimeError(f"{target.__name__} did not start within 60 s")
    return proc


# ------------------------------------------------------------------ actor side (this process)

def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) used so far by process ``pid`` (Linux /proc); NaN elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


@dataclasses.dataclass
class Round:
    """One timed round: wall seconds, and CPU seconds of this (actor) process and of the learner process."""

    wall_s: float
    actor_cpu_s: float
    learner_cpu_s: float


def raw_round(sock: zmq.Socket, frames: list[bytes], n: int) -> float:
    """Send ``n`` copies of ``frames``; seconds until the learner side has received them all."""
    t0 = time.perf_counter()
    sock.send_multipart([f"BEGIN {n}".encode()])
    for _ in range(n):
        sock.send_multipart(frames, copy=False)
    if not sock.poll(120_000):
        raise RuntimeError("raw round: no 'done' within 120 s")
    sock.recv_multipart()
    return time.perf_counter() - t0


async def stack_round(link, traj, n: int) -> float:
    """Submit ``n`` copies of ``traj`` (fresh ids) through the link; seconds until all are acknowledged."""
    batch = [dataclasses.replace(traj, trajectory_id=uuid.uuid4().hex) for _ in range(n)]
    t0 = time.perf_counter()
    for t in batch:
        await link.submit(t)
    if not await link.wait_acked(120):
        raise RuntimeError(f"stack round: {link.unacked} trajectories not acked within 120 s")
    return time.perf_counter() - t0


def timed(fn, learner_pid: int) -> Round:
    c0, l0 = time.process_time(), proc_cpu_s(learner_pid)
    wall = fn()
    return Round(wall, time.process_time() - c0, proc_cpu_s(learner_pid) - l0)


async def run_rounds(traj, frames: list[bytes], n: int, rounds: int, hwm: int) -> tuple[list[Round], list[Round]]:
    """Alternate raw and stack rounds (so both see the same machine load); round 0 of each warms up."""
    from actors.link import LearnerLink
    from arpo_async.config import TransportConfig
    from arpo_async.transport import INBOX_SIZE, Outbox, SocketPump, dealer_socket

    raw_ep, stack_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    raw_proc, stack_proc = _start(_raw_learner, raw_ep, hwm), _start(_stack_learner, stack_ep)
    config = TransportConfig(endpoint=stack_ep, resend_after_s=3600.0)
    actx, ctx = zmq.asyncio.Context(), zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    for opt, value in ((zmq.LINGER, 0), (zmq.SNDHWM, hwm), (zmq.RCVHWM, hwm)):
        raw.setsockopt(opt, value)
    raw.connect(raw_ep)
    inbox, outbox = asyncio.Queue(INBOX_SIZE), Outbox(routed=False)
    pump = SocketPump(dealer_socket(actx, config, f"bench-{uuid.uuid4().hex[:6]}"), inbox=inbox, outbox=outbox,
                      max_bytes=config.max_message_bytes)
    link = LearnerLink(outbox, "bench", 1, config)
    pump_tasks = [asyncio.create_task(pump.run()), asyncio.create_task(link.serve(inbox))]
    raw_rounds: list[Round] = []
    stack_rounds: list[Round] = []
    try:
        for r in range(rounds + 1):
            raw_r = timed(lambda: raw_round(raw, frames, n), raw_proc.pid)
            c0, l0 = time.process_time(), proc_cpu_s(stack_proc.pid)
            wall = await stack_round(link, traj, n)
            stack_r = Round(wall, time.process_time() - c0, proc_cpu_s(stack_proc.pid) - l0)
            if r:
                raw_rounds.append(raw_r)
                stack_rounds.append(stack_r)
    finally:
        for t in pump_tasks:
            t.cancel()
        await asyncio.gather(*pump_tasks, return_exceptions=True)
        raw.close(0)
        ctx.destroy(linger=0)
        actx.destroy(linger=0)
        for p in (raw_proc, stack_proc):
            p.terminate()
            p.join(10)
    return raw_rounds, stack_rounds


def codec_cpu_ms(traj, n: int, rounds: int) -> tuple[float, float]:
    """(encode, decode + validate) process CPU milliseconds per trajectory, medians of ``rounds`` of ``n``."""
    from arpo_async import codec
    from arpo_async.validation import check_trajectory

    frames = codec.encode(traj)

    def receive() -> None:
        check_trajectory(codec.decode(frames, max_bytes=1 << 30), vocab_size=VOCAB, version=0)

    def per_call(fn) -> float:
        times = []
        for _ in range(rounds):
            t0 = time.process_time()
            for _ in range(n):
                fn()
            times.append((time.process_time() - t0) / n * 1e3)
        return median(times)

    return per_call(lambda: codec.encode(traj)), per_call(receive)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 60 trajectories per mode")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per mode (default 7; quick 3)")
    parser.add_argument("--trajectories", type=int, default=None, help="per round (default 200; quick 60)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 7)
    n = args.trajectories or (60 if args.quick else 200)

    from arpo_async import codec
    from arpo_async.config import TransportConfig

    traj = make_trajectory()
    frames = codec.encode(traj)
    traj_bytes = sum(len(f) for f in frames)
    print(f"trajectory: {STEPS} steps, {len(traj.screenshots)} screenshots "
          f"({sum(map(len, traj.screenshots)) / STEPS / 1e3:.0f} KB mean), {PROMPT_TOKENS} prompt ids/step, "
          f"{len(frames)} frames, {traj_bytes / 1e6:.2f} MB on the wire; {rounds} rounds x {n} per mode, "
          f"alternating raw and stack; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    raw_rounds, stack_rounds = asyncio.run(run_rounds(traj, frames, n, rounds, TransportConfig().high_water_mark))

    def row(name: str, rs: list[Round]) -> dict[str, float]:
        mb = [n * traj_bytes / r.wall_s / 1e6 for r in rs]
        fig = {"traj_per_s": median(n / r.wall_s for r in rs), "mb_per_s": median(mb),
               "actor_cpu_ms": median(1e3 * r.actor_cpu_s / n for r in rs),
               "learner_cpu_ms": median(1e3 * r.learner_cpu_s / n for r in rs)}
        print(f"{name:<6} {fig['traj_per_s']:>8.1f} {fig['mb_per_s']:>8.0f} {fig['actor_cpu_ms']:>13.2f} "
              f"{fig['learner_cpu_ms']:>15.2f}   " + " ".join(f"{v:.0f}" for v in mb))
        return fig

    print(f"{'mode':<6} {'traj/s':>8} {'MB/s':>8} {'actor ms/traj':>13} {'learner ms/traj':>15}   "
          f"MB/s per round (CPU: process time, all threads)")
    raw, stack = row("raw", raw_rounds), row("stack", stack_rounds)
    encode_ms, receive_ms = codec_cpu_ms(traj, n, rounds)
    print(f"codec alone, per trajectory: encode {encode_ms:.3f} ms (actor), decode + validate {receive_ms:.3f} ms "
          f"(learner)")
    print(f"load average after the run: {os.getloadavg()[0]:.1f}")
    print(result_line({"traj_per_s": stack["traj_per_s"], "mb_per_s": stack["mb_per_s"],
                       "raw_mb_per_s": raw["mb_per_s"], "ratio": stack["mb_per_s"] / raw["mb_per_s"],
                       "traj_mb": traj_bytes / 1e6, "actor_cpu_ms_per_traj": stack["actor_cpu_ms"],
                       "learner_cpu_ms_per_traj": stack["learner_cpu_ms"], "encode_ms": encode_ms,
                       "decode_validate_ms": receive_ms}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
