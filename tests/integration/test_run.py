"""The README's main job, end to end: `arpo run` with 8 real desktops and 3 optimizer steps.

While it runs, one desktop container is killed mid-episode; the job must go on (that trajectory is
ENV_ERROR and not trained on), finish with policy_version 3 in metrics.jsonl, leave arpo-serve reporting
the version the learner published, and leave no container behind.
"""

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from arpo_async.config import load_config
from arpo_async.metrics import REQUIRED_KEYS, read_metrics
from tests.support import processes_mentioning, until_sync

pytestmark = pytest.mark.docker


def run_containers(run: str | Path) -> list[str]:
    """Running containers labelled with the run id ``run``, or with the run id a run folder's config.toml records
    (`arpo run` derives <folder>-<hash> when run_id is unset; none before the run wrote its config.toml)."""
    if isinstance(run, Path):
        if not (run / "config.toml").is_file():
            return []
        run = load_config(run / "config.toml", []).resolved_run_id
    out = subprocess.run(["docker", "ps", "-q", "--filter", f"label=arpo.run={run}"],
                         capture_output=True, text=True, check=True).stdout
    return out.split()


def kill_one_desktop_mid_episode(run_dir, run_id, killed: list[str], stop: threading.Event,
                                 max_kills: int = 5) -> None:
    """Once trajectories are flowing, kill a running desktop container of the run mid-episode.

    A container can be caught between two episodes (its episode just ended, its app not yet reset away): that
    kill costs no trajectory, so no ENV_ERROR follows. Then another desktop is killed, up to ``max_kills``,
    until status.json counts an ENV_ERROR.
    """
    status = run_dir / "status.json"
    while not stop.is_set() and len(killed) < max_kills:
        try:
            current = json.loads(status.read_text())
        except (OSError, ValueError):
            current = {}
        if current.get("outcomes", {}).get("ENV_ERROR", 0) >= 1:
            return
        flowing = current.get("trajectories", 0) >= 2
        for container in run_containers(run_id) if flowing else []:
            if container not in killed and in_episode(container):
                subprocess.run(["docker", "kill", container], capture_output=True)
                killed.append(container)
                stop.wait(3.0)  # status.json is rewritten every second; give the episode time to report
                break
        stop.wait(0.2)


def in_episode(container: str) -> bool:
    """True when the desktop runs a task's app (its setup has run: an episode is in progress)."""
    top = subprocess.run(["docker", "top", container], capture_output=True, text=True).stdout
    return "/opt/arpo/apps/" in top or "xterm" in top


def test_arpo_run_embedded_default(tmp_path, desktop_image, tiny_model):
    run_dir = tmp_path / "demo"
    killed: list[str] = []
    stop = threading.Event()
    killer = threading.Thread(target=kill_one_desktop_mid_episode, args=(run_dir, run_dir, killed, stop))
    killer.start()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "arpo_cli.cli", "run", "--out", str(run_dir), "--model", str(tiny_model),
             "--set", "serve.port=31777", "--set", 'actors.inference_urls=["http://127.0.0.1:31777"]',
             "--set", "transport.endpoint=tcp://127.0.0.1:31778"],
            capture_output=True, text=True, timeout=1500)
    finally:
        stop.set()
        killer.join()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[-1]["policy_version"] == 3
    assert all(set(REQUIRED_KEYS) <= set(r) for r in records)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["server_weight_version"] == "3"  # arpo-serve loaded what the learner published
    assert (summary["steps"], summary["policy_version"], summary["exit_code"]) == (3, 3, 0)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["from_desktop"] == status["trajectories"] > 0  # every trajectory ran in a container
    assert killed, "the test never found a desktop to kill"
    assert status["outcomes"].get("ENV_ERROR", 0) >= 1
    env_errors = [line for line in (run_dir / "logs" / "actors.log").read_text().splitlines() if "ENV_ERROR" in line]
    assert any("DesktopError" in line for line in env_errors), env_errors
    assert run_containers(run_dir) == [] and load_config(run_dir / "config.toml", []).run_id.startswith("demo-")
    assert (run_dir / "config.toml").exists() and (run_dir / "weights" / "v3" / "model.safetensors").exists()
    # learner.keep_weights = 2 (the default) keeps v2 and v3, and v0: the weights the run started from (issue 49)
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == ["v0", "v2", "v3"]
    evaluated = subprocess.run(
        [sys.executable, "-m", "arpo_cli.cli", "eval", "--model", str(run_dir / "weights" / "v0"), "--tasks",
         "grid4-red", "--desktops", "1", "--max-steps", "1", "--out", str(tmp_path / "eval-v0")],
        capture_output=True, text=True, timeout=600)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    report = json.loads((tmp_path / "eval-v0" / "report.json").read_text())
    assert report["policy"]["weight_version"] == 0 and report["overall"]["episodes"] == 1


def test_a_run_that_cannot_learn_says_why_and_fails_after_the_stall_timeout(tmp_path, desktop_image, tiny_model):
    """Every group of an unsolvable task has zero reward variance: no optimizer step can happen. The progress
    line and the learner's log say why, and with learner.stall_timeout_s set `arpo run` exits non-zero."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    source = sorted((Path(__file__).resolve().parents[1] / "data" / "tasks" / "shapes").glob("*.json"))[0]
    task = json.loads(source.read_text())
    task["id"] = "shapes-impossible"
    task["evaluator"]["expected"]["rules"]["expected"] = "No Such Label"
    (tasks / "impossible.json").write_text(json.dumps(task))
    run_dir = tmp_path / "stalled"
    proc = subprocess.run(
        [sys.executable, "-m", "arpo_cli.cli", "run", "--out", str(run_dir), "--model", str(tiny_model),
         "--set", "serve.port=31787", "--set", 'actors.inference_urls=["http://127.0.0.1:31787"]',
         "--set", "transport.endpoint=tcp://127.0.0.1:31788", "--set", f'learner.tasks="{tasks}"',
         "--set", 'actors.grammar_actions=["click"]', "--set", "actors.max_steps=1",
         "--set", "learner.stall_warning_s=5", "--set", "learner.stall_timeout_s=25", "--set", "learner.steps=5"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "STALLED: no optimizer step" in proc.stdout, proc.stdout[-3000:]
    log = (run_dir / "logs" / "learner.log").read_text()
    assert "0 successes in" in log and "Consider a task pre-pass" in log
    assert "StalledRun" in log and "learner.stall_timeout_s = 25 s" in log
    assert not read_metrics(run_dir / "metrics.jsonl")  # not a single optimizer step
    assert run_containers(run_dir) == []



def test_ctrl_c_twice_still_stops_every_child_and_container(tmp_path, desktop_image, tiny_model):
    """A second SIGINT while the first one's cleanup runs (an impatient Ctrl-C) must not cut it short and leave
    arpo-serve, the learner or a desktop behind."""
    run_dir = tmp_path / "twice"
    proc = subprocess.Popen(
        [sys.executable, "-m", "arpo_cli.cli", "run", "--out", str(run_dir), "--model", str(tiny_model),
         "--steps", "50", "--actors", "2", "--set", "serve.port=31787",
         "--set", 'actors.inference_urls=["http://127.0.0.1:31787"]', "--set", "transport.endpoint=tcp://127.0.0.1:31788"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    def running() -> None:
        assert proc.poll() is None, proc.stdout.read()[-3000:]

    try:  # serve, learner and actors are up once desktops exist
        until_sync(lambda: run_containers(run_dir), 300, "the run's desktops", check=running)
        actors = [pid for pid in processes_mentioning(str(run_dir)) if pid in processes_mentioning("actors.main")]
        assert actors and len(processes_mentioning(str(run_dir))) >= 3
        proc.send_signal(signal.SIGINT)
        until_sync(lambda: not any(Path(f"/proc/{pid}").exists() for pid in actors), 120,
                   "arpo-actors to exit (the cleanup has begun: actors first)", every_s=0.05)
        proc.send_signal(signal.SIGINT)  # while it stops the learner and arpo-serve
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out[-3000:]
    assert "done in" in out, out[-3000:]  # the cleanup ran to its end
    assert processes_mentioning(str(run_dir)) == []
    assert run_containers(run_dir) == []
