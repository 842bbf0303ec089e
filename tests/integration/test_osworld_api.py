"""OSWorld's controller API on real desktops: every route OSWorld's PythonController and SetupController call,
with real content (real windows, folders, scripts, the dconf store), the pyautogui action backend driving a
real Tk app, and OSWorld's own PythonController (desktop-env 1.0.2 from PyPI, unchanged) reaching a desktop
through actors/desktop/tcp_forward.py.
"""
from __future__ import annotations

import asyncio
import io
import subprocess
import sys
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import pytest
from PIL import Image

from actors.desktop.controller_client import ControllerClient, DesktopError, NotSupported, RequestRefused
from actors.desktop.tcp_forward import TcpForward
from actors.evaluation import evaluate, run_setup
from actors.uitars import pyautogui
from actors.uitars.actions import Action
from arpo_async.tasks import load_tasks
from tests.integration.test_desktop import layout_with
from tests.support import until

pytestmark = pytest.mark.docker

BUILTIN = {t.id: t for t in load_tasks()}
ST = "https://accessibility.ubuntu.example.org/ns/state"
OSWORLD_WHEEL = "desktop-env==1.0.2"


async def _xterm(c: ControllerClient, title: str, name: str, cls: str) -> None:
    await c.launch(["xterm", "-name", name, "-class", cls, "-T", title])

    async def focused():  # openbox focuses a new window once it maps it
        return await _active_title(c) == title
    await until(focused, 15, f"the xterm {title!r} to take the focus")


async def _active_title(c: ControllerClient) -> str:
    """Title of the focused window ("" when none has the focus)."""
    r = await c.execute(["xdotool", "getactivewindow", "getwindowname"], timeout=10)
    return r["output"].strip() if r["returncode"] == 0 else ""


async def test_window_routes_follow_wmctrl_rules(fleet):
    c = (await fleet.start()).controller
    await _xterm(c, "Alpha Term", "alphaname", "AlphaClass")
    await _xterm(c, "Beta Term", "betaname", "BetaClass")
    assert await _active_title(c) == "Beta Term"
    # title: substring, case-insensitive; strict: whole title, case-sensitive
    assert await c.activate_window("alpha")
    assert await _active_title(c) == "Alpha Term"
    assert not await c.activate_window("beta term", strict=True)
    assert await c.activate_window("Beta Term", strict=True)
    assert await _active_title(c) == "Beta Term"
    # by_class: "res_name.res_class" of WM_CLASS, not the title
    assert not await c.activate_window("Alpha Term", by_class=True)
    assert await c.activate_window("alphaname.alphaclass", by_class=True)
    assert await _active_title(c) == "Alpha Term"
    assert not await c.activate_window("alphaname.alphaclass", strict=True, by_class=True)
    assert await c.activate_window("betaname.BetaClass", strict=True, by_class=True)
    assert await _active_title(c) == "Beta Term"
    # window size by WM_CLASS part (openbox maximises every window: the screen's size)
    assert await c.window_size("alphaclass") == await c.screen_size()
    assert await c.window_size("BETANAME") == await c.screen_size()
    assert await c.window_size("NoSuchClass") is None
    with pytest.raises(RequestRefused, match="app_class_name is required"):
        await c._request("POST", "/window_size", data={"other": "x"})
    # close the first match only, gracefully
    assert await c.close_window("BetaClass", by_class=True)

    async def beta_gone():
        r = await c.execute(["xdotool", "search", "--name", "^Beta Term$"], timeout=10)
        return r["returncode"] != 0
    await until(beta_gone, 15, "Beta Term to close")
    assert await c.window_size("alphaclass") is not None
    assert not await c.close_window("BetaClass", by_class=True)


async def test_desktop_path_and_directory_tree(fleet):
    c = (await fleet.start()).controller
    assert await c.desktop_path() == "/root/Desktop"
    r = await c.execute("mkdir -p /root/t/b/c /root/t/a && touch /root/t/z.txt /root/t/b/y && "
                        "ln -s /root/t /root/t/b/loop", shell=True)
    assert r["returncode"] == 0, r
    tree = await c.list_directory("/root/t")
    assert tree == {"type": "directory", "name": "t", "children": [
        {"type": "directory", "name": "a", "children": []},
        {"type": "directory", "name": "b", "children": [
            {"type": "directory", "name": "c", "children": []},
            {"type": "directory", "name": "loop", "children": []},  # a symlink loop, cut
            {"type": "file", "name": "y"}]},
        {"type": "file", "name": "z.txt"}]}
    with pytest.raises(RequestRefused, match="not a directory"):
        await c.list_directory("/root/t/z.txt")
    await c.execute(["rm", "-r", "/root/Desktop"])
    assert await c.desktop_path() is None
    await c.reset()
    assert await c.desktop_path() == "/root/Desktop"


def _png(colour: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(out, format="PNG")
    return out.getvalue()


async def test_wallpaper_lives_in_the_gsettings_store_and_reset_restores_it(fleet):
    c = (await fleet.start()).controller
    assert await c.wallpaper() is None  # the schema's default names no file in this image
    red = _png((255, 0, 0))
    await c.upload("/root/Pictures/red.png", red)
    await c.change_wallpaper("~/Pictures/red.png")
    assert await c.wallpaper() == red
    got = await c.execute(["gsettings", "get", "org.gnome.desktop.background", "picture-uri"])
    assert got["output"].strip() == "'file:///root/Pictures/red.png'"
    with pytest.raises(RequestRefused, match="File not found"):
        await c.change_wallpaper("/root/Pictures/none.png")
    await c.reset()
    assert await c.wallpaper() is None


async def test_run_python_and_run_bash_script_shapes(fleet):
    c = (await fleet.start()).controller
    ok = await c.run_python("import sys\nprint(6 * 7)\nprint('warn', file=sys.stderr)")
    assert ok == {"status": "success", "message": "42\n\nwarn\n", "need_more": False, "output": "42\n",
                  "error": "warn\n", "return_code": 0}
    bad = await c.run_python("raise SystemExit(3)")
    assert (bad["status"], bad["return_code"], bad["error"]) == ("error", 3, "Process exited with code 3")
    with pytest.raises(RequestRefused, match="Code not supplied"):
        await c.run_python("")
    await c.execute(["mkdir", "-p", "/root/work"])
    res = await c.run_bash_script("pwd; echo oops >&2; exit 4", working_dir="~/work")
    assert res == {"status": "error", "output": "/root/work\noops\n", "error": "", "returncode": 4}
    slow = await c.run_bash_script("sleep 30", timeout=1)
    assert slow == {"status": "error", "output": "Script execution timed out after 1 seconds", "error": "",
                    "returncode": -1}
    with pytest.raises(RequestRefused, match="Working directory does not exist"):
        await c.run_bash_script("true", working_dir="/nowhere")


async def test_open_file_waits_for_the_window_and_fails_clearly(fleet):
    c = (await fleet.start()).controller
    text = await c.open_file("xterm", timeout=20)  # a program on PATH: waits for a window titled "xterm"
    assert text == "File opened and window activated successfully"
    assert await _active_title(c) == "xterm"
    with pytest.raises(RequestRefused, match="Application/file not found"):
        await c.open_file("/root/no/such/file.txt")
    await c.upload("/root/notes.unknownext", b"no app opens this")
    with pytest.raises(DesktopError, match="exited with status"):  # xdg-open finds no handler: fails at once
        await c.open_file("/root/notes.unknownext", timeout=30)


async def test_download_file_names_the_missing_network(fleet):
    c = (await fleet.start()).controller
    with pytest.raises(DesktopError, match="no network"):
        await c.download_file("http://example.invalid/a.txt", "/root/a.txt", timeout=120)
    assert await c.get_file("/root/a.txt") is None
    with pytest.raises(RequestRefused, match="only http and https"):
        await c.download_file("file:///etc/passwd", "/root/p")


async def test_accessibility_tree_and_terminal_answer_osworld_shapes(fleet):
    c = (await fleet.start()).controller
    xml = await c.accessibility_tree()
    root = ET.fromstring(xml)  # well-formed, namespaces declared
    assert root.tag == "desktop-frame"
    assert xml.startswith('<desktop-frame xmlns:st="https://accessibility.ubuntu.example.org/ns/state"')
    # Tk and xterm expose no AT-SPI objects, so the default image's tree lists no application; the osworld
    # image's apps (GTK, LibreOffice, Chromium) appear under it (tests/integration/test_osworld_image.py)
    assert await c.terminal_output() is None
    ps = await c.execute(["ps", "-eo", "comm="])
    assert "at-spi-bus-laun" in ps["output"] and "dbus-daemon" in ps["output"]


async def test_recording_needs_the_osworld_image(fleet):
    c = (await fleet.start()).controller
    if (await c.execute("command -v ffmpeg", shell=True))["returncode"] == 0:
        pytest.skip("this image has ffmpeg: recording is tested with the osworld image")
    with pytest.raises(NotSupported, match="profile osworld"):
        await c.start_recording()
    with pytest.raises(RequestRefused, match="No recording in progress"):
        await c.end_recording()


async def test_routes_keep_the_hardening(fleet):
    c = (await fleet.start()).controller
    with pytest.raises(RequestRefused, match="exceeds|at most") as exc:
        await c._request("POST", "/run_python", data=b"{" + b" " * (2 << 20) + b"}",
                         headers={"Content-Type": "application/json"})
    assert exc.value.status == 413
    with pytest.raises(DesktopError, match="must be a JSON object"):
        await c._request("POST", "/list_directory", data=b"[1]", headers={"Content-Type": "application/json"})


# ---- the pyautogui action backend --------------------------------------------------------------------------

async def _act(c: ControllerClient, action: Action) -> None:
    for argv in pyautogui.to_commands(action):
        r = await c.execute(argv, timeout=60)
        assert r["status"] == "success" and r["returncode"] == 0, r


async def test_pyautogui_backend_clicks_and_types_in_a_real_app(fleet):
    c = (await fleet.start()).controller
    task = BUILTIN["grid4-red"]
    await run_setup(c, task.config)
    box = (await layout_with(c, "Red"))["Red"]
    await _act(c, Action("click", point=(float(box["cx"]), float(box["cy"]))))
    assert await c.cursor_position() == (box["cx"], box["cy"])
    assert await evaluate(c, task, last_action="DONE") == 1.0
    await c.reset()

    form = BUILTIN["form-name"]
    await run_setup(c, form.config)
    layout = await layout_with(c, "Save")
    name = layout["Name"]
    await _act(c, Action("click", point=(float(name["cx"]), float(name["cy"]))))
    await _act(c, Action("type", text="Alice"))
    await _act(c, Action("click", point=(float(layout["Save"]["cx"]), float(layout["Save"]["cy"]))))
    assert await evaluate(c, form, last_action="DONE") == 1.0


# ---- OSWorld's own PythonController through the TCP forward ----------------------------------------------

@pytest.fixture(scope="session")
def osworld_python_controller(tmp_path_factory):
    """OSWorld's PythonController class, loaded unchanged from the desktop-env 1.0.2 wheel (PyPI, pip download
    --no-deps; its desktop_env/__init__.py files are empty and python.py needs only requests and
    desktop_env.actions)."""
    cache = Path.home() / ".cache" / "arpo" / "wheels"
    wheels = sorted(cache.glob("desktop_env-1.0.2-*.whl"))
    if not wheels:
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                        "-d", str(cache), OSWORLD_WHEEL], check=True, capture_output=True, timeout=300)
        wheels = sorted(cache.glob("desktop_env-1.0.2-*.whl"))
    root = tmp_path_factory.mktemp("osworld")
    with zipfile.ZipFile(wheels[0]) as z:
        for name in ("desktop_env/__init__.py", "desktop_env/actions.py", "desktop_env/controllers/__init__.py",
                     "desktop_env/controllers/python.py"):
            z.extract(name, root)
    sys.path.insert(0, str(root))
    try:
        from desktop_env.controllers.python import PythonController  # noqa: PLC0415
        yield PythonController
    finally:
        sys.path.remove(str(root))
        for mod in [m for m in sys.modules if m == "desktop_env" or m.startswith("desktop_env.")]:
            del sys.modules[mod]


async def test_osworld_python_controller_works_unchanged(fleet, osworld_python_controller):
    desktop = await fleet.start()
    c = desktop.controller
    await c.execute(["mkdir", "-p", "/root/Desktop/folder"])
    async with TcpForward(c.socket_path) as fwd:
        pc = osworld_python_controller("127.0.0.1", fwd.port)
        pc.retry_interval = 0.2  # OSWorld waits 5 s between retries; a failure shows up in the asserts anyway
        png = await asyncio.to_thread(pc.get_screenshot)
        assert png is not None and Image.open(io.BytesIO(png)).size == await c.screen_size()
        assert await asyncio.to_thread(pc.get_vm_screen_size) == dict(zip(("width", "height"), await c.screen_size()))
        assert await asyncio.to_thread(pc.get_vm_platform) == "Linux"  # execute_python_command: python + pyautogui
        await asyncio.to_thread(pc.execute_python_command, "pyautogui.moveTo(123, 234)")
        assert await c.cursor_position() == (123, 234)
        await asyncio.to_thread(pc.execute_action, {"action_type": "CLICK", "x": 300, "y": 200})
        assert await c.cursor_position() == (300, 200)
        tree = await asyncio.to_thread(pc.get_accessibility_tree)
        assert ET.fromstring(tree).tag == "desktop-frame"
        assert await asyncio.to_thread(pc.get_terminal_output) is None
        assert await asyncio.to_thread(pc.get_vm_desktop_path) == "/root/Desktop"
        assert await asyncio.to_thread(pc.get_vm_directory_tree, "/root/Desktop") == {
            "type": "directory", "name": "Desktop", "children": [{"type": "directory", "name": "folder",
                                                                  "children": []}]}
        await c.upload("/root/x.bin", b"\x00\x01payload")
        assert await asyncio.to_thread(pc.get_file, "/root/x.bin") == b"\x00\x01payload"
        res = await asyncio.to_thread(pc.run_bash_script, "echo $((2 + 3))")
        assert (res["status"], res["output"]) == ("success", "5\n")
        res = await asyncio.to_thread(pc.run_python_script, "print('hi')")
        assert (res["status"], res["output"]) == ("success", "hi\n")


# ---- in the osworld image: AT-SPI content, terminal output, recording ---------------------------------------



@pytest.fixture
def osworld_controller(osworld_desktop):
    return osworld_desktop.controller


@pytest.mark.osworld_image
async def test_accessibility_tree_and_terminal_show_real_apps(osworld_controller):
    c = osworld_controller
    await c.launch(["gnome-terminal"])

    async def terminal_in_tree():
        root = ET.fromstring(await c.accessibility_tree())
        return [a for a in root if a.get("name") == "gnome-terminal-server"
                and any(f.tag == "frame" and f.get(f"{{{ST}}}active") == "true" for f in a)]
    await until(terminal_in_tree, 90, "gnome-terminal's active frame in the AT-SPI tree")
    [app] = await terminal_in_tree()
    frame = next(f for f in app if f.tag == "frame")
    assert frame.get("{https://accessibility.ubuntu.example.org/ns/component}size")  # showing: extents given
    await c.execute(["xdotool", "type", "--delay", "0", "echo hello-$((40 + 2))\n"])

    async def printed():
        out = await c.terminal_output()
        return out is not None and "hello-42" in out
    await until(printed, 30, "the terminal output to show the command's result")


@pytest.mark.osworld_image
async def test_recording_returns_an_mp4_and_reset_stops_it(osworld_controller):
    c = osworld_controller
    await c.start_recording()
    with pytest.raises(RequestRefused, match="already in progress"):
        await c.start_recording()
    for x in (100, 400, 700):
        await c.execute(["xdotool", "mousemove", str(x), "300"])
    mp4 = await c.end_recording()
    assert mp4[4:8] == b"ftyp" and len(mp4) > 1000
    await c.start_recording()
    await c.reset()
    with pytest.raises(RequestRefused, match="No recording in progress"):
        await c.end_recording()
    assert await c.get_file("/tmp/recording.mp4") is None
