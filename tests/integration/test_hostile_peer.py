"""A hostile peer beside an honest run: real arpo-serve, arpo-learner and arpo-actors on real desktops.

The hostile peer connects to the learner's ROUTER like an actor and sends a NaN score, token ids past the
vocabulary, a trajectory with a boolean schema, and a flood of 2,000 work requests (more than the slots its Hello
announced), then goes silent holding the rollouts it was given. The learner rejects each message with a reason,
counts it by reason, frees the silent peer's rollouts, and the honest actors' training steps still happen.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import uuid

import msgpack
import pytest
import zmq
import zmq.asyncio

from arpo_async import codec
from arpo_async.config import load_config
from arpo_async.messages import Hello, WorkRequest
from arpo_async.metrics import read_metrics
from tests.wire_fuzz import base_trajectory, reencode
from tests.integration.test_resume import read_json, running_job, tail, write_config
from tests.support import until_sync

pytestmark = pytest.mark.docker


def from_version_zero(traj):
    """The trajectory as a peer of a learner still at version 0 would claim it (so only the bad value stands out)."""
    traj.assigned_version = 0
    for step in traj.steps:
        step.versions = [0] * len(step.output_ids)
    return traj


async def hostile(endpoint: str, received: list) -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, b"hostile")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        session = secrets.token_urlsafe(16)  # its own session: it gets its own 2 rollouts, nothing of others'
        await sock.send_multipart(codec.encode(Hello("hostile", 2, session=session)))
        nan = from_version_zero(base_trajectory(random.Random(1)))
        nan.score = float("nan")
        await sock.send_multipart(codec.encode(nan))
        far = from_version_zero(base_trajectory(random.Random(2)))
        far.steps[0].output_ids[0] = 10**6
        await sock.send_multipart(codec.encode(far))
        await sock.send_multipart(reencode(codec.encode(base_trajectory(random.Random(3))),
                                           lambda h: h.__setitem__("schema", True)))
        for i in range(2000):
            await sock.send_multipart(codec.encode(WorkRequest(f"flood-{i}", "hostile", session=session)))
        while await sock.poll(3000):  # read what the learner answers, then go silent
            frames = await sock.recv_multipart()
            received.append(msgpack.unpackb(frames[0], raw=False, ext_hook=lambda c, d: d)["type"])
    finally:
        sock.close()
        ctx.term()


def test_hostile_peer_is_rejected_and_honest_training_goes_on(tmp_path, desktop_image, tiny_model):
    run_id = f"hostile-{uuid.uuid4().hex[:8]}"
    config, url = write_config(tmp_path, tiny_model, desktop_image, run_id, "learner.steps=10",
                               "transport.peer_timeout_s=4.0", "actors.actors=2")
    endpoint = load_config(config, []).transport.endpoint
    metrics, status = tmp_path / "run" / "metrics.jsonl", tmp_path / "run" / "status.json"
    with running_job(tmp_path, config, url, tiny_model, run_id) as procs:
        alive = lambda: procs.check_alive("serve", "learner", "actors", clean_exit_ok=True)  # noqa: E731
        until_sync(lambda: read_json(status).get("actors", 0) >= 1, 300, "the honest actors", check=alive)
        received: list[str] = []
        asyncio.run(hostile(endpoint, received))
        learner_log = tmp_path / "logs" / "learner.log"
        until_sync(lambda: "silent" in learner_log.read_text(), 120, "the silent hostile peer to be dropped", check=alive)
        until_sync(lambda: len(read_metrics(metrics)) >= 10, 300, "10 steps of honest training", check=alive)
        procs.procs["learner"].wait(timeout=120)
        assert procs.procs["learner"].returncode == 0, tail(procs.log("learner"))
    assert received.count("reject") >= 4 and "assignment" in received
    assert received.count("assignment") <= 2  # no more than the 2 slots its Hello announced
    rejections = read_metrics(metrics)[-1]["rejections"]
    assert rejections.get("score", 0) >= 1 and rejections.get("token_ids", 0) >= 1
    assert rejections.get("wire", 0) >= 1 and rejections.get("slots", 0) >= 1900
    log = (tmp_path / "logs" / "learner.log").read_text()
    assert "rejected a message from hostile: score" in log
    assert "silent" in log  # its 2 rollouts were handed out again
