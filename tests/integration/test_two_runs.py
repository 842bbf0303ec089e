"""Two `arpo run`s on one host at once, every port left unset, in two folders of one name (``a/twin``, ``b/twin``):
each picks its own free ports and run id, and each learner sees only its own server and its own actors. The real
arpo-serve, learner, actors, ZeroMQ and desktops; one optimizer step each, on 2 desktops, to keep it cheap.

On b190f2c both runs listened on 30000 and 5555: the second's arpo-serve and learner could not bind, its launcher
took the first run's server for its own, and both labelled their desktops ``twin`` (each run's cleanup removed the
other's desktops). Also: arpo-serve started by hand with port 0 binds a free one and names it in its ready line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import urllib.request

import pytest

from arpo_async.config import load_config
from arpo_async.metrics import read_metrics
from tests.integration.test_run import run_containers
from tests.support import read_until, stop_process

CHEAP = ["--steps", "1", "--actors", "2", "--set", 'learner.task_ids=["grid4-green"]', "--set", "learner.group_size=2",
         "--set", "learner.groups_per_step=1", "--set", "learner.updates_per_batch=1",
         "--set", 'actors.grammar_actions=["click"]', "--set", "actors.max_steps=1",
         "--set", "actors.max_thought_chars=1", "--set", "actors.warm_spares=0"]
"""One optimizer step from one group of 2 one-click episodes on grid4-green (the random policy solves it 1 time in
4 or so, so a group with a reward difference comes within a few groups)."""


@pytest.mark.docker
def test_two_runs_at_once_each_see_only_their_own_server_and_actors(tmp_path, desktop_image, tiny_model):
    runs = [tmp_path / "a" / "twin", tmp_path / "b" / "twin"]
    seen: dict[str, set[str]] = {str(r): set() for r in runs}  # containers seen labelled with each run's id
    done = threading.Event()

    def watch() -> None:  # while both run: which containers carry each run's label
        while not done.is_set():
            for r in runs:
                seen[str(r)].update(run_containers(r))
            done.wait(1.0)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        procs = [subprocess.Popen([sys.executable, "-m", "arpo_cli.cli", "run", "--out", str(r), "--model",
                                   str(tiny_model), *CHEAP], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for r in runs]
        outputs = [p.communicate(timeout=1200)[0] for p in procs]
    finally:
        done.set()
        watcher.join()
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]

    configs = [load_config(r / "config.toml", []) for r in runs]
    serve_ports = {c.serve.port for c in configs}
    endpoints = {c.transport.endpoint for c in configs}
    run_ids = {c.run_id for c in configs}
    assert len(serve_ports) == len(endpoints) == len(run_ids) == 2 and 0 not in serve_ports
    assert all(i.startswith("twin-") for i in run_ids)
    for run, config, out in zip(runs, configs, outputs):
        own_url = f"http://127.0.0.1:{config.serve.port}"
        assert config.actors.inference_urls == (own_url,)  # the learner publishes to, the actors ask, these alone
        assert f"arpo-serve ready at {own_url}; the learner listens on {config.transport.endpoint}; run id " \
               f"{config.run_id}" in out
        logs = run / "logs"
        # its arpo-serve bound its own port (the ready line of this run's server process)
        assert f"arpo-serve ready on http://127.0.0.1:{config.serve.port}" in (logs / "serve.log").read_text()
        learner_log = (logs / "learner.log").read_text()
        assert re.search(rf"learner \S+ on {re.escape(config.transport.endpoint)} ", learner_log), learner_log[-2000:]
        assert "belongs to run" not in learner_log  # no actor of the other run ever reached this learner
        assert f"-> learner {config.transport.endpoint}, inference {own_url}" in (logs / "actors.log").read_text()
        status = json.loads((run / "status.json").read_text())
        assert status["actors"] == 1 and status["from_desktop"] == status["trajectories"] > 0
        records = read_metrics(run / "metrics.jsonl")
        summary = json.loads((run / "summary.json").read_text())
        # the server this run's launcher asked (its own URL) holds what this run's learner published
        assert summary["server_weight_version"] == str(records[-1]["policy_version"]) != "0"
        assert run_containers(run) == []
    assert all(seen.values()) and not (seen[str(runs[0])] & seen[str(runs[1])])  # each its own desktops


def test_arpo_serve_with_port_0_binds_a_free_port_and_names_it(tiny_model):
    proc = subprocess.Popen([sys.executable, "-m", "arpo_serve.main", "--model", str(tiny_model), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        ok, out = read_until(proc, b"arpo-serve ready on", 180)
        assert ok, out.decode(errors="replace")[-3000:]
        if not re.search(rb"arpo-serve ready on \S+\n", out):  # the rest of the line
            out += read_until(proc, b"\n", 30)[1]
        port = int(re.search(r"arpo-serve ready on http://127\.0\.0\.1:(\d+)\n", out.decode())[1])
        assert port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as reply:
            assert reply.status == 200
    finally:
        stop_process(proc, 30)
