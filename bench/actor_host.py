"""One actor host of bench/bench_hosts.py, run by it as a process of its own (in a network namespace where it can make
one): ``--actors`` real EnvActors with the real EpisodeRunner (UI-TARS prompt, PromptEncoder, reply parser,
evaluator) and the real LearnerLink over a DEALER SocketPump that connects to the learner at ``--endpoint``.

Stand-ins, from bench_actor_loop.py: the desktop is instant and in-process, and the policy waits ``--latency``
seconds and returns a valid UI-TARS click whose tokens carry the policy version the learner last announced to this
host. The evaluator's answer is a coin flip, so groups have a reward difference and the learner trains. Episode
budgets are drawn from 1..``--max-steps``, so trajectories arrive spread out.

The host writes its message counts, queue peaks and loop lag to ``--counts`` (JSON, atomically) every 0.5 s; on
SIGUSR1 it stops asking for work and drains, on SIGUSR2 it writes its final counts and exits (see
:func:`actor_host`).

    python -m bench.actor_host --endpoint tcp://10.0.0.1:5555 --actors 32 --actor-id host-a --model runs/tiny-model \
        --counts /tmp/host-a.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import signal
import sys
from pathlib import Path

from bench._common import desktop_png
from bench.bench_actor_loop import (HISTORY_IMAGES, OUTPUT_TOKENS, REPLY, FixedLatencyPolicy, InstantController,
                                    InstantPool)


class CoinController(InstantController):
    """An instant desktop whose evaluator reads "red" or "blue" at random: the task scores 1 half the time."""

    async def execute(self, command, *, shell: bool = False, timeout: float = 120, setup: bool = False) -> dict:
        return {"status": "success", "output": random.choice(("red", "blue")), "error": "", "returncode": 0}


class AnnouncedVersionPolicy(FixedLatencyPolicy):
    """FixedLatencyPolicy whose tokens carry the policy version the learner last announced to this host, as an
    inference server that loads every published version would report."""

    def __init__(self, latency_s: float, output_ids: list[int], link) -> None:
        super().__init__(latency_s, output_ids)
        self._link = link

    async def generate(self, **kwargs):
        generation = await super().generate(**kwargs)
        version = self._link.policy_version
        return dataclasses.replace(generation, weight_version=version,
                                   token_versions=[version] * len(generation.output_ids))


class RandomBudget:
    """An EpisodeRunner stand-in that runs each episode with one of ``runners`` (budgets 1..max_steps) at
    random, so episode lengths, and the times trajectories arrive, spread out."""

    def __init__(self, runners: list, rng: random.Random) -> None:
        self._runners, self._rng = runners, rng

    async def run(self, *args, **kwargs):
        """EpisodeRunner.run with a budget drawn at random."""
        return await self._rng.choice(self._runners).run(*args, **kwargs)


class StoppableWork:
    """The host's LearnerLink as the EnvActors' WorkSource until ``stop`` is set: from then on ``request_work``
    answers None, so each actor finishes and submits the episode it runs, then returns."""

    def __init__(self, link, stop: asyncio.Event) -> None:
        self.link, self.stop = link, stop
        self.actor_id = link.actor_id

    @property
    def running(self) -> int:
        """Episodes in flight on this host (the link's count, reported in heartbeats)."""
        return self.link.running

    @running.setter
    def running(self, value: int) -> None:
        self.link.running = value

    async def request_work(self):
        """The link's next assignment, or None once ``stop`` is set (also while a request waits)."""
        if self.stop.is_set():
            return None
        request = asyncio.ensure_future(self.link.request_work())
        stopped = asyncio.ensure_future(self.stop.wait())
        try:
            done, _ = await asyncio.wait({request, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if request in done:
            return request.result()
        request.cancel()
        return None

    async def submit(self, trajectory) -> None:
        """Hand the trajectory to the link (held until the learner acks it)."""
        await self.link.submit(trajectory)


async def actor_host(args: argparse.Namespace) -> None:
    """Run ``--actors`` EnvActors against the learner at ``--endpoint``. On SIGUSR1: stop asking
    for work, finish and submit the episodes in flight, wait for every ack, stop the heartbeats (``drained``); keep
    receiving until SIGUSR2, then write the final counts (``done``) and exit. Writes its counts to ``--counts``
    (JSON) every 0.5 s. SIGTERM ends it at once."""
    import zmq.asyncio

    from actors.env_actor import EnvActor
    from actors.episode import EpisodeRunner
    from actors.link import LearnerLink
    from arpo_async.config import ActorConfig, TransportConfig
    from arpo_async.loop_lag import LoopLag
    from arpo_async.model.inputs import PromptEncoder
    from arpo_async.transport import INBOX_SIZE, Outbox, SocketPump, dealer_socket

    encoder = PromptEncoder(args.model)
    pngs = [desktop_png(i) for i in range(args.max_steps + 1)]
    output_ids = (encoder.tokenize(REPLY) + encoder.eos_token_ids[:1] + [0] * OUTPUT_TOKENS)[:OUTPUT_TOKENS]
    transport = TransportConfig(endpoint=args.endpoint, heartbeat_s=1.0)
    config = ActorConfig(actors=args.actors, max_steps=args.max_steps, history_images=HISTORY_IMAGES)
    ctx = zmq.asyncio.Context()
    inbox, outbox = asyncio.Queue(INBOX_SIZE), Outbox(routed=False)
    pump = SocketPump(dealer_socket(ctx, transport, args.actor_id), inbox=inbox, outbox=outbox,
                      max_bytes=transport.max_message_bytes)
    link = LearnerLink(outbox, args.actor_id, args.actors, transport, args.run_id)
    policy = AnnouncedVersionPolicy(args.latency, output_ids, link)
    rng = random.Random(args.seed)
    runner = RandomBudget([EpisodeRunner(encoder, policy, dataclasses.replace(config, max_steps=n))
                           for n in range(1, args.max_steps + 1)], rng)
    stop, finish, drained = asyncio.Event(), asyncio.Event(), asyncio.Event()
    lag, peaks = LoopLag(), {"inbox": 0, "outbox": 0, "unacked": 0}
    work = StoppableWork(link, stop)
    env_actors = [EnvActor(i, work, InstantPool(pngs, CoinController), runner) for i in range(args.actors)]
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, stop.set)
    loop.add_signal_handler(signal.SIGUSR2, finish.set)

    def write_counts(done: bool = False) -> None:
        counts = {"actor_id": args.actor_id, "actors": args.actors, "messages": pump.message_counts(),
                  "unacked": link.unacked, "running": link.running, "episodes": sum(a.episodes for a in env_actors),
                  "steps": policy.steps, "peaks": dict(peaks), "loop_lag_ms": lag.summary(),
                  "stopped": stop.is_set(), "drained": drained.is_set(), "done": done}
        tmp = args.counts.with_suffix(".tmp")
        tmp.write_text(json.dumps(counts))
        tmp.replace(args.counts)

    async def watch() -> None:
        while True:
            for name, depth in (("inbox", inbox.qsize()), ("outbox", outbox.qsize()), ("unacked", link.unacked)):
                peaks[name] = max(peaks[name], depth)
            await asyncio.sleep(0.05)

    async def report() -> None:
        while True:
            write_counts()
            await asyncio.sleep(0.5)

    async def staggered(actor: EnvActor) -> None:
        await asyncio.sleep(rng.random() * args.latency)
        await actor.run()

    try:
        async with asyncio.TaskGroup() as tg:
            infra = [tg.create_task(pump.run()), tg.create_task(link.serve(inbox)), tg.create_task(lag.run()),
                     tg.create_task(watch()), tg.create_task(report())]
            keepalive = tg.create_task(link.keepalive())
            await asyncio.wait_for(link.connected.wait(), 120)
            rollouts = [tg.create_task(staggered(a)) for a in env_actors]
            await stop.wait()
            async with asyncio.timeout(args.drain_s):
                await asyncio.gather(*rollouts)  # each actor submits the episode it runs, then returns
                await link.wait_acked(args.drain_s)
            keepalive.cancel()  # no heartbeat from now on: a reply to one could come after the counts are final
            drained.set()
            await finish.wait()
            write_counts(done=True)
            for task in infra:
                task.cancel()
    finally:
        ctx.destroy(linger=0)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--endpoint", required=True, help="the learner's ROUTER address as this host sees it")
    p.add_argument("--actors", type=int, required=True, help="EnvActors on this host")
    p.add_argument("--actor-id", required=True, help="this host's actor id (its DEALER identity)")
    p.add_argument("--run-id", default="", help="the learner's run id, announced in Hello")
    p.add_argument("--model", type=Path, required=True, help="the policy's folder (its tokenizer)")
    p.add_argument("--latency", type=float, default=2.0, help="seconds per policy step of the stand-in")
    p.add_argument("--max-steps", type=int, default=3, help="episode budgets are drawn from 1..max-steps")
    p.add_argument("--counts", type=Path, required=True, help="JSON file the host's counts are written to")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drain-s", type=float, default=120.0, help="seconds to finish the episodes and get the acks")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    asyncio.run(actor_host(parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
