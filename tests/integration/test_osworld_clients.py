"""OSWorld's own host-side clients, unchanged, against our desktops.

OSWorld's ``SetupController`` (desktop_env/controllers/setup.py) and ``PythonController``
(desktop_env/controllers/python.py) from its published package (desktop-env 1.0.2, PyPI) run in a subprocess of
the OSWorld virtualenv (actors/osworld/metric_env.py), loaded the way actors/osworld/metric_worker.py loads
OSWorld's code (bare ``desktop_env`` packages, placeholders for the libraries it imports but these steps never
call, e.g. playwright and pydrive). They reach a real desktop over HTTP through actors/desktop/tcp_forward.py, as
they would reach OSWorld's VM on port 5000. Each test checks the effects from our side (ControllerClient).

* default image (docker): the setup steps OSWorld's tasks use: download (from a local HTTP server on the host,
  fetched by OSWorld's client and uploaded through /setup/upload), upload_file, launch, execute with ``until``
  and ``stdout``, command, sleep, activate_window, close_window, change_wallpaper; a failing ``open`` step
  surfaces as OSWorld's ``Setup step N failed`` exception.
* osworld image (docker + osworld_image): OSWorld task configurations copied verbatim from OSWorld's task
  files (pyautogui's Ctrl+Alt+T opening a terminal, ``stty size`` read back through /terminal; chromium with its
  DevTools port forwarded by socat; ``gsettings`` output saved to the client's cache), ``open`` of a text file,
  the accessibility tree with a real GTK app, and a screen recording that ffprobe decodes.
"""
from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import secrets
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from PIL import Image

from actors.desktop.controller_client import ControllerClient
from actors.desktop.tcp_forward import TcpForward
from actors.osworld import metric_env
from tests.support import local_http_server, osworld_examples, until

OSWORLD = osworld_examples()
WORKER_DIR = Path(metric_env.__file__).resolve().parent
CLIENT_TIMEOUT_S = 300.0

# Runs in the OSWorld venv's interpreter (python -I: no arpo code on the path). argv: the folder of
# metric_worker.py, the placeholder libraries (JSON). stdin: {"port", "cache_dir", "calls": [{"client":
# "setup"|"python", "method", "args", "attrs"}]}. stdout: one JSON list, per call {"ok", "value"} (bytes as
# {"b64": ...}) or {"ok": false, "error_type", "error"}; the first failing call ends the list.
DRIVER = r"""
import base64, json, logging, sys
sys.path.insert(0, sys.argv[1])
import metric_worker
sys.meta_path.append(metric_worker._PlaceholderFinder(json.loads(sys.argv[2])))
metric_worker._register_packages()
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from desktop_env.controllers.python import PythonController
from desktop_env.controllers.setup import SetupController
req = json.load(sys.stdin)
clients = {"setup": SetupController("127.0.0.1", req["port"], cache_dir=req["cache_dir"]),
           "python": PythonController("127.0.0.1", req["port"])}
answers = []
for call in req["calls"]:
    client = clients[call["client"]]
    for name, value in call.get("attrs", {}).items():
        setattr(client, name, value)
    try:
        value = getattr(client, call["method"])(*call.get("args", []))
    except Exception as exc:
        answers.append({"ok": False, "error_type": type(exc).__name__, "error": str(exc)})
        break
    if isinstance(value, bytes):
        value = {"b64": base64.b64encode(value).decode()}
    answers.append({"ok": True, "value": value})
print(json.dumps(answers))
"""


@pytest.fixture(scope="session")
def osworld_python() -> Path:
    """The OSWorld venv's interpreter (built on first use: about a minute, from PyPI)."""
    return metric_env.ensure_env()


class OSWorldClients:
    """OSWorld's SetupController and PythonController for one desktop, run through :data:`DRIVER`.

    Args:
        python: the OSWorld venv's interpreter.
        port: the TCP forward's port on 127.0.0.1.
        cache_dir: the SetupController's ``cache_dir`` (where ``stdout``/``stderr`` of execute steps land).
    """

    def __init__(self, python: Path, port: int, cache_dir: Path) -> None:
        self.interpreter, self.port, self.cache_dir = python, port, cache_dir

    async def call(self, *calls: dict) -> list:
        """Run ``calls`` in one driver process; return their values. A failing call raises AssertionError
        naming OSWorld's exception."""
        request = {"port": self.port, "cache_dir": str(self.cache_dir), "calls": list(calls)}
        proc = await asyncio.create_subprocess_exec(
            str(self.interpreter), "-I", "-c", DRIVER, str(WORKER_DIR), json.dumps(metric_env.PLACEHOLDER_MODULES),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=self.cache_dir)
        try:
            out, err = await asyncio.wait_for(proc.communicate(json.dumps(request).encode()), CLIENT_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            pytest.fail(f"OSWorld's clients gave no answer within {CLIENT_TIMEOUT_S:g} s: {calls}")
        assert proc.returncode == 0, f"driver exited {proc.returncode}: {err.decode()[-3000:]}"
        answers = json.loads(out)
        values = []
        for call, answer in zip(calls, answers):
            assert answer["ok"], f"{call['client']}.{call['method']} raised {answer['error_type']}: " \
                                 f"{answer['error']}\n{err.decode()[-3000:]}"
            value = answer["value"]
            values.append(base64.b64decode(value["b64"]) if isinstance(value, dict) and "b64" in value else value)
        return values

    async def setup(self, config: list[dict]) -> None:
        """``SetupController.setup(config)``; it must return True."""
        [ok] = await self.call({"client": "setup", "method": "setup", "args": [config]})
        assert ok is True

    async def setup_error(self, config: list[dict]) -> str:
        """Run ``SetupController.setup(config)``, which must raise; return OSWorld's message."""
        request = {"client": "setup", "method": "setup", "args": [config]}
        with pytest.raises(AssertionError, match="raised Exception") as exc:
            await self.call(request)
        return str(exc.value)

    async def python(self, method: str, *args) -> object:
        """``PythonController.<method>(*args)``, retrying every 0.2 s (OSWorld's default: 5 s)."""
        [value] = await self.call({"client": "python", "method": method, "args": list(args),
                                   "attrs": {"retry_interval": 0.2}})
        return value


async def _first(fetch, timeout: float, what: str):
    """Poll the async ``fetch`` (tests.support.until) until it returns something truthy; return that."""
    got = []

    async def fetched():
        value = await fetch()
        got.append(value)
        return bool(value)
    await until(fetched, timeout, what)
    return got[-1]


async def _active_title(c: ControllerClient) -> str:
    r = await c.execute(["xdotool", "getactivewindow", "getwindowname"], timeout=10)
    return r["output"].strip() if r["returncode"] == 0 else ""


async def _windows_named(c: ControllerClient, regex: str) -> int:
    r = await c.execute(["xdotool", "search", "--onlyvisible", "--name", regex], timeout=10)
    return len(r["output"].split()) if r["returncode"] == 0 else 0


def _png(colour: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (16, 16), colour).save(out, format="PNG")
    return out.getvalue()


# ---- default image: every setup step type OSWorld's offline tasks use --------------------------------------

@pytest.mark.docker
async def test_setup_controller_runs_osworld_setup_steps(fleet, osworld_python, tmp_path):
    from aiohttp import web  # noqa: PLC0415

    c = (await fleet.start()).controller
    report = b"quarterly report\n" + secrets.token_bytes(64)
    red = _png((255, 0, 0))
    local = tmp_path / "local.txt"
    local.write_bytes(b"uploaded by OSWorld's client\n")
    cache = tmp_path / "cache"
    cache.mkdir()
    files = {"/report.bin": report, "/red.png": red}

    async def serve(request):
        return web.Response(body=files[request.path])
    async with local_http_server({path: serve for path in files}) as http_port, \
            TcpForward(c.socket_path) as fwd:
        base = f"http://127.0.0.1:{http_port}"
        clients = OSWorldClients(osworld_python, fwd.port, cache)
        await clients.setup([
            {"type": "download", "parameters": {"files": [
                {"url": f"{base}/report.bin", "path": "/root/Desktop/report.bin"},
                {"url": f"{base}/red.png", "path": "/root/Pictures/red.png"}]}},
            {"type": "upload_file", "parameters": {"files": [{"local_path": str(local),
                                                              "path": "/root/notes/local.txt"}]}},
            {"type": "launch", "parameters": {"command": ["xterm", "-name", "alphaname", "-class", "AlphaClass",
                                                          "-T", "Alpha Term"]}},
            {"type": "launch", "parameters": {"command": "xterm -name betaname -class BetaClass -T 'Beta Term'",
                                              "shell": True}},
            # until: OSWorld's client repeats the step until the output shows both windows mapped
            {"type": "execute", "parameters": {"command": "xdotool search --onlyvisible --name ' Term$' | wc -l",
                                               "shell": True, "until": {"stdout": "2"}}},
            {"type": "command", "parameters": {"command": "echo $((6 * 7)) | tee /root/answer.txt", "shell": True,
                                               "stdout": "answer.out", "stderr": "answer.err"}},
            {"type": "sleep", "parameters": {"seconds": 0.2}},
            {"type": "activate_window", "parameters": {"window_name": "alphaname.AlphaClass", "by_class": True}},
            {"type": "close_window", "parameters": {"window_name": "Beta Term", "strict": True}},
            {"type": "change_wallpaper", "parameters": {"path": "/root/Pictures/red.png"}},
        ])
        assert await c.get_file("/root/Desktop/report.bin") == report
        assert await c.get_file("/root/notes/local.txt") == local.read_bytes()
        assert await c.get_file("/root/answer.txt") == b"42\n"
        assert (cache / "answer.out").read_text() == "42\n" and (cache / "answer.err").read_text() == ""
        # OSWorld's download cache: uuid5(URL namespace, url) + "_" + the file's name
        assert sorted(p.name.split("_", 1)[1] for p in cache.iterdir() if "-" in p.name) == ["red.png",
                                                                                            "report.bin"]
        assert await _active_title(c) == "Alpha Term"

        async def beta_closed():
            return await _windows_named(c, "^Beta Term$") == 0
        await until(beta_closed, 15, "close_window to close Beta Term")
        assert await _windows_named(c, "^Alpha Term$") == 1
        assert await c.wallpaper() == red

        # OSWorld's client raises on a failed open step, naming the step
        message = await clients.setup_error([{"type": "sleep", "parameters": {"seconds": 0}},
                                             {"type": "open", "parameters": {"path": "/root/no/such.txt"}}])
        assert "Setup step 2 failed: _open_setup" in message and "/root/no/such.txt" in message


# ---- osworld image: OSWorld's task configurations verbatim, the accessibility tree, recording -------------

# Copied verbatim from OSWorld's task files (github.com/xlang-ai/OSWorld, evaluation_examples/examples/<domain>/<id>.json,
# Apache-2.0), so that the tests need no copy of OSWorld's task folder.
OS_13584542_CONFIG = [{"type": "execute", "parameters": {"command": [
    "python", "-c", "import pyautogui; import time; pyautogui.click(960, 540); time.sleep(0.5);"]}}]
OS_13584542_POSTCONFIG = [
    {"type": "sleep", "parameters": {"seconds": 1}},
    {"type": "execute", "parameters": {"command": [
        "python", "-c", "import pyautogui; import time; time.sleep(0.5); pyautogui.hotkey('ctrl', 'alt', 't'); "
        "time.sleep(0.5); pyautogui.write('stty size'); time.sleep(0.5); pyautogui.press('enter')"]}}]
MULTI_APPS_F8369178_POSTCONFIG = [{"type": "execute", "parameters": {
    "command": ["gsettings", "get", "org.gnome.desktop.interface", "gtk-theme"], "stdout": "gsettings.out"}}]
CHROME_2AD9387A_CONFIG = [
    {"type": "launch", "parameters": {"command": ["google-chrome", "--remote-debugging-port=1337"]}},
    {"type": "launch", "parameters": {"command": ["socat", "tcp-listen:9222,fork", "tcp:localhost:1337"]}}]


@pytest.mark.parametrize(("domain", "task_id", "part", "copy"), [
    ("os", "13584542-872b-42d8-b299-866967b5c3ef", "config", OS_13584542_CONFIG),
    ("os", "13584542-872b-42d8-b299-866967b5c3ef", "postconfig", OS_13584542_POSTCONFIG),
    ("multi_apps", "f8369178-fafe-40c2-adc4-b9b08a125456", "postconfig", MULTI_APPS_F8369178_POSTCONFIG),
    ("chrome", "2ad9387a-65d8-4e33-ad5b-7580065a27ca", "config", CHROME_2AD9387A_CONFIG)])
def test_copied_task_configs_match_osworlds_files(domain, task_id, part, copy):
    if OSWORLD is None:
        pytest.skip("$OSWORLD_EXAMPLES names no folder of OSWorld's task files")
    path = OSWORLD / domain / f"{task_id}.json"
    if not path.exists():
        pytest.skip(f"{path} is not in $OSWORLD_EXAMPLES")
    task = json.loads(path.read_text())
    assert (task["config"] if part == "config" else task["evaluator"]["postconfig"]) == copy


@pytest.mark.docker
@pytest.mark.osworld_image
async def test_osworld_task_configs_run_unchanged(osworld_desktop, osworld_python, tmp_path):
    c = osworld_desktop.controller
    async with TcpForward(c.socket_path) as fwd:
        clients = OSWorldClients(osworld_python, fwd.port, tmp_path)
        # os 13584542: a pyautogui click as setup; its evaluator's postconfig presses Ctrl+Alt+T (a GNOME
        # terminal opens), types `stty size` and reads the answer back with OSWorld's vm_terminal_output getter
        await clients.setup(OS_13584542_CONFIG)
        assert await c.cursor_position() == (960, 540)
        await clients.setup(OS_13584542_POSTCONFIG)

        async def terminal_focused():
            return await _active_title(c) == "Terminal"
        await until(terminal_focused, 60, "the task's Ctrl+Alt+T to open a focused GNOME terminal")
        # the task's keystrokes land only if the terminal was up within its 0.5 s sleeps (on a loaded machine it
        # may not be): type the command again as OSWorld's agents act, through execute_python_command
        await clients.python("execute_python_command", "pyautogui.write('stty size'); pyautogui.press('enter')")

        async def size_printed():
            out = await clients.python("get_terminal_output")
            return out and re.search(r"stty size\s*\n(\d+) (\d+)\s*\n", out)
        rows, cols = map(int, (await _first(size_printed, 60, "`stty size` and its answer in the terminal")).groups())
        assert rows > 5 and cols > 20

        # multi_apps f8369178: the execute step's stdout lands in the client's cache folder
        await clients.setup(MULTI_APPS_F8369178_POSTCONFIG)
        theme = (await c.execute(["gsettings", "get", "org.gnome.desktop.interface", "gtk-theme"]))["output"]
        assert (tmp_path / "gsettings.out").read_text() == theme and theme.startswith("'")

        # chrome 2ad9387a: chromium on DevTools port 1337, forwarded to 9222 by socat
        await clients.setup(CHROME_2AD9387A_CONFIG)

        async def devtools():
            r = await c.execute(["python", "-c", "import urllib.request; print(urllib.request.urlopen("
                                 "'http://localhost:9222/json/version', timeout=5).read().decode())"], timeout=20)
            return r["returncode"] == 0 and json.loads(r["output"])
        version = await _first(devtools, 90, "chromium's DevTools on port 9222 through socat")
        assert version["Browser"].startswith(("Chrome/", "HeadlessChrome/"))


@pytest.mark.docker
@pytest.mark.osworld_image
async def test_python_controller_reads_a_real_gtk_app_and_records(osworld_desktop, osworld_python, tmp_path):
    c = osworld_desktop.controller
    async with TcpForward(c.socket_path) as fwd:
        clients = OSWorldClients(osworld_python, fwd.port, tmp_path)
        notes = tmp_path / "notes.txt"
        notes.write_text("first line\n")
        await clients.python("start_recording")
        await clients.setup([
            {"type": "upload_file", "parameters": {"files": [{"local_path": str(notes),
                                                              "path": "/home/user/Documents/notes.txt"}]}},
            {"type": "open", "parameters": {"path": "/home/user/Documents/notes.txt"}},
        ])
        assert "notes.txt" in await _active_title(c)
        # OSWorld's pyautogui action strings through execute_python_command
        await clients.python("execute_python_command", "pyautogui.hotkey('ctrl', 'End'); "
                             "pyautogui.typewrite('typed by pyautogui'); pyautogui.hotkey('ctrl', 's')")

        async def saved():
            return b"typed by pyautogui" in (await c.get_file("/root/Documents/notes.txt") or b"")
        await until(saved, 30, "gedit to save the typed text")

        async def gedit_in_tree():
            root = ET.fromstring(await clients.python("get_accessibility_tree"))
            return [a for a in root if a.get("name") == "gedit"]
        [app] = await _first(gedit_in_tree, 60, "gedit in OSWorld's accessibility tree")
        names = [e.get("name") or "" for e in app.iter()]
        assert any("notes.txt" in n for n in names), names[:40]

        video = tmp_path / "recording.mp4"
        await clients.python("end_recording", str(video))
        data = video.read_bytes()
        assert data[4:8] == b"ftyp"
        # playable: ffprobe (in the desktop) decodes every frame of what OSWorld's client wrote
        await c.upload("/tmp/check.mp4", data)
        r = await c.execute(["ffprobe", "-v", "error", "-count_frames", "-select_streams", "v:0", "-show_entries",
                             "stream=codec_name,width,height,nb_read_frames", "-of", "json", "/tmp/check.mp4"],
                            timeout=60)
        assert r["returncode"] == 0, r
        [stream] = json.loads(r["output"])["streams"]
        assert (stream["width"], stream["height"]) == await c.screen_size()
        assert int(stream["nb_read_frames"]) > 5
