"""bench/'s own unit tests (bench/test_*.py: the GPU timing model of bench_gpu_model and its modelled servers, with
hand-computed numbers), run by a child pytest from the repository root: the suite covers them, and no test under
tests/ imports bench/ (tests/unit/test_import_arrows.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def test_bench_own_unit_tests_pass():
    files = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "bench").glob("test_*.py"))
    assert files, "bench/ has no test_*.py"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, summary
