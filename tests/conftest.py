"""Shared pytest fixtures. Keep small: only fixtures several test modules need."""
from __future__ import annotations

import secrets
import subprocess
import sys
import threading
from pathlib import Path

import pytest

OSWORLD_BUILD_BUDGET_S = 2400
"""The osworld desktop image (OSWorld's apps and VS Code, ~2.8 GB) is built when a collected test needs it and the
image is missing: the apps layer about 7 minutes and VS Code's layer about 10 on a quiet 2-core machine, more beside
other work. The build starts in the background when collection ends, so the tests that need no osworld desktop run
meanwhile (they come first: the osworld tests are named test_osworld_* and test_stand_in_*); the ``osworld_image``
fixture waits for it. It runs outside every test's own timeout (pyproject's 600 s), within this budget of its own."""
_osworld_build: dict = {}
"""The background build: {"thread", "proc", "log"} while it runs; then also {"tag": ...} or {"error": ...}; and
the background builders of the metrics and SGLang environments ("metric_env", "sglang_env": their processes)."""


def _build_osworld() -> None:
    """Run ``arpo desktop build --profile osworld`` to completion (killed after OSWORLD_BUILD_BUDGET_S); record its
    tag or its error in _osworld_build. Its output goes to a log file (shown on failure), not between tests."""
    log_file = _osworld_build["log"]
    with open(log_file, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "arpo_cli.cli", "desktop", "build", "--profile", "osworld"],
                                stdout=out, stderr=subprocess.STDOUT, text=True)
        _osworld_build["proc"] = proc
        try:
            proc.wait(timeout=OSWORLD_BUILD_BUDGET_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    lines = [line.rstrip() for line in open(log_file, errors="replace") if line.strip()]
    if proc.returncode == 0 and lines:
        _osworld_build["tag"] = lines[-1]  # the command prints the image's tag last
    elif proc.returncode in (-9, 137):
        _osworld_build["error"] = f"the build took more than its budget of {OSWORLD_BUILD_BUDGET_S} s"
    else:
        _osworld_build["error"] = "\n".join(lines[-20:])


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start building the osworld image, if a collected test needs it, in the background (see
    OSWORLD_BUILD_BUDGET_S); also the OSWorld metrics environment (``python -m actors.osworld.metric_env``, a few
    minutes of pip), which the evaluators of those tests use: a test that needs it first waits on its build lock.
    Likewise the SGLang test environment (``python -m tests.sglang_env``) when a collected test needs
    ``sglang_python``: on a fresh machine its pip installs then overlap the tests that come before."""
    if any("sglang_python" in getattr(item, "fixturenames", ()) for item in session.items):
        _osworld_build["sglang_env"] = subprocess.Popen([sys.executable, "-m", "tests.sglang_env"],
                                                        cwd=Path(__file__).resolve().parents[1],
                                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not any("osworld_image" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    import tempfile

    _osworld_build["log"] = tempfile.mktemp(prefix="arpo-osworld-build-", suffix=".log")
    terminal = session.config.pluginmanager.get_plugin("terminalreporter")
    if terminal is not None:
        terminal.write_line(f"[osworld build] started in the background; its log: {_osworld_build['log']}")
    _osworld_build["thread"] = threading.Thread(target=_build_osworld, daemon=True)
    _osworld_build["thread"].start()
    _osworld_build["metric_env"] = subprocess.Popen([sys.executable, "-m", "actors.osworld.metric_env"],
                                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop a background build still running when the session ends early (``-x``, Ctrl-C)."""
    for proc in (_osworld_build.get("proc"), _osworld_build.get("metric_env"), _osworld_build.get("sglang_env")):
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


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
    """Tag of the arpo-desktop-osworld image (OSWorld's apps, VS Code and session), built in the background from
    the end of collection when a collected test requests this fixture (:func:`pytest_collection_finish`, within
    OSWORLD_BUILD_BUDGET_S): the layers take minutes and ~2.8 GB, so only a session with such a test pays for
    it. Fails (never skips) like ``desktop_image``, with the builder's message."""
    thread = _osworld_build.get("thread")
    if thread is not None and thread.is_alive():
        print(f"[osworld build] waiting for the image build (log: {_osworld_build['log']})", flush=True)
        thread.join(OSWORLD_BUILD_BUDGET_S)
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
