"""scripts/gpu_requirements.txt (the wheels a GPU machine gets) keeps pyproject.toml's bounds."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def requirements(lines: list[str]) -> dict[str, Requirement]:
    reqs = [Requirement(line) for line in lines if line.strip() and not line.lstrip().startswith("#")]
    return {r.name.lower(): r for r in reqs}


def test_gpu_wheels_keep_the_project_bounds():
    gpu = requirements((ROOT / "scripts" / "gpu_requirements.txt").read_text().splitlines())
    project = requirements(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])
    shared = set(gpu) & set(project)
    assert {"aiohttp", "pyzmq", "msgpack", "pillow", "xgrammar", "tenacity", "tomli-w", "pydantic"} <= shared
    for name in shared:
        assert gpu[name].specifier == project[name].specifier, name
    assert not {"torch", "transformers", "matplotlib", "tensorboard"} & set(gpu)  # the image has them / not needed
