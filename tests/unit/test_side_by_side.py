"""What two `arpo run`s on one host must not share (arpo_cli.side_by_side), with real sockets, a real ZeroMQ
ROUTER, a real HTTP server standing in for another run's arpo-serve and real child processes.

On b190f2c every run listened on 30000 and 5555 without a check, derived its run id from its folder's name alone
(``a/demo`` and ``b/demo`` labelled their desktops alike), and `arpo run` took any server answering /health on its
port for its own."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from arpo_async.config import ConfigError, RunConfig, dump_toml, load_config
from arpo_async.transport import dealer_socket, learner_socket
from arpo_cli.launcher import RunError, wait_healthy
from arpo_cli.side_by_side import (PortInUse, claim_host, create_tiny_model_once, derived_run_id, log_size,
                                   own_server_url, ready_line_seen)
from tests.support import local_http_server

DEADLINE_S = 30.0  # generous: python start-ups on 2 busy cores


def listening(host: str = "127.0.0.1") -> socket.socket:
    """A TCP socket listening on ``host`` at a port the kernel picked: another program holding a port."""
    held = socket.socket()
    held.bind((host, 0))
    held.listen()
    return held


def bindable(host: str, port: int) -> bool:
    """Whether a listening socket can be bound there now (as arpo-serve's would be)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            assert e.errno == errno.EADDRINUSE
            return False
    return True


def fresh(tmp_path: Path, *overrides: str) -> RunConfig:
    return load_config(None, [f"run_dir={tmp_path / 'run'}", *overrides])


def test_left_unset_every_port_is_a_free_one_and_the_actors_use_the_runs_own_server(tmp_path):
    config = claim_host(fresh(tmp_path), resume=False)
    endpoint_port = int(config.transport.endpoint.rsplit(":", 1)[1])
    assert config.serve.port > 0 and endpoint_port > 0 and config.serve.port != endpoint_port
    assert bindable("127.0.0.1", config.serve.port) and bindable("127.0.0.1", endpoint_port)
    assert config.transport.endpoint == f"tcp://127.0.0.1:{endpoint_port}"
    assert config.actors.inference_urls == (f"http://127.0.0.1:{config.serve.port}",) == (own_server_url(config),)
    # written into the run file every child reads, and read back as concrete values
    assert load_config(None, []) != config and dump_toml(config).count(str(config.serve.port)) >= 2


def test_an_explicit_free_port_is_kept_as_given(tmp_path):
    with listening() as a, listening() as b:  # two ports the kernel gives no one else while held
        serve, learner = a.getsockname()[1], b.getsockname()[1]
    config = claim_host(fresh(tmp_path, f"serve.port={serve}", f"transport.endpoint=tcp://127.0.0.1:{learner}"),
                        resume=False)
    assert (config.serve.port, config.transport.endpoint) == (serve, f"tcp://127.0.0.1:{learner}")


@pytest.mark.parametrize("holder_host", ["127.0.0.1", "0.0.0.0"])
def test_a_busy_serve_port_is_refused_in_one_line_naming_the_key(tmp_path, holder_host):
    with listening(holder_host) as held:
        port = held.getsockname()[1]
        with pytest.raises(PortInUse) as refused:
            claim_host(fresh(tmp_path, f"serve.port={port}"), resume=False)
    message = str(refused.value)
    assert message == (f"serve.port = {port} is in use on 127.0.0.1 (another run?); choose another or leave it unset "
                       "for a free one")
    assert isinstance(refused.value, ConfigError) and "\n" not in message


def test_a_port_held_by_another_learners_router_is_refused_naming_transport_endpoint(tmp_path):
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    try:
        router.bind("tcp://127.0.0.1:0")
        port = int(router.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
        with pytest.raises(PortInUse, match=rf"^transport\.endpoint = {port} is in use on 127\.0\.0\.1 \(another run"):
            claim_host(fresh(tmp_path, f"transport.endpoint=tcp://127.0.0.1:{port}"), resume=False)
    finally:
        router.close(linger=0)
        ctx.term()


def test_inference_urls_naming_another_runs_server_are_refused(tmp_path):
    with listening() as other:  # another run's arpo-serve
        url = f"http://127.0.0.1:{other.getsockname()[1]}"
        with pytest.raises(ConfigError, match=r"actors.inference_urls = \['http://127.0.0.1:\d+'\] does not name "
                                              r"this run's own arpo-serve \(http://127.0.0.1:\d+, from serve.host"):
            claim_host(fresh(tmp_path, f'actors.inference_urls=["{url}"]'), resume=False)


def test_two_folders_of_one_name_get_two_run_ids_that_survive_the_socket_folders_cut(tmp_path):
    a, b = tmp_path / "a" / "demo", tmp_path / "b" / "demo"
    ids = {derived_run_id(a), derived_run_id(b)}
    assert len(ids) == 2 and all(i.startswith("demo-") for i in ids)
    assert derived_run_id(a) == derived_run_id(tmp_path / "a" / "." / "demo")  # the same folder: the same id
    long_a, long_b = (tmp_path / p / ("x" * 60) for p in ("a", "b"))
    cut = {derived_run_id(p)[:24] for p in (long_a, long_b)}  # actors.desktop.fleet keeps 24 characters
    assert len(cut) == 2
    weird = derived_run_id(tmp_path / "we ird/../we;ird $(rm)")
    assert all(c.isalnum() or c in "-_." for c in weird)
    assert claim_host(fresh(tmp_path), resume=False).run_id == derived_run_id(tmp_path / "run")
    assert claim_host(fresh(tmp_path, "run_id=mine"), resume=False).run_id == "mine"  # explicit: as given
    assert claim_host(fresh(tmp_path), resume=True).run_id == ""  # a resumed run keeps its file's


def test_a_resumed_run_can_move_to_a_new_free_port_and_its_actors_follow(tmp_path):
    first = claim_host(fresh(tmp_path), resume=False)
    first.run_path.mkdir(parents=True)
    (first.run_path / "config.toml").write_text(dump_toml(first))
    again = claim_host(load_config(first.run_path / "config.toml", []), resume=True)  # the recorded ports
    assert (again.serve.port, again.transport.endpoint) == (first.serve.port, first.transport.endpoint)
    assert again.run_id == first.run_id
    with listening() as held:  # ... now taken by another program: refused, and the line says what to do
        port = held.getsockname()[1]
        own = (f"http://127.0.0.1:{port}",)
        taken = dataclasses.replace(first, serve=dataclasses.replace(first.serve, port=port),
                                    actors=dataclasses.replace(first.actors, inference_urls=own))
        (first.run_path / "config.toml").write_text(dump_toml(taken))
        with pytest.raises(PortInUse, match="leave it unset for a free one"):
            claim_host(load_config(first.run_path / "config.toml", []), resume=True)
        moved = claim_host(load_config(first.run_path / "config.toml", ["serve.port=0"]), resume=True)
    assert moved.serve.port not in (0, port)
    assert moved.actors.inference_urls == (f"http://127.0.0.1:{moved.serve.port}",)


def test_ready_lines_count_only_after_the_offset_and_for_the_port(tmp_path):
    log = tmp_path / "serve.log"
    assert log_size(log) == 0 and not ready_line_seen(log, 0, 4321)
    log.write_text("arpo-serve ready on http://127.0.0.1:4321\n")  # an earlier start's line
    since = log_size(log)
    assert ready_line_seen(log, 0, 4321) and not ready_line_seen(log, since, 4321)
    with log.open("a") as f:
        f.write("arpo-serve ready on http://0.0.0.0:43210\n")
    assert not ready_line_seen(log, since, 4321) and ready_line_seen(log, since, 43210)


async def test_a_server_of_another_run_answering_health_on_our_port_is_never_taken_for_ours(tmp_path):
    """Another run's server answers /health 200 on the port our arpo-serve was given; ours has not bound it (it
    will fail to). b190f2c took that answer for its own server and started its learner and actors against it."""
    log = tmp_path / "serve.log"
    log.write_text("arpo-serve ready on http://127.0.0.1:1\n")  # older lines of the log: not this start's
    since = log_size(log)

    async def health(request):
        return web.Response(text="ok")

    ours = await asyncio.create_subprocess_exec(sys.executable, "-c", "import sys; sys.stdin.read()",
                                                stdin=asyncio.subprocess.PIPE)
    try:
        async with local_http_server({"/health": health}) as port:
            url = f"http://127.0.0.1:{port}"
            with log.open("a") as f:
                f.write(f"arpo-serve ready on http://127.0.0.1:{port + 1}\n")  # a line for another port
            with pytest.raises(RunError, match=r"did not answer http://127.0.0.1:\d+/health within 3 s"):
                async with asyncio.timeout(DEADLINE_S):
                    await wait_healthy(url, ours, log, timeout_s=3, ready_since=since)
            with log.open("a") as f:  # now our server says it bound that port: the same answer is ours
                f.write(f"arpo-serve ready on http://127.0.0.1:{port}\n")
            async with asyncio.timeout(DEADLINE_S):
                await wait_healthy(url, ours, log, ready_since=since)
    finally:
        ours.kill()
        await ours.wait()


def test_actors_refuse_an_endpoint_of_port_0_and_a_learner_binds_a_free_one(caplog):
    ctx = zmq.asyncio.Context()
    try:
        for port in ("0", "*"):
            config = load_config(None, [f"transport.endpoint=tcp://127.0.0.1:{port}"]).transport
            with pytest.raises(ValueError, match=r"transport.endpoint = 'tcp://127.0.0.1:[0*]': port 0 means a free "
                                                 "one for the learner"):
                dealer_socket(ctx, config, "a1")
    finally:
        ctx.destroy(linger=0)

    async def bind() -> str:
        with learner_socket(load_config(None, []).transport) as sock:
            return sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    with caplog.at_level("INFO", logger="arpo_async.transport"):
        bound = asyncio.run(bind())
    assert bound.startswith("tcp://127.0.0.1:") and not bound.endswith(":0")
    assert f"the learner listens on {bound}" in caplog.text


def test_two_runs_creating_the_shared_tiny_model_at_once_both_get_a_whole_one(tmp_path):
    """Two processes (as two fresh `arpo run`s under one runs/ folder) create runs/tiny-model at the same time."""
    model = tmp_path / "runs" / "tiny-model"
    code = ("import sys; from pathlib import Path; from arpo_cli.side_by_side import create_tiny_model_once; "
            "create_tiny_model_once(Path(sys.argv[1]))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(model)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert (model / "config.json").is_file() and (model / "model.safetensors").is_file()
    assert sorted(p.name for p in model.parent.iterdir()) == ["tiny-model"]  # no staging folder left
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("mine")
    with pytest.raises(OSError):
        create_tiny_model_once(junk)  # not a model: never replaced
    assert [p.name for p in junk.iterdir()] == ["notes.txt"] and len(list(tmp_path.iterdir())) == 2


def test_arpo_eval_refuses_a_busy_serve_port_before_starting_anything(tmp_path, tiny_model):
    out = tmp_path / "out"
    with listening() as held:
        port = held.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "arpo_cli.cli", "eval", "--model", str(tiny_model), "--tasks",
                               "grid4-green", "--out", str(out), "--set", f"serve.port={port}"],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"arpo eval: serve.port = {port} is in use on 127.0.0.1 (another run?); choose another or leave it unset "
        "for a free one")
    assert not (out / "logs").exists()  # no arpo-serve was started


def test_arpo_eval_of_a_runs_weights_gets_desktops_of_its_own(tmp_path):
    from argparse import Namespace

    from arpo_cli.eval_command import eval_config

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(dump_toml(claim_host(fresh(tmp_path), resume=False)))
    args = Namespace(config=None, overrides=[])
    assert eval_config(args, run / "config.toml", None).run_id == ""  # actors.eval makes eval-<random>
    assert eval_config(Namespace(config=None, overrides=["run_id=x"]), run / "config.toml", None).run_id == "x"
