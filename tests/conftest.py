"""Shared pytest fixtures. Keep small: only fixtures several test modules need."""
from __future__ import annotations

import secrets
import subprocess
import sys
import threading

import pytest

OSWORLD_BUILD_BUDGET_S = 1800
"""The osworld desktop image (OSWorld's apps, ~2 GB) is built before the first test when a collected test needs it
and the image is missing: about 7 minutes on a quiet 2-core machine, more beside other work. It is built outside
every test's own timeout (pyproject's 600 s), within this budget of its own."""
_osworld_build: dict[str, str] = {}
"""The build's outcome for the ``osworld_image`` fixture: {"tag": ...} or {"error": ...}."""


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the osworld image, if a collected test needs it, before any test runs (see OSWORLD_BUILD_BUDGET_S)."""
    if not any("osworld_image" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    terminal = session.config.pluginmanager.get_plugin("terminalreporter")
    proc = subprocess.Popen([sys.executable, "-m", "arpo_cli.cli", "desktop", "build", "--profile", "osworld"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    budget = threading.Timer(OSWORLD_BUILD_BUDGET_S, proc.kill)
    budget.start()
    lines = []
    try:
        for line in proc.stdout:  # the builder's progress, shown as it comes (the build takes minutes)
            lines.append(line.rstrip())
            if terminal is not None:
                terminal.write_line(f"[osworld build] {lines[-1]}")
        proc.wait()
    finally:
        budget.cancel()
    if proc.returncode == 0 and lines:
        _osworld_build["tag"] = lines[-1]  # the command prints the image's tag last
    elif proc.returncode in (-9, 137):
        _osworld_build["error"] = f"the build took more than its budget of {OSWORLD_BUILD_BUDGET_S} s"
    else:
        _osworld_build["error"] = "\n".join(lines[-20:])


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
    """Tag of the arpo-desktop-osworld image (OSWorld's apps and session), built before the first test when a
    collected test requests this fixture (:func:`pytest_collection_finish`, outside the tests' timeouts, within
    OSWORLD_BUILD_BUDGET_S): the apps layer takes minutes and ~2 GB, so only a session with such a test pays for
    it. Fails (never skips) like ``desktop_image``, with the builder's message."""
    if "tag" not in _osworld_build:
        pytest.fail(f"cannot provide the osworld desktop image: {_osworld_build.get('error', 'not built')}",
                    pytrace=False)
    return _osworld_build["tag"]


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
