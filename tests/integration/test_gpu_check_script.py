"""scripts/gpu_wheels.sh and scripts/gpu_check.sh as a GPU machine runs them, on the CPU.

The GPU machine's image is stood in for by a fresh virtual environment that holds only what such an image has:
PyTorch and transformers with their own dependencies (and triton, which PyTorch's CUDA builds bring), linked from
the test environment. Into it the check installs the wheels gpu_wheels.sh downloaded (for this Python) and runs
its CPU dry run end to end: so a dependency the project gains but the wheel list lacks fails here, not on a GPU
machine whose lease is running out.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from tests.support import free_port

ROOT = Path(__file__).resolve().parents[2]
IMAGE_PACKAGES = ("torch", "transformers", "triton")
"""What a GPU machine's image has, with their dependencies (PyTorch's CUDA builds require triton)."""


def closure(names: tuple[str, ...]) -> list[metadata.Distribution]:
    """The installed distributions ``names`` need, themselves included (markers evaluated, no extras)."""
    seen: dict[str, metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen[key] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def image_like_python(root: Path) -> Path:
    """A virtual environment of this Python holding only `IMAGE_PACKAGES` and their dependencies (symlinked from
    this environment's site-packages); returns its interpreter."""
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, capture_output=True, timeout=300)
    python = root / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    for dist in closure(IMAGE_PACKAGES):
        base = Path(dist.locate_file(""))
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            if not (site / top).exists() and (base / top).exists():
                (site / top).symlink_to(base / top)
    return python


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    return image_like_python(tmp_path_factory.mktemp("image") / "env")


def run(script: str, *args: str, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / script), *args], cwd=ROOT, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=timeout)


def test_the_image_stand_in_lacks_the_project_packages(image):
    probe = subprocess.run([str(image), "-c", "import torch, transformers; import aiohttp"], capture_output=True,
                           text=True, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert "No module named 'aiohttp'" in probe.stderr, probe.stderr


def test_without_the_wheels_the_check_names_what_is_missing(image, tmp_path):
    done = run("gpu_check.sh", "--dry-run", env={"PYTHON": str(image), "WHEELS": str(tmp_path / "none"),
                                                 "WORK": str(tmp_path / "work")}, timeout=120)
    assert done.returncode == 1
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("FAIL: missing Python packages: aiohttp zmq msgpack PIL xgrammar"), done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: run scripts/gpu_check.sh itself")
def test_wheels_then_dry_run_in_the_image_passes_with_every_figure(image, tmp_path):
    wheels = tmp_path / "wheels"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    fetched = run("gpu_wheels.sh", str(wheels), env={"GPU_PYTHON_VERSION": version, "PYTHON": sys.executable},
                  timeout=300)
    assert fetched.returncode == 0, fetched.stdout + fetched.stderr
    listed = re.findall(r"^\s+[\d.]+ MiB  (\S+\.whl)$", fetched.stdout, re.M)
    assert sorted(listed) == sorted(p.name for p in wheels.glob("*.whl")) and len(listed) >= 15
    assert re.search(r"\d+ wheels, [\d.]+ MiB in ", fetched.stdout)

    done = run("gpu_check.sh", "--dry-run", env={"PYTHON": str(image), "WHEELS": str(wheels),
                                                 "WORK": str(tmp_path / "work"), "PORT": str(free_port())})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert done.stdout.strip().splitlines()[-1] == "PASS"
    assert (tmp_path / "work" / "deps").is_dir()  # the project's packages came from the wheels, into the prefix
    steps = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3, out[-4000:]
    for n, line in enumerate(steps, 1):
        assert re.search(r"\|dlogp\| mean [\d.]+ max [\d.]+ nats; published v%d in [\d.]+ s, checksums agree on %d "
                         r"syncs; server weight_version %d$" % (n, n, n), line), line
    assert "trainer on cpu (FSDP2, one rank); weight group over gloo" in done.stdout
    figures = [line for line in done.stdout.splitlines() if line.startswith("params_b=")]
    assert len(figures) == 1, out[-4000:]
    values = dict(pair.split("=") for pair in figures[0].split())
    for key in ("step_tok_s", "peak_gb", "dist_s", "dist_gb_s", "disk_s", "disk_gb_s", "ratio"):
        assert float(values[key]) > 0, (key, figures[0])
