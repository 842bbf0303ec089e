"""Shared pytest fixtures. Keep small: only fixtures several test modules need."""
from __future__ import annotations

import secrets

import pytest


@pytest.fixture(scope="session")
def desktop_image() -> str:
    """Tag of the arpo desktop image, built first if missing (debootstrap, about 80 s).

    Fails (never skips) with the builder's message when Docker is missing or its engine is not running.
    """
    from actors.desktop.build import DesktopBuildError, build_image

    try:
        return build_image(log=lambda line: print(f"[desktop build] {line}", flush=True))
    except DesktopBuildError as exc:
        pytest.fail(f"cannot provide the desktop image: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def osworld_image() -> str:
    """Tag of the arpo-desktop-osworld image (OSWorld's apps and session), built first if missing: the apps
    layer takes minutes and ~2 GB, so only tests that request this fixture (mark them ``osworld_image``) pay
    for it; CI builds it then and not in scripts/bootstrap.sh. Fails (never skips) like ``desktop_image``."""
    from actors.desktop.build import DesktopBuildError, build_image

    try:
        return build_image(profile="osworld", log=lambda line: print(f"[osworld build] {line}", flush=True))
    except DesktopBuildError as exc:
        pytest.fail(f"cannot provide the osworld desktop image: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny random Qwen2.5-VL policy folder, created once per test session."""
    from arpo_async.model.init_model import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def tiny_serve(tiny_model, tmp_path_factory):
    """A real ``arpo-serve`` on ``tiny_model`` (tests.support.ServeProcess), started once for each test module that
    asks for it and stopped after the module's last test."""
    from tests.support import ServeProcess, free_port

    server = ServeProcess(tiny_model, free_port(), tmp_path_factory.mktemp("serve-logs"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def fleet(desktop_image):
    """A DesktopFleet with a fresh run id; every container it started is removed afterwards."""
    from actors.desktop.fleet import DesktopFleet

    f = DesktopFleet(desktop_image, run_id=f"test-{secrets.token_hex(3)}")
    try:
        yield f
    finally:
        await f.remove_all()
        await f.close()


OSWORLD_MEMORY_MB = 2048
"""Memory of an osworld-image desktop in tests: enough for LibreOffice or chromium (actors.desktop_memory_mb)."""


@pytest.fixture
async def osworld_desktop(osworld_image):
    """One fresh desktop of the osworld image (2 GiB, the fleet's hardening); removed afterwards."""
    from actors.desktop.fleet import DesktopFleet

    fleet = DesktopFleet(osworld_image, run_id=f"test-osw-{secrets.token_hex(3)}", memory_mb=OSWORLD_MEMORY_MB)
    try:
        yield await fleet.start()
    finally:
        await fleet.remove_all()
        await fleet.close()


@pytest.fixture(scope="session")
def sglang_python():
    """Path of the python of the cached SGLang 0.5.23 test environment (tests/sglang_env.py), built first if missing
    (about a minute). Fails (never skips) with the import error and the missing package when it cannot be built."""
    from tests.sglang_env import SGLangEnvError, ensure_sglang_env

    try:
        return ensure_sglang_env(log=lambda line: print(f"[sglang env] {line}", flush=True))
    except SGLangEnvError as exc:
        pytest.fail(f"cannot provide the SGLang test environment: {exc}", pytrace=False)
