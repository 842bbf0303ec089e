"""arpo_async.process.run_until_signal with real signals: the first SIGTERM cancels the process's coroutine, and a
second one (Linux sends the parent-death signal again when a subreaper dies too) does not cut its cleanup short."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from tests.support import until_sync

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import asyncio, sys
from pathlib import Path
from arpo_async.process import run_until_signal, setup_logging

async def main():
    try:
        Path(sys.argv[1], "started").touch()
        await asyncio.sleep(60)
    finally:
        Path(sys.argv[1], "cleaning").touch()
        await asyncio.sleep(1.0)  # the cleanup, e.g. removing containers
        Path(sys.argv[1], "cleaned").touch()

setup_logging()
sys.exit(run_until_signal(main(), "child"))
"""


def test_a_second_sigterm_does_not_cut_the_cleanup_short(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        until_sync(lambda: (tmp_path / "started").exists(), 60, "the child's start")
        proc.send_signal(signal.SIGTERM)
        until_sync(lambda: (tmp_path / "cleaning").exists(), 30, "the cleanup's start")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert (tmp_path / "cleaned").exists(), err
    assert "during cleanup: finishing the cleanup first" in err
