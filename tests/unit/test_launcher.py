"""arpo run's watch over its children (arpo_async.launcher.check_children), with real child processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from arpo_async import launcher
from arpo_async.launcher import RunError, check_children


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
    check_children(running(), running(), running(), logs)


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
