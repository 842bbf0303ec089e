"""arpo-actors: N EnvActors in one process. `run_actors` wires every component in one visible function.

Dataflow (every queue and task is made in `run_actors`): EnvActor x N -> LearnerLink.submit -> outbox -> DEALER
SocketPump -> learner; learner -> DEALER SocketPump -> inbox -> LearnerLink.serve (assignments, acks, versions).
EnvActors get desktops from the DesktopPool (over DesktopFleet: containers, warm spares) and replies from the
PolicyClient (/generate).
Stops when the learner says shutdown or on SIGINT / SIGTERM; either way every container of this process is
removed (each actor releases its own in ``finally``, the pool removes every desktop it started, then the fleet
removes anything left with the run's label). The learner says shutdown when training is over and takes no more
trajectories, so the episodes still in flight are cancelled then, not finished.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys

import zmq.asyncio

from actors.desktop.build import image_tag
from actors.desktop.fleet import DesktopFleet
from actors.desktop.pool import DesktopPool
from actors.env_actor import EnvActor
from actors.episode import EpisodeRunner
from actors.link import ActorRefused, LearnerLink
from actors.osworld.downloads import run_download_cache
from arpo_async.inference_client import PolicyClient, RetryPolicy
from arpo_async.config import ConfigError, RunConfig, load_config
from arpo_async.config_doc import add_config_arguments
from arpo_async.model.inputs import PromptEncoder
from arpo_async.process import run_until_signal, setup_logging
from arpo_async.transport import INBOX_SIZE, Envelope, Outbox, SocketPump, dealer_socket

log = logging.getLogger("arpo.actors")


def desktop_pool(config: RunConfig) -> DesktopPool:
    """This actor host's DesktopPool (not started) over its DesktopFleet (``pool.fleet``), both as the run config
    says: the run's desktop image (``actors.image``, else ``actors.image_profile``'s), the fleet label, screen,
    memory and process limits, start slots, warm spares, start tries, health interval and episodes per desktop."""
    ac = config.actors
    fleet = DesktopFleet(ac.image or image_tag(ac.image_profile), config.fleet_label, screen=ac.screen_size,
                         memory_mb=ac.desktop_memory_mb, pids_limit=ac.desktop_pids,
                         max_concurrent_starts=ac.max_concurrent_starts)
    return DesktopPool(fleet, warm_spares=ac.warm_spares, start_attempts=ac.desktop_start_attempts,
                       health_interval_s=ac.desktop_health_interval_s, max_episodes=ac.desktop_max_episodes)


async def run_actors(config: RunConfig, actor_id: str) -> None:
    """Connect to the learner and run ``actors.actors`` EnvActors until shutdown; remove every desktop.

    Raises:
        actors.link.ActorRefused: the learner refused this process (it belongs to another run); the process
            exits non-zero with the learner's message.
    """
    ac = config.actors
    encoder = PromptEncoder(config.model_path)
    policy = PolicyClient(list(ac.inference_urls), api_key=config.serve.api_key,
                          retry=RetryPolicy(attempts=ac.policy_attempts, max_delay_s=ac.policy_max_wait_s))
    pool = desktop_pool(config)
    fleet = pool.fleet
    ctx = zmq.asyncio.Context()
    inbox: asyncio.Queue[Envelope] = asyncio.Queue(INBOX_SIZE)  # DEALER pump -> link
    outbox = Outbox(routed=False)  # link -> DEALER pump
    pump = SocketPump(dealer_socket(ctx, config.transport, actor_id), inbox=inbox, outbox=outbox,
                      max_bytes=config.transport.max_message_bytes)
    link = LearnerLink(outbox, actor_id, ac.actors, config.transport, config.resolved_run_id)
    try:
        downloads = run_download_cache(config.run_dir, config.learner.osworld_files, ac.download_max_mb,
                                       ac.download_timeout_s)
    except ValueError as exc:  # learner.osworld_files is not a folder
        raise ConfigError(str(exc)) from exc
    runner = EpisodeRunner(encoder, policy, ac, downloads, config.learner.success_threshold)
    log.info("%s: %d actors -> learner %s, inference %s", actor_id, ac.actors, config.transport.endpoint,
             ", ".join(ac.inference_urls))
    try:
        async with asyncio.TaskGroup() as tg:
            background = [tg.create_task(pump.run()), tg.create_task(link.serve(inbox)),
                          tg.create_task(link.keepalive()), pool.start(tg)]
            async with asyncio.TaskGroup() as actors:
                rollouts = [actors.create_task(EnvActor(index, link, pool, runner).run())
                            for index in range(ac.actors)]
                actors.create_task(cancel_on_shutdown(link, rollouts))
            if not await link.wait_acked(config.transport.heartbeat_s):
                log.info("%d trajectories sent as the learner finished were not taken (the run is over)", link.unacked)
            for task in background:
                task.cancel()
        if link.refused:
            raise ActorRefused(link.shutdown_reason)
    finally:
        try:
            await pool.close()
        finally:
            removed = await fleet.remove_all()
        log.info("removed %d leftover desktops; desktop pool: %s", removed, dict(pool.stats))
        if policy.server_faults:
            log.warning("unusable /generate answers by inference server (those episodes ended ABORTED): %s",
                        dict(policy.server_faults))
        if link.unencodable:
            log.warning("%d trajectories could not be encoded (sent as ENV_ERROR records)", link.unencodable)
        await fleet.close()
        await policy.aclose()
        ctx.destroy(linger=0)


async def cancel_on_shutdown(link: LearnerLink, rollouts: list[asyncio.Task]) -> None:
    """Once the learner says shutdown, cancel the EnvActors' episodes still in flight.

    The learner sends Shutdown when training is over and exits right after, so a trajectory finished later could
    never be acknowledged: finishing those episodes would only delay this process's exit by up to an episode
    (and the wait for acks). Each cancelled EnvActor still releases its desktop in ``finally``.
    """
    await link.shutdown.wait()
    log.info("learner said shutdown (%s); cancelling %d episodes in flight", link.shutdown_reason, link.running)
    for rollout in rollouts:
        rollout.cancel()


def build_parser() -> argparse.ArgumentParser:
    """arpo-actors' command line: ``--config``/``--set``, ``--actors`` and ``--actor-id`` (default host-pid)."""
    parser = argparse.ArgumentParser(
        prog="arpo-actors", description="Environment actors: N docker desktops, each running episodes the learner "
        "hands out (policy replies from the inference servers) and sending the trajectories back over ZeroMQ.")
    add_config_arguments(parser, ("", "actors", "transport", "learner", "serve"))
    parser.add_argument("--actors", type=int, help="EnvActors in this process (overrides actors.actors)")
    parser.add_argument("--actor-id", default=f"{socket.gethostname()}-{os.getpid()}",
                        help="this process's id (its ZeroMQ routing id); default host-pid")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    overrides = list(args.overrides) + ([f"actors.actors={args.actors}"] if args.actors else [])
    try:
        config = load_config(args.config, overrides)
    except ConfigError as e:
        log.error("%s", e)
        return 2
    return run_until_signal(run_actors(config, args.actor_id), "arpo-actors")


if __name__ == "__main__":
    sys.exit(main())
