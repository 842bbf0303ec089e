"""arpo run's watch over its children (arpo_cli.launcher.check_children), with real child processes, and its
progress line (from a real metrics.jsonl)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from arpo_cli import launcher
from arpo_async.config import load_config
from arpo_cli.launcher import RunError, check_children, progress_line
from arpo_async.metrics import MetricsWriter


def child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def exited(status: int) -> subprocess.Popen:
    proc = child(f"raise SystemExit({status})")
    proc.wait(30)
    return proc


@pytest.fixture
def logs(tmp_path: Path) -> Path:
    for name in ("serve", "actors"):
        (tmp_path / f"{name}.log").write_text(f"last line of {name}\n")
    return tmp_path


@pytest.fixture
def running():
    procs: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        procs.append(child("import time; time.sleep(60)"))
        return procs[-1]

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_all_running_is_fine(logs, running):
    children = [running(), running(), running()]
    assert check_children(*children, logs) is None  # no RunError
    assert all(child.poll() is None for child in children)  # and nobody was waited for or stopped


def test_dead_server_is_an_error_naming_its_log(logs, running):
    with pytest.raises(RunError, match=r"arpo-serve exited with 1; see .*serve.log:\nlast line of serve"):
        check_children(running(), running(), exited(1), logs)


def test_failed_actors_are_an_error_naming_their_log(logs, running):
    with pytest.raises(RunError, match=r"arpo-actors exited with 3; see .*actors.log:\nlast line of actors"):
        check_children(running(), exited(3), running(), logs)


def test_actors_done_waits_for_the_learner_to_finish(logs, running):
    learner = child("import time; time.sleep(0.5)")  # still finishing after it said shutdown
    check_children(learner, exited(0), running(), logs)
    assert learner.returncode == 0


def test_actors_done_but_learner_never_finishes_is_an_error(logs, running, monkeypatch):
    monkeypatch.setattr(launcher, "LEARNER_EXIT_GRACE_S", 0.2)
    with pytest.raises(RunError, match=r"arpo-actors exited with 0 and arpo-learner did not finish within 0.2 s"):
        check_children(running(), exited(0), running(), logs)


def write_steps(run: Path, success_rates: list[float]) -> None:
    metrics = MetricsWriter(run / "metrics.jsonl")
    for step, success in enumerate(success_rates, start=1):
        metrics.write({"step": step, "policy_version": step, "trajectories": 4, "success_rate": success,
                       "reward_mean": 0.0, "loss": 0.5, "replay_injections": 0, "staleness_mean": 0.0,
                       "wall_s": float(step)})
    metrics.close()


def test_progress_line_shows_the_trailing_success_rate(tmp_path):
    config = load_config(None, [f'run_dir="{tmp_path}"', "learner.steps=20"])
    write_steps(tmp_path, [1.0] * 2 + [0.5] * 5 + [0.25] * 5)  # the last 10: 5 x 0.5 and 5 x 0.25
    line = progress_line(config, started=0.0)
    assert "step 12/20" in line and "success 0.25 (last 10 steps 0.38) loss 0.5000" in line
    assert "\n" not in line


def test_progress_line_before_the_first_step(tmp_path):
    config = load_config(None, [f'run_dir="{tmp_path}"'])
    assert "success nan (last 10 steps nan)" in progress_line(config, started=0.0)


def test_draw_curve_warns_and_never_raises(tmp_path, caplog):
    assert launcher.draw_curve(tmp_path, quiet_if_empty=True) is None and caplog.text == ""  # early in a run
    assert launcher.draw_curve(tmp_path) is None and "no learning curve: no metrics.jsonl in" in caplog.text
    run = tmp_path / "run"
    write_steps(run, [0.5])
    (run / "curve.png" / "blocked").mkdir(parents=True)  # the picture cannot be written: a warning, no exception
    assert launcher.draw_curve(run) is None and f"could not draw {run / 'curve.png'}" in caplog.text
    assert sorted(p.name for p in run.iterdir()) == ["curve.png", "metrics.jsonl"]  # no temp file left
    (run / "curve.png" / "blocked").rmdir()
    (run / "curve.png").rmdir()
    assert launcher.draw_curve(run) == run / "curve.png"


def test_summary_counts_optimizer_steps_not_records(tmp_path):
    """With 2 optimizer steps per batch, metrics.jsonl holds one record per batch; summary.json's steps counts
    optimizer steps (the last record's step), as learner.steps does."""
    config = load_config(None, [f'run_dir="{tmp_path}"', "learner.updates_per_batch=2"])
    metrics = MetricsWriter(tmp_path / "metrics.jsonl")
    for batch in (1, 2, 3):
        metrics.write({"step": 2 * batch, "policy_version": batch, "trajectories": 4, "success_rate": 0.5,
                       "reward_mean": 0.0, "loss": 0.5, "replay_injections": 0, "staleness_mean": 0.0,
                       "wall_s": float(batch)})
    metrics.close()
    summary = launcher.write_summary(config, 0, "http://127.0.0.1:9", wall_s=1.0)
    assert (summary["steps"], summary["policy_version"], summary["server_weight_version"]) == (6, 3, None)
    (tmp_path / "empty").mkdir()  # a run that failed before its first batch
    assert launcher.write_summary(load_config(None, [f'run_dir="{tmp_path / "empty"}"']), 1, "http://127.0.0.1:9",
                                  wall_s=0.0)["steps"] == 0
