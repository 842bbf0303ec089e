"""`arpo eval` when it is stopped or its policy fails, with real processes and desktops: SIGTERM (what `timeout` and
schedulers send) stops it as Ctrl-C does (report written, no desktop or arpo-serve left, exit 130); a run whose
every episode errored because the inference server is down exits 3; an OpenAI-compatible endpoint that accepts
requests and never answers ends each episode at ``actors.policy_timeout_s`` as an errored (ABORTED) episode.
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
from pathlib import Path

import pytest
from aiohttp import web

from arpo_cli.cli import main as arpo_main
from tests.support import catch_all_http_server, free_port, processes_mentioning, until_sync

pytestmark = pytest.mark.docker

ROOT = Path(__file__).parents[2]


def run_containers(run_id: str) -> list[str]:
    """Ids of every container (running or not) labelled ``arpo.run=<run_id>``, as the fleet labels them."""
    out = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=arpo.run={run_id}"],
                         capture_output=True, text=True, check=True).stdout
    return out.split()



def test_sigterm_writes_the_report_and_leaves_no_desktop_or_server(tiny_model, desktop_image, tmp_path):
    """SIGTERM once episodes have finished and desktops run: exit 130 with the report of what finished, no
    container of the run and no arpo-serve left. On b190f2c SIGTERM killed the command at once (exit -15): no
    report, the desktops and arpo-serve orphaned."""
    out, run_id = tmp_path / "out", f"sigterm-{secrets.token_hex(3)}"
    log = tmp_path / "eval.log"
    args = [sys.executable, "-m", "arpo_cli", "eval", "--model", str(tiny_model), "--tasks", "grid4",
            "--repeats", "12", "--desktops", "2", "--max-steps", "1", "--temperature", "1", "--out", str(out),
            "--set", f"actors.image={desktop_image!r}", "--set", f"run_id={run_id!r}"]
    with log.open("wb") as sink:
        proc = subprocess.Popen(args, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)

    def running() -> None:
        if proc.poll() is not None:
            raise AssertionError(f"arpo eval exited with {proc.returncode} before SIGTERM:\n"
                                 f"{log.read_text(errors='replace')[-3000:]}")

    try:
        until_sync(lambda: len(list(out.glob("*/*/*/episode.json"))) >= 2 and run_containers(run_id), 300,
                   "two finished episodes and the run's desktops", check=running)
        serve_port = re.search(r"arpo-serve ready at http://127\.0\.0\.1:(\d+)", log.read_text())[1]
        proc.send_signal(signal.SIGTERM)  # to the command only, as `timeout` sends it
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output = log.read_text(errors="replace")
    assert proc.returncode == 130, output[-3000:]
    assert "interrupted" in output
    report = json.loads((out / "report.json").read_text())
    assert 2 <= report["finished"] < report["planned"] and not report["complete"]
    assert report["overall"]["score_total"] == report["planned"]  # the unfinished episodes score 0
    assert "INCOMPLETE" in (out / "report.md").read_text()
    assert run_containers(run_id) == []
    assert processes_mentioning("arpo_serve.main", f"--port {serve_port}") == []


def test_every_episode_errored_against_a_server_that_is_down_exits_3(tiny_model, desktop_image, tmp_path,
                                                                      capsys):
    """--url at a port nothing listens on: every episode ends ABORTED (PolicyUnavailable); the report lists them
    and the command exits 3, not 0 as on b190f2c. (A run where only some episodes errored exits 0:
    test_eval.py::test_command_counts_failed_setup_and_unloadable_tasks_and_view_shows_them.)"""
    out = tmp_path / "out"
    code = arpo_main(["eval", "--url", f"http://127.0.0.1:{free_port()}", "--tokenizer", str(tiny_model),
                      "--tasks", "grid4-green", "--repeats", "2", "--desktops", "1", "--max-steps", "1",
                      "--out", str(out), "--set", f"actors.image={desktop_image!r}",
                      "--set", "actors.policy_attempts=2", "--set", "actors.policy_max_wait_s=0.1"])
    captured = capsys.readouterr()
    err = captured.err
    assert code == 3, err[-3000:]
    assert "every one of the 2 episodes errored" in err and "exit status 3" in err
    report = json.loads((out / "report.json").read_text())
    assert report["finished"] == report["planned"] == 2 and report["overall"]["successes"] == 0
    assert [e["outcome"] for e in report["errors"]] == ["ABORTED", "ABORTED"]
    # the policy server's fault, not the harness's: the agent's episodes failed, scored 0 over the 2 planned
    assert [e["cause"] for e in report["errors"]] == ["agent", "agent"]
    overall = report["overall"]
    assert (overall["agent_errors"], overall["harness_errors"], overall["score_mean"]) == (2, 0, 0.0)
    assert overall["ran_mean"] is None and "score 0/2 (0.0%)" in captured.out
    assert "the harness could not run it: 0 / the agent's episode failed: 2" in captured.out
    assert all("PolicyUnavailable" in e["error"] for e in report["errors"])


async def test_a_never_answering_endpoint_ends_each_episode_at_the_policy_deadline(tiny_model, desktop_image,
                                                                                   tmp_path):
    """An OpenAI-compatible server that accepts every request and never answers: with actors.policy_timeout_s = 3
    each episode ends ABORTED with PolicyTimeout after one request (no retry of a call past its deadline), and the
    command exits 3. On b190f2c the key did not exist and each step waited up to 6 x 600 s."""
    requests: list[str] = []
    release = asyncio.Event()

    async def never_answers(request: web.Request) -> web.Response:
        requests.append(request.path)
        await release.wait()  # holds the request open until the test ends (then the server can stop at once)
        return web.Response(status=503)

    out = tmp_path / "out"
    async with catch_all_http_server(never_answers) as url:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "arpo_cli", "eval", "--openai-url", f"{url}/v1", "--openai-model", "m",
            "--tokenizer", str(tiny_model), "--tasks", "grid4-green", "--repeats", "2", "--desktops", "1",
            "--max-steps", "3", "--out", str(out), "--set", f"actors.image={desktop_image!r}",
            "--set", "actors.policy_timeout_s=3", cwd=ROOT, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT)
        try:  # a deadline for the whole command far below one request's 600 s timeout
            output = (await asyncio.wait_for(proc.communicate(), 400))[0].decode(errors="replace")
        finally:
            release.set()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert proc.returncode == 3, output[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["finished"] == 2 and [e["outcome"] for e in report["errors"]] == ["ABORTED", "ABORTED"]
    for error in report["errors"]:
        assert error["error"].startswith("ABORTED: PolicyTimeout: no reply from OpenAIChatPolicy at "
                                         f"{url}/v1/chat/completions"), error
        assert "actors.policy_timeout_s = 3 s" in error["error"]
    assert requests == ["/v1/chat/completions"] * 2  # one call per episode, cut at its deadline, not retried
