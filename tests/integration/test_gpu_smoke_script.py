"""scripts/gpu_smoke.sh: its CPU dry run (arpo-serve in SGLang's place, learner on the CPU, gloo) passes end to end,
and without a GPU the real mode fails at once with a reason rather than hanging."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support import free_port

ROOT = Path(__file__).resolve().parents[2]


def run_script(*args: str, work: Path) -> subprocess.CompletedProcess:
    # PYTHON: the script runs its steps with the interpreter running the tests (the one with the project installed)
    env = {**os.environ, "PORT": str(free_port()), "WORK": str(work), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_smoke.sh"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=540)


def test_dry_run_passes_three_verified_steps(tmp_path):
    done = run_script("--dry-run", work=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    steps = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3, out[-3000:]
    assert "checksums agree on 3 syncs; server weight_version 3" in steps[-1]
    assert done.stdout.strip().splitlines()[-1] == "PASS"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the real mode would run")
def test_without_a_gpu_the_real_mode_fails_with_a_reason(tmp_path):
    done = run_script(work=tmp_path)
    assert done.returncode == 1
    assert "FAIL: no CUDA device" in done.stdout
