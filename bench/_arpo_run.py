"""Shared by the end-to-end benchmarks: run one real `arpo run` for a time budget and read its figures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
PORTS = ['serve.port=31960', 'actors.inference_urls=["http://127.0.0.1:31960"]',
         'transport.endpoint=tcp://127.0.0.1:31961']
"""Fixed loopback ports for benchmark runs (runs are sequential)."""


def run_arpo(run_dir: Path, model: Path, overrides: list[str], minutes: float,
             stop_early: Callable[[Path], bool] = lambda run_dir: False) -> int:
    """Run `arpo run` into ``run_dir`` until it exits, ``minutes`` pass, or ``stop_early(run_dir)`` is true.

    The run is stopped with SIGTERM (arpo run then stops its children and removes its desktops).
    Output goes to ``<run_dir>.out``. Returns arpo run's exit code.
    """
    args = [sys.executable, "-m", "arpo_cli.cli", "run", "--out", str(run_dir), "--model", str(model)]
    for item in PORTS + overrides:
        args += ["--set", item]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with run_dir.with_suffix(".out").open("w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        deadline = time.monotonic() + minutes * 60
        try:
            while proc.poll() is None and time.monotonic() < deadline and not stop_early(run_dir):
                time.sleep(2)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(180)
    return proc.returncode


def ensure_model(model: Path, *, init_std: float | None = None) -> Path:
    """Create the tiny random policy at ``model`` if it is not there (``init_std``: its weights' spread, default
    `DEFAULT_INIT_STD`). An existing folder is used as it is; the new one is built under ``<model>.partial`` and
    renamed when complete, so an interrupted creation is redone rather than used."""
    if not (model / "config.json").exists():
        from arpo_async.model.init_model import DEFAULT_INIT_STD, create_tiny_model
        partial = model.with_name(model.name + ".partial")
        create_tiny_model(partial, overwrite=True, init_std=DEFAULT_INIT_STD if init_std is None else init_std)
        if model.exists():
            model.rmdir()  # only an empty folder gets here (config.json is missing); anything else raises
        partial.rename(model)
    return model
