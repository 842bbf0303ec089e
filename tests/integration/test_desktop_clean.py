"""`arpo desktop clean` removes only what it is told to (issue 49 item 5): without --run-id or --all it removes
nothing (before, it removed every arpo desktop on the host, other users' runs included); with --run-id, that run's
containers only. A real container labelled as an arpo desktop of a run of this test's own stands for a run's
desktop. (--all is never run here: it would remove the desktops of every test running beside this one.)"""
from __future__ import annotations

import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from actors.desktop.fleet import ROLE, ROLE_LABEL, RUN_LABEL

pytestmark = pytest.mark.docker
ROOT = Path(__file__).resolve().parents[2]


def containers(run_id: str) -> list[str]:
    return subprocess.run(["docker", "ps", "-aq", "--filter", f"label={RUN_LABEL}={run_id}"], capture_output=True,
                          text=True, check=True).stdout.split()


def test_clean_without_run_id_or_all_removes_nothing_and_run_id_removes_only_that_run(desktop_image):
    mine, other = f"clean-test-{secrets.token_hex(4)}", f"clean-other-{secrets.token_hex(4)}"
    started = []
    try:
        for run_id in (mine, other):
            started.append(subprocess.run(
                ["docker", "run", "-d", "--label", f"{ROLE_LABEL}={ROLE}", "--label", f"{RUN_LABEL}={run_id}",
                 "--entrypoint", "sleep", desktop_image, "600"], capture_output=True, text=True, check=True
            ).stdout.strip())
        refused = subprocess.run([sys.executable, "-m", "arpo_cli.cli", "desktop", "clean"], cwd=ROOT,
                                 capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2 and "nothing removed" in refused.stderr and refused.stdout == ""
        assert len(containers(mine)) == 1 and len(containers(other)) == 1  # both still there

        done = subprocess.run([sys.executable, "-m", "arpo_cli.cli", "desktop", "clean", "--run-id", mine],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert done.stdout == "removed 1 container(s)\n"
        assert containers(mine) == [] and len(containers(other)) == 1  # the other run's desktop is left alone
    finally:
        subprocess.run(["docker", "rm", "-f", *started], capture_output=True)
