"""arpo-actors as a second host: its own network namespace, a private veth link, CURVE and an API key.

The test makes a network namespace with a veth pair on a private /30 (torn down after), runs arpo-serve and
arpo-learner in the host namespace on the link's address, and arpo-actors inside the namespace, so every byte
between them crosses the link over TCP: ZeroMQ with CURVE (the learner accepts only the actor host's listed
public key) and arpo-serve with a bearer token. Peers without the key, and HTTP requests without the token,
are refused. Needs root and iproute2 (the CI machine has both).
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import urllib.error
import urllib.request
import uuid
from contextlib import contextmanager

import pytest
import zmq
import zmq.asyncio
import zmq.auth

from arpo_async import codec
from arpo_cli.cli import write_keys
from arpo_async.config import dump_toml, load_config
from arpo_async.messages import Hello
from arpo_async.metrics import read_metrics
from tests import netns
from tests.integration.test_resume import Processes, remove_containers, tail
from tests.support import free_port, healthy, until_sync

pytestmark = pytest.mark.docker
PY = sys.executable


@contextmanager
def private_link():
    """tests.netns.private_link, skipping the test where namespaces cannot be made."""
    try:
        with netns.private_link() as link:
            yield link
    except netns.NamespaceUnavailable as why:
        pytest.skip(str(why))


async def answered(endpoint: str, keys: tuple[bytes, bytes] | None, server_key: bytes | None) -> bool:
    """Whether the learner answers a Hello from a peer with these CURVE keys (None: no CURVE) within 3 s."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, f"probe-{uuid.uuid4().hex[:6]}".encode())
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = keys[0], keys[1], server_key
    sock.connect(endpoint)
    try:
        await sock.send_multipart(codec.encode(Hello("probe", 1)))
        return bool(await sock.poll(3000))
    finally:
        sock.close()
        ctx.term()


def test_actor_host_in_its_own_namespace_over_curve_and_a_token(tmp_path, desktop_image, tiny_model):
    keys = tmp_path / "keys"
    learner_public, learner_secret = write_keys(keys / "learner", "learner")
    host_public, host_secret = write_keys(keys / "host-a", "host-a")
    authorized = keys / "authorized"
    authorized.mkdir()
    shutil.copy(host_public, authorized / "host-a.key")
    token = uuid.uuid4().hex
    run_id = f"ns-{uuid.uuid4().hex[:8]}"
    with private_link() as (ns, host_ip, _):
        serve_port, zmq_port = free_port(), free_port()
        url, endpoint = f"http://{host_ip}:{serve_port}", f"tcp://{host_ip}:{zmq_port}"
        config = load_config(None, [
            f'run_dir="{tmp_path / "run"}"', f'model="{tiny_model}"', f'run_id="{run_id}"',
            f'transport.endpoint="{endpoint}"', "transport.heartbeat_s=0.5", f'serve.api_key="{token}"',
            'learner.task_ids=["grid4-"]', "learner.group_size=2", "learner.groups_per_step=1", "learner.steps=2",
            "actors.actors=2", "actors.max_steps=1", f'actors.inference_urls=["{url}"]',
            f'actors.image="{desktop_image}"'])
        path = tmp_path / "config.toml"
        path.write_text(dump_toml(config))
        procs = Processes(tmp_path / "logs")
        try:
            procs.start("serve", [PY, "-m", "arpo_serve.main", "--model", str(tiny_model), "--host", host_ip,
                                  "--port", str(serve_port), "--api-key", token])
            until_sync(lambda: healthy(url), 180, "arpo-serve /health", check=lambda: procs.check_alive("serve"))
            procs.start("learner", [PY, "-m", "learner.main", "--config", str(path),
                                    "--set", f'transport.curve_secret_key_file="{learner_secret}"',
                                    "--set", f'transport.curve_authorized_dir="{authorized}"'])
            procs.start("actors", netns.in_namespace(ns, [
                PY, "-m", "actors.main", "--config", str(path), "--actor-id", "host-a",
                "--set", f'transport.curve_secret_key_file="{host_secret}"',
                "--set", f'transport.curve_server_key_file="{learner_public}"']))
            metrics = tmp_path / "run" / "metrics.jsonl"
            alive = lambda: procs.check_alive("serve", "learner", "actors", clean_exit_ok=True)  # noqa: E731
            until_sync(lambda: len(read_metrics(metrics)) >= 2, 300, "2 steps from the actor host", check=alive)
            assert procs.procs["learner"].wait(timeout=120) == 0, tail(procs.log("learner"))

            with pytest.raises(urllib.error.HTTPError) as refused:  # no token: 401 (only /health is open)
                urllib.request.urlopen(f"{url}/get_model_info", timeout=10)
            assert refused.value.code == 401
        finally:
            procs.stop_all()
            remove_containers(run_id)
    assert "without CURVE" not in (tmp_path / "logs" / "learner.log").read_text()
    assert "host-a" in (tmp_path / "logs" / "actors.log").read_text()


def test_the_learner_refuses_peers_without_a_listed_key(tmp_path, tiny_model):
    """CURVE on the learner's socket: a listed key is answered, an unlisted key and a plain peer are not."""
    keys = tmp_path / "keys"
    learner_public, learner_secret = write_keys(keys, "learner")
    listed_public, listed_secret = write_keys(keys / "listed", "listed")
    _, stranger_secret = write_keys(keys / "stranger", "stranger")
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    shutil.copy(listed_public, authorized / "listed.key")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = load_config(None, [f'run_dir="{tmp_path / "run"}"', f'model="{tiny_model}"',
                                f'transport.endpoint="{endpoint}"', "learner.steps=1",
                                f'transport.curve_secret_key_file="{learner_secret}"',
                                f'transport.curve_authorized_dir="{authorized}"',
                                'actors.inference_urls=["http://127.0.0.1:9"]'])
    path = tmp_path / "config.toml"
    path.write_text(dump_toml(config))
    procs = Processes(tmp_path / "logs")
    try:
        procs.start("learner", [PY, "-m", "learner.main", "--config", str(path)])
        server_key = zmq.auth.load_certificate(str(learner_public))[0]
        listed = zmq.auth.load_certificate(str(listed_secret))
        stranger = zmq.auth.load_certificate(str(stranger_secret))
        until_sync(lambda: asyncio.run(answered(endpoint, listed, server_key)), 120, "the learner to answer a listed key",
                   check=lambda: procs.check_alive("learner"))
        assert not asyncio.run(answered(endpoint, stranger, server_key))
        assert not asyncio.run(answered(endpoint, None, None))
        assert asyncio.run(answered(endpoint, listed, server_key))
    finally:
        procs.stop_all()
