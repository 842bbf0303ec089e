"""The actor fleet under failure, with every real part: desktop containers, the real arpo-serve (a subprocess
with the tiny model), a LearnerService on real ZeroMQ TCP sockets, EnvActors with a DesktopPool.

(a) a desktop killed mid-episode gives an ENV_ERROR trajectory carrying a DesktopError; the actor goes on
    with a new desktop;
(b) arpo-serve stopped for a while: the episode in flight ends ABORTED after its retries; once the server is
    back on the same port the actor produces trainable trajectories again;
(c) SIGTERM to a real `arpo-actors` process mid-episode: it exits 0 and no container with its run label is left;
    the learner's Shutdown mid-episode cancels the episodes in flight (none runs on), with the same clean exit;
(d) with desktop reuse, a desktop whose episode ended in ENV_ERROR (here a setup step that fails on a live
    desktop) is never handed out again, while desktops of trainable episodes are reset and reused.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

import aiodocker
import pytest
import zmq.asyncio

from actors.desktop.fleet import DesktopFleet
from actors.desktop.pool import DesktopPool
from actors.env_actor import EnvActor
from actors.episode import EpisodeRunner
from actors.link import LearnerLink
from arpo_async.config import ActorConfig, TransportConfig
from arpo_async.inference_client import PolicyClient, RetryPolicy
from arpo_async.messages import Outcome, Trajectory
from arpo_async.model.inputs import PromptEncoder
from arpo_async.tasks import Task, load_tasks
from arpo_async.transport import INBOX_SIZE, Outbox, SocketPump, dealer_socket, router_socket
from learner.rollouts.scheduler import GroupScheduler
from learner.rollouts.service import LearnerService
from learner.rollouts.staleness import StalenessManager
from tests.support import ServeProcess, free_port, labelled, until

pytestmark = pytest.mark.docker

TASKS = [t for t in load_tasks() if t.id == "grid4-red"]
EPISODE_DEADLINE_S = 300.0  # generous: CPU inference and container boots share 2 contended cores


@pytest.fixture(scope="module")
def encoder(tiny_model):
    return PromptEncoder(tiny_model)


def actor_config(**kw) -> ActorConfig:
    return ActorConfig(actors=1, max_steps=2, max_new_tokens=48, warm_spares=1, step_timeout_s=60.0,
                       setup_timeout_s=60.0, **kw)


@asynccontextmanager
async def learner(ctx: zmq.asyncio.Context, transport: TransportConfig, tasks: list[Task] = TASKS):
    """A LearnerService on a real ROUTER socket; yields (service, list of trajectories received, in order)."""
    received: list[Trajectory] = []

    async def serve(inbox: asyncio.Queue) -> None:
        while True:
            env = await inbox.get()
            if isinstance(env.message, Trajectory):
                received.append(env.message)
            await service.handle(env)

    inbox, outbox = asyncio.Queue(INBOX_SIZE), Outbox(routed=True)
    pump = SocketPump(router_socket(ctx, transport), inbox=inbox, outbox=outbox, max_bytes=transport.max_message_bytes)
    service = LearnerService(outbox, GroupScheduler(tasks, group_size=2), StalenessManager(1000, 0))
    tasks = [asyncio.create_task(pump.run()), asyncio.create_task(serve(inbox))]
    try:
        yield service, received
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@asynccontextmanager
async def actors(ctx, transport, pool: DesktopPool, runner: EpisodeRunner, n: int = 1):
    """``n`` EnvActors in this process (as arpo-actors wires them), running in the background."""
    actor_id = f"test-actors-{secrets.token_hex(3)}"
    inbox, outbox = asyncio.Queue(INBOX_SIZE), Outbox(routed=False)
    pump = SocketPump(dealer_socket(ctx, transport, actor_id), inbox=inbox, outbox=outbox,
                      max_bytes=transport.max_message_bytes)
    link = LearnerLink(outbox, actor_id, n, transport)
    envs = [EnvActor(i, link, pool, runner) for i in range(n)]
    tasks = [asyncio.create_task(pump.run()), asyncio.create_task(link.keepalive()),
             asyncio.create_task(link.serve(inbox))]
    tasks += [asyncio.create_task(a.run()) for a in envs]
    try:
        yield envs
        for t in tasks[2:]:
            assert not t.done() or t.cancelled() or t.exception() is None, t.exception()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture
def transport() -> TransportConfig:
    return TransportConfig(endpoint=f"tcp://127.0.0.1:{free_port()}", heartbeat_s=0.2, resend_after_s=5.0)


@pytest.fixture
async def pool(desktop_image):
    fleet = DesktopFleet(desktop_image, run_id=f"test-ff-{secrets.token_hex(3)}")
    p = DesktopPool(fleet, warm_spares=1, health_interval_s=2.0)
    p.start()
    try:
        yield p
    finally:
        await p.close()
        await fleet.remove_all()
        await fleet.close()
        assert await labelled(fleet.run_id) == []


def check_screenshot_indices(traj: Trajectory) -> None:
    """Every step references stored screenshots; no screenshot is stored twice."""
    assert len(set(traj.screenshots)) == len(traj.screenshots)
    assert all(0 <= i < len(traj.screenshots) for s in traj.steps for i in s.image_indices)


async def test_desktop_killed_mid_episode_gives_env_error_and_actor_goes_on(tiny_serve, encoder, pool, transport):
    policy = PolicyClient([tiny_serve.url], retry=RetryPolicy(attempts=3, base_delay_s=0.2, max_delay_s=1.0))
    runner = EpisodeRunner(encoder, policy, actor_config())
    ctx = zmq.asyncio.Context()
    try:
        async with learner(ctx, transport) as (_, received), actors(ctx, transport, pool, runner):
            await until(lambda: pool.in_use, EPISODE_DEADLINE_S, "an episode to start")
            victim = pool.in_use[0]
            await pool.fleet.docker.containers.container(victim.container_id).kill()
            await until(lambda: received, EPISODE_DEADLINE_S, "the killed episode's trajectory")
            first = received[0]
            assert first.outcome == Outcome.ENV_ERROR.value and first.desktop == victim.name
            assert "DesktopError" in first.error, first.error
            await until(lambda: any(t.outcome.trainable for t in received), EPISODE_DEADLINE_S,
                        "a trainable trajectory on a new desktop")
            after = next(t for t in received if t.outcome.trainable)
            assert after.desktop and after.desktop != victim.name and after.steps
            check_screenshot_indices(after)
            assert victim.container_id not in await labelled(pool.fleet.run_id)  # the dead one is gone
    finally:
        await policy.aclose()
        ctx.destroy(linger=0)


async def test_inference_outage_aborts_then_actor_recovers(tiny_model, encoder, pool, transport, tmp_path):
    serve = ServeProcess(tiny_model, free_port(), tmp_path)
    await asyncio.to_thread(serve.start)
    policy = PolicyClient([serve.url], retry=RetryPolicy(attempts=3, base_delay_s=0.2, max_delay_s=0.5,
                                                         connect_timeout_s=2.0))
    runner = EpisodeRunner(encoder, policy, actor_config())
    ctx = zmq.asyncio.Context()
    try:
        async with learner(ctx, transport) as (_, received), actors(ctx, transport, pool, runner):
            await until(lambda: pool.in_use, EPISODE_DEADLINE_S, "an episode to start")
            await asyncio.to_thread(serve.stop)  # the server is down until an episode has given up on it
            await until(lambda: any(t.outcome == Outcome.ABORTED.value for t in received), EPISODE_DEADLINE_S,
                        "an episode to end ABORTED during the outage")
            aborted = next(t for t in received if t.outcome == Outcome.ABORTED.value)
            assert "PolicyUnavailable" in aborted.error, aborted.error
            n_before = len(received)
            await asyncio.to_thread(serve.start)  # same port
            await until(lambda: any(t.outcome.trainable for t in received[n_before:]), EPISODE_DEADLINE_S,
                        "a trainable trajectory after the server came back")
            assert all(t.outcome in (Outcome.ABORTED.value, Outcome.ENV_ERROR.value) or t.outcome.trainable
                       for t in received)
            assert serve.starts == 2
    finally:
        await policy.aclose()
        await asyncio.to_thread(serve.stop)
        ctx.destroy(linger=0)


async def test_env_error_desktop_is_never_reused_and_good_ones_are(tiny_serve, encoder, desktop_image, transport):
    good = TASKS[0]
    broken = Task.from_dict({**good.to_dict(), "id": "grid4-red-broken", "config": list(good.config) + [
        {"type": "open", "parameters": {"path": "/root/no-such-file.txt"}}]})  # fails at once (no window wait)
    fleet = DesktopFleet(desktop_image, run_id=f"test-ff-{secrets.token_hex(3)}")
    policy = PolicyClient([tiny_serve.url], retry=RetryPolicy(attempts=3, base_delay_s=0.2, max_delay_s=1.0))
    runner = EpisodeRunner(encoder, policy, actor_config())
    ctx = zmq.asyncio.Context()
    try:
        async with DesktopPool(fleet, warm_spares=0, max_episodes=8) as pool, \
                learner(ctx, transport, [good, broken]) as (_, received), actors(ctx, transport, pool, runner):
            def enough() -> bool:
                errors = [t for t in received if t.outcome == Outcome.ENV_ERROR.value]
                return len(errors) >= 2 and sum(t.outcome.trainable for t in received) >= 3
            await until(enough, EPISODE_DEADLINE_S, "2 ENV_ERROR and 3 trainable trajectories")
        for i, traj in enumerate(received):
            if traj.outcome == Outcome.ENV_ERROR.value:
                assert "TaskSetupError" in traj.error and traj.task_id == broken.id, traj.error
                assert traj.desktop not in {t.desktop for t in received[i + 1:]}, "an ENV_ERROR desktop was reused"
        desktops = [t.desktop for t in received]
        assert len(set(desktops)) < len(desktops)  # some desktop served more than one episode
        assert pool.stats["resets"] >= 1 and pool.stats["reset_failures"] == 0
    finally:
        await fleet.remove_all()
        await fleet.close()
        await policy.aclose()
        ctx.destroy(linger=0)
    assert await labelled(fleet.run_id) == []


@asynccontextmanager
async def actors_process(tiny_serve, tiny_model, desktop_image, transport, tmp_path, run_id: str):
    """A real `arpo-actors` process (2 EnvActors, 15 clicks an episode) against a LearnerService on a real
    ROUTER, started once episodes run on its desktops; yields (service, process, log path). Whatever failed,
    the process is killed and the run's containers removed afterwards."""
    ctx = zmq.asyncio.Context()
    log_path = tmp_path / "actors.log"
    proc = None
    try:
        async with learner(ctx, transport) as (service, _):
            log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "actors.main", "--actors", "2", "--actor-id", f"proc-{uuid.uuid4().hex[:6]}",
                    "--set", f"run_id={run_id}", "--set", f"model={tiny_model}",
                    "--set", f"transport.endpoint={transport.endpoint}",
                    "--set", f'actors.inference_urls=["{tiny_serve.url}"]', "--set", f'actors.image="{desktop_image}"',
                    "--set", "actors.warm_spares=1", "--set", "actors.max_steps=15",
                    "--set", 'actors.grammar_actions=["click"]',  # no finished(): every episode runs 15 steps
                    stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            finally:
                os.close(log)
            async def episodes_on_desktops() -> bool:
                assert proc.returncode is None, log_path.read_text()[-3000:]
                return service.report.status()["running"] >= 1 and len(await labelled(run_id)) >= 2

            await until(episodes_on_desktops, EPISODE_DEADLINE_S, f"arpo-actors to start an episode (log: {log_path})",
                        every_s=0.2)
            yield service, proc, log_path
    finally:
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
        ctx.destroy(linger=0)
        async with aiodocker.Docker() as docker:  # never leave containers behind, whatever failed
            for c in await docker.containers.list(all="true", filters=json.dumps({"label": [f"arpo.run={run_id}"]})):
                await c.delete(force=True)


async def test_sigterm_removes_every_container_and_exits_0(tiny_serve, tiny_model, desktop_image, transport, tmp_path):
    run_id = f"test-sigterm-{secrets.token_hex(3)}"
    async with actors_process(tiny_serve, tiny_model, desktop_image, transport, tmp_path, run_id) as (_, proc, log_path):
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(120):
            rc = await proc.wait()
        assert rc == 0, log_path.read_text()[-3000:]
        assert "stopped by signal" in log_path.read_text()  # not a learner shutdown
        assert await labelled(run_id) == []
        assert not (Path("/tmp/arpo-desktops") / run_id).exists()


async def test_learner_shutdown_cancels_episodes_in_flight(tiny_serve, tiny_model, desktop_image, transport, tmp_path):
    """Training is over: the learner's Shutdown cancels the episodes still running (their trajectories could
    never be acknowledged) instead of finishing them; the process exits 0 and removes every container."""
    run_id = f"test-shutdown-{secrets.token_hex(3)}"
    async with actors_process(tiny_serve, tiny_model, desktop_image, transport, tmp_path, run_id) as (
            service, proc, log_path):
        await service.shutdown_actors("training finished")
        async with asyncio.timeout(120):
            rc = await proc.wait()
        text = log_path.read_text()
        assert rc == 0, text[-3000:]
        cancelled = re.search(r"learner said shutdown \(training finished\); cancelling (\d+) episodes in flight", text)
        assert cancelled and int(cancelled[1]) >= 1, text[-3000:]
        assert not re.search(r"actor \S+ \S+ #\d+: ", text[cancelled.end():]), "an episode ran on after shutdown"
        assert await labelled(run_id) == []


async def test_a_generation_the_server_aborts_ends_the_episode_aborted(tiny_model, encoder, pool, transport,
                                                                      tmp_path):
    """finish_reason "abort" (here: arpo-serve paused with mode abort while the episode's request waits) is not
    the policy's reply: the episode ends ABORTED, never trained on, and the actor goes on."""
    import aiohttp

    serve = ServeProcess(tiny_model, free_port(), tmp_path)
    await asyncio.to_thread(serve.start)
    policy = PolicyClient([serve.url], retry=RetryPolicy(attempts=3, base_delay_s=0.2, max_delay_s=0.5))
    runner = EpisodeRunner(encoder, policy, actor_config())
    ctx = zmq.asyncio.Context()
    try:
        async with aiohttp.ClientSession() as http:
            async def queued() -> int:
                async with http.get(f"{serve.url}/get_server_info") as resp:
                    return (await resp.json())["internal_states"][0]["queue_depth"]

            await http.post(f"{serve.url}/pause_generation", json={"mode": "in_place"})
            async with learner(ctx, transport) as (_, received), actors(ctx, transport, pool, runner):
                await until(queued, EPISODE_DEADLINE_S, "an episode's request to wait on the paused server")
                await http.post(f"{serve.url}/pause_generation", json={"mode": "abort"})  # ends what waits
                await http.post(f"{serve.url}/continue_generation", json={})
                await until(lambda: any(t.outcome == Outcome.ABORTED.value for t in received), EPISODE_DEADLINE_S,
                            "an episode to end ABORTED")
                aborted = next(t for t in received if t.outcome == Outcome.ABORTED.value)
                assert "GenerationAborted" in aborted.error, aborted.error
                assert not aborted.outcome.trainable
                n_before = len(received)
                await until(lambda: any(t.outcome.trainable for t in received[n_before:]), EPISODE_DEADLINE_S,
                            "a trainable trajectory after the abort")
    finally:
        await policy.aclose()
        await asyncio.to_thread(serve.stop)
        ctx.destroy(linger=0)
