"""The real arpo-serve started with only a run file (`--config`), as `arpo run` starts it: the model and the
[serve] section come from the file, a flag wins over it, and the file's API key guards the routes."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from arpo_cli.launcher import spawn, stop, wait_healthy
from tests.support import free_port


def get(url: str, key: str = "") -> tuple[int, dict]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, {}


@pytest.fixture
def run_file(tmp_path, tiny_model) -> tuple[Path, int]:
    port = free_port()
    path = tmp_path / "run.toml"
    path.write_text(f'model = "{tiny_model}"\n[serve]\nport = {port}\napi_key = "file-key"\nmax_batch = 2\n')
    return path, port


async def test_serve_takes_model_port_and_key_from_the_run_file(run_file, tiny_model, tmp_path, monkeypatch):
    monkeypatch.delenv("ARPO_API_KEY", raising=False)
    path, port = run_file
    log = tmp_path / "serve.log"
    proc = await spawn([sys.executable, "-m", "arpo_serve.main", "--config", str(path), "--weight-version", "7"], log)
    try:
        await wait_healthy(f"http://127.0.0.1:{port}", proc, log, timeout_s=120)
        assert get(f"http://127.0.0.1:{port}/get_model_info")[0] == 401  # serve.api_key from the file
        status, info = get(f"http://127.0.0.1:{port}/get_model_info", "file-key")
        assert status == 200 and info["weight_version"] == "7" and Path(info["model_path"]) == Path(tiny_model)
    finally:
        await stop(proc, grace_s=10)


async def test_a_flag_wins_over_the_run_file(run_file, tmp_path, monkeypatch):
    monkeypatch.delenv("ARPO_API_KEY", raising=False)
    path, _ = run_file
    port = free_port()
    log = tmp_path / "serve.log"
    proc = await spawn([sys.executable, "-m", "arpo_serve.main", "--config", str(path), "--port", str(port),
                        "--api-key", "flag-key"], log)
    try:
        await wait_healthy(f"http://127.0.0.1:{port}", proc, log, timeout_s=120)
        assert get(f"http://127.0.0.1:{port}/get_model_info", "file-key")[0] == 401
        assert get(f"http://127.0.0.1:{port}/get_model_info", "flag-key")[0] == 200
    finally:
        await stop(proc, grace_s=10)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
async def test_device_cuda_without_cuda_fails_at_start_with_a_reason(tiny_model, tmp_path):
    log = tmp_path / "serve.log"
    proc = await spawn([sys.executable, "-m", "arpo_serve.main", "--model", str(tiny_model), "--port",
                        str(free_port()), "--device", "cuda"], log)
    try:
        assert await proc.wait() == 1
        assert 'device "cuda" but torch sees no CUDA device' in log.read_text()
    finally:
        await stop(proc, grace_s=10)


async def test_server_info_reports_the_device(tiny_model, tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    proc = await spawn([sys.executable, "-m", "arpo_serve.main", "--model", str(tiny_model), "--port", str(port),
                        "--device", "cpu", "--dtype", "bfloat16"], log)
    try:
        await wait_healthy(f"http://127.0.0.1:{port}", proc, log, timeout_s=120)
        status, info = get(f"http://127.0.0.1:{port}/get_server_info")
        assert status == 200 and (info["device"], info["dtype"]) == ("cpu", "bfloat16")
    finally:
        await stop(proc, grace_s=10)
