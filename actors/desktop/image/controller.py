#!/usr/bin/env python3
"""In-container desktop controller: OSWorld's controller HTTP API over a Unix socket.

Runs INSIDE the desktop container with Debian's python3, the standard library and PIL only.
It owns the X display ``$DISPLAY`` (started by entrypoint.sh) and serves, on the Unix socket
``$ARPO_CONTROLLER_SOCKET`` (default /run/arpo/controller.sock, mode 0666, in a folder bind-mounted
from the host), the subset of OSWorld's ``desktop_env/server/main.py`` API that the actors use, with
OSWorld's request and response shapes:

    GET  /screenshot            -> PNG bytes of the whole screen, cursor drawn in (compress_level 1);
                                   ours: optional query ?format=png|jpeg&quality=1..100 (JPEG quality,
                                   default 85; ignored for PNG); 400 on a bad value
    POST /execute, /setup/execute {"command": list|str, "shell": bool, "timeout"?: s}
                                -> {"status": "success", "output", "error", "returncode"}
                                   or HTTP 500 {"status": "error", "message", "output", "error", "returncode"}
    POST /setup/launch          {"command", "shell"} -> text; does not wait for the process
    POST /file                  form file_path -> file bytes; 404 {"error": "File not found"}
    POST /setup/upload          multipart file_path + file_data -> text
    POST /screen_size           -> {"width", "height"}
    GET  /cursor_position       -> [x, y]
    GET  /platform              -> "Linux"
    POST /setup/activate_window {"window_name", "strict"?} -> text (xdotool; 404 if no such window)
    POST /setup/close_window    {"window_name", "strict"?} -> text
    GET  /health                -> {"status": "ok", "display"} once X answers, else 503 (ours)
    POST /reset                 -> {"status": "ok", "killed", "removed", "restored", "seconds"} (ours): puts the
                                   desktop back to its state when the controller started (see BootState),
                                   so one container can serve many episodes; 500 when it cannot

In-place reset (ours; OSWorld reverts a VM snapshot instead): at start the controller records the
desktop's base processes (PID 1, itself, Xvfb, openbox) and every path under /root and /tmp, with the bytes of
/root's files. POST /reset kills every other process (apps, terminals and their children), deletes the paths
that did not exist at start, rewrites /root's files that changed, releases modifier keys and mouse buttons and
puts the pointer back where it was. It kills every process outside the base set, commands of other requests
still running included, so call it only on a desktop no episode is using (DesktopPool resets released desktops).
State outside /root and /tmp (a file an agent wrote to /etc, say) is not
restored: the pool bounds how many episodes a container serves (actors.desktop_max_episodes).

Invariants: every request is handled on its own thread; commands run with DISPLAY set and in their own
session so a timeout kills the whole process group; PID 1 is docker's init (tini), which reaps orphans.
Set ARPO_CONTROLLER_TCP=host:port to listen on TCP instead (a container with a network).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import email.parser
import email.policy
import io
import json
import os
import shlex
import shutil
import signal
import socketserver
import subprocess
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler

from PIL import ImageDraw, ImageGrab

DISPLAY = os.environ.get("DISPLAY", ":0")
SOCKET_PATH = os.environ.get("ARPO_CONTROLLER_SOCKET", "/run/arpo/controller.sock")
DEFAULT_TIMEOUT_S = 120.0
MAX_BODY_BYTES = 256 * 1024 * 1024

# An arrow cursor, 12 x 19 px, tip at (0, 0): drawn white with a black outline at the pointer.
_ARROW = [(0, 0), (0, 16), (4, 12), (7, 18), (9, 17), (6, 11), (11, 11)]


class _XPointer:
    """Queries the X pointer position through libX11 (XQueryPointer) on one shared connection."""

    def __init__(self, display: str) -> None:
        name = ctypes.util.find_library("X11") or "libX11.so.6"
        self._x = ctypes.CDLL(name)
        self._x.XOpenDisplay.restype = ctypes.c_void_p
        self._x.XOpenDisplay.argtypes = [ctypes.c_char_p]
        self._x.XDefaultRootWindow.restype = ctypes.c_ulong
        self._x.XDefaultRootWindow.argtypes = [ctypes.c_void_p]
        self._x.XQueryPointer.argtypes = [ctypes.c_void_p, ctypes.c_ulong] + [ctypes.c_void_p] * 7
        self._lock = threading.Lock()
        self._dpy = self._x.XOpenDisplay(display.encode())
        if not self._dpy:
            raise RuntimeError(f"cannot open X display {display}")
        self._root = self._x.XDefaultRootWindow(self._dpy)

    def position(self) -> tuple[int, int]:
        root_ret, child_ret = ctypes.c_ulong(), ctypes.c_ulong()
        rx, ry, wx, wy = ctypes.c_int(), ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        mask = ctypes.c_uint()
        with self._lock:
            self._x.XQueryPointer(self._dpy, self._root, ctypes.byref(root_ret), ctypes.byref(child_ret),
                                  ctypes.byref(rx), ctypes.byref(ry), ctypes.byref(wx), ctypes.byref(wy),
                                  ctypes.byref(mask))
        return rx.value, ry.value


_pointer: _XPointer | None = None
_pointer_lock = threading.Lock()


def pointer() -> _XPointer:
    global _pointer
    with _pointer_lock:
        if _pointer is None:
            _pointer = _XPointer(DISPLAY)
        return _pointer


SCREENSHOT_FORMATS = ("png", "jpeg")
DEFAULT_JPEG_QUALITY = 85


def grab_screen(fmt: str = "png", quality: int = DEFAULT_JPEG_QUALITY) -> bytes:
    """The whole screen, arrow cursor drawn at the pointer, encoded as PNG (compress_level 1, lossless,
    OSWorld's format) or JPEG (``quality`` 1..100, 4:2:0 subsampling)."""
    image = ImageGrab.grab(xdisplay=DISPLAY)
    if image.mode != "RGB":
        image = image.convert("RGB")
    x, y = pointer().position()
    draw = ImageDraw.Draw(image)
    draw.polygon([(x + dx, y + dy) for dx, dy in _ARROW], fill=(255, 255, 255), outline=(0, 0, 0))
    out = io.BytesIO()
    if fmt == "jpeg":
        image.save(out, format="JPEG", quality=quality)
    else:
        image.save(out, format="PNG", compress_level=1)
    return out.getvalue()


RESET_ROOTS = ("/root", "/tmp")
"""Folders put back to their state at controller start by /reset."""
RESTORED_FILE_MAX_BYTES = 1024 * 1024
"""Files under /root up to this size have their bytes recorded at start and rewritten by /reset."""
RESET_KILL_DEADLINE_S = 5.0
_MODIFIERS = ["Shift_L", "Shift_R", "Control_L", "Control_R", "Alt_L", "Alt_R", "Super_L", "Super_R"]


def _pids() -> set[int]:
    return {int(name) for name in os.listdir("/proc") if name.isdigit()}


def _parent_and_state(pid: int) -> tuple[int, str] | None:
    """(parent pid, state letter) of a process from /proc/<pid>/stat; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
    return int(fields[1]), fields[0]


class BootState:
    """The desktop as the controller found it at start: base processes, paths, and /root's file bytes.

    Must be created before the first request is served (then the only processes are PID 1, the controller,
    Xvfb and openbox, and no task has touched /root or /tmp).
    """

    def __init__(self) -> None:
        me = os.getpid()
        self.pids = {1, me} | {p for p in _pids() if (_parent_and_state(p) or (0, ""))[0] == me}
        self.paths: set[str] = set()
        self.home_dirs: list[str] = []  # folders under /root, parents first: recreated when an episode deleted them
        self.files: dict[str, bytes] = {}
        for root in RESET_ROOTS:
            for folder, dirs, files in os.walk(root):
                self.paths.add(folder)
                if folder.startswith("/root"):
                    self.home_dirs.append(folder)
                for name in dirs + files:
                    self.paths.add(os.path.join(folder, name))
                for name in files:
                    path = os.path.join(folder, name)
                    if folder.startswith("/root") and os.path.isfile(path) and not os.path.islink(path) \
                            and os.path.getsize(path) <= RESTORED_FILE_MAX_BYTES:
                        with open(path, "rb") as f:
                            self.files[path] = f.read()
        self.pointer = pointer().position()

    def reset(self) -> dict:
        """Put the desktop back to this state; returns counts and seconds. RuntimeError when a process survives."""
        t0 = time.monotonic()
        killed = self._kill_others()
        removed, restored = self._restore_files()
        x, y = self.pointer
        subprocess.run(["xdotool", "keyup", *_MODIFIERS, "mouseup", "1", "mouseup", "2", "mouseup", "3",
                        "mousemove", str(x), str(y)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=10, check=False)
        return {"status": "ok", "killed": killed, "removed": removed, "restored": restored,
                "seconds": round(time.monotonic() - t0, 4)}

    def _kill_others(self) -> int:
        """SIGKILL every process outside the base set, in rounds (a dying shell may have forked), and reap
        our own children; RuntimeError when some are still alive after RESET_KILL_DEADLINE_S."""
        killed: set[int] = set()
        deadline = time.monotonic() + RESET_KILL_DEADLINE_S
        while True:
            alive = []
            for pid in _pids() - self.pids:
                info = _parent_and_state(pid)
                if info is None:
                    continue
                if info[1] == "Z":  # a zombie: reap it if it is ours (PID 1 reaps the rest)
                    if info[0] == os.getpid():
                        try:
                            os.waitpid(pid, os.WNOHANG)
                        except ChildProcessError:
                            pass
                    continue
                alive.append(pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except ProcessLookupError:
                    pass
            if not alive:
                return len(killed)
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {sorted(alive)} survived SIGKILL for {RESET_KILL_DEADLINE_S:g} s")
            time.sleep(0.01)

    def _restore_files(self) -> tuple[int, int]:
        """Delete paths under RESET_ROOTS that did not exist at start; rewrite /root files that changed."""
        removed = restored = 0
        for root in RESET_ROOTS:
            for folder, dirs, files in os.walk(root, topdown=True):
                for name in list(dirs):
                    path = os.path.join(folder, name)
                    if path not in self.paths:
                        dirs.remove(name)
                        if os.path.islink(path):
                            os.unlink(path)
                        else:
                            shutil.rmtree(path, ignore_errors=True)
                        removed += 1
                for name in files:
                    path = os.path.join(folder, name)
                    if path not in self.paths:
                        os.unlink(path)
                        removed += 1
        for folder in self.home_dirs:
            os.makedirs(folder, exist_ok=True)
        for path, data in self.files.items():
            try:
                with open(path, "rb") as f:
                    same = f.read() == data
            except OSError:
                same = False
            if not same:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(data)
                restored += 1
        return removed, restored


_boot: BootState | None = None  # set by serve() before the first request


def screenshot_params(query: str) -> tuple[str, int]:
    """``format`` and ``quality`` from a /screenshot query string; ValueError on a bad value."""
    q = urllib.parse.parse_qs(query)
    fmt = (q.get("format") or ["png"])[0].lower()
    if fmt == "jpg":
        fmt = "jpeg"
    if fmt not in SCREENSHOT_FORMATS:
        raise ValueError(f"format must be one of {', '.join(SCREENSHOT_FORMATS)}, got {fmt!r}")
    raw = (q.get("quality") or [str(DEFAULT_JPEG_QUALITY)])[0]
    try:
        quality = int(raw)
    except ValueError:
        raise ValueError(f"quality must be an integer 1..100, got {raw!r}") from None
    if not 1 <= quality <= 100:
        raise ValueError(f"quality must be an integer 1..100, got {quality}")
    return fmt, quality


def screen_size() -> tuple[int, int]:
    return ImageGrab.grab(xdisplay=DISPLAY).size


def x_is_up() -> bool:
    try:
        return subprocess.run(["xdpyinfo", "-display", DISPLAY], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=5, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _normalise_command(command, shell: bool):
    """OSWorld's rules: a string without shell is shlex-split; '~/' arguments are expanded."""
    if command is None:
        command = "" if shell else []
    if isinstance(command, str) and not shell:
        command = shlex.split(command)
    if isinstance(command, list):
        command = [os.path.expanduser(a) if isinstance(a, str) and a.startswith("~/") else a for a in command]
    return command


def run_command(command, shell: bool, timeout: float) -> tuple[int, dict]:
    """Run to completion in its own session; on timeout kill the whole process group."""
    command = _normalise_command(command, shell)
    try:
        proc = subprocess.Popen(command, shell=shell, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    except Exception as exc:  # noqa: BLE001 - reported to the caller in OSWorld's error shape
        return 500, {"status": "error", "message": str(exc), "output": "", "error": str(exc), "returncode": -1}
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        msg = f"command timed out after {timeout:g} s"
        return 500, {"status": "error", "message": msg, "output": out.decode("utf-8", "replace"),
                     "error": err.decode("utf-8", "replace") + msg, "returncode": -9}
    return 200, {"status": "success", "output": out.decode("utf-8", "replace"),
                 "error": err.decode("utf-8", "replace"), "returncode": proc.returncode}


def launch(command, shell: bool) -> None:
    command = _normalise_command(command, shell)
    subprocess.Popen(command, shell=shell, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True)


def find_windows(name: str, strict: bool) -> list[str]:
    """Visible window ids whose title contains ``name`` (or equals it when strict)."""
    pattern = "^" + _regex_escape(name) + "$" if strict else _regex_escape(name)
    res = subprocess.run(["xdotool", "search", "--onlyvisible", "--name", pattern],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=10, check=False)
    return res.stdout.decode().split()


def _regex_escape(text: str) -> str:
    return "".join("\\" + c if c in ".^$*+?()[]{}|\\" else c for c in text)


def parse_multipart(content_type: str, body: bytes) -> dict[str, bytes]:
    """Form fields of a multipart/form-data body -> {name: raw bytes}."""
    msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body)
    fields: dict[str, bytes] = {}
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if name is not None:
            fields[name] = part.get_payload(decode=True) or b""
    return fields


class Handler(BaseHTTPRequestHandler):
    server_version = "arpo-controller/1"
    protocol_version = "HTTP/1.1"

    # --- plumbing -------------------------------------------------------------------------------
    def address_string(self) -> str:  # Unix-socket peers have no address
        return "unix"

    def log_message(self, fmt: str, *args) -> None:
        if os.environ.get("ARPO_CONTROLLER_LOG"):
            sys.stderr.write("controller: " + (fmt % args) + "\n")

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY_BYTES:
            raise ValueError(f"request body of {n} bytes exceeds {MAX_BODY_BYTES}")
        return self.rfile.read(n) if n else b""

    def _json_body(self) -> dict:
        body = self._body()
        data = json.loads(body) if body else {}
        if not isinstance(data, dict):
            raise TypeError("request body must be a JSON object")
        return data

    def _form(self) -> dict[str, bytes]:
        ctype = self.headers.get("Content-Type", "")
        body = self._body()
        if ctype.startswith("multipart/form-data"):
            return parse_multipart(ctype, body)
        return {k: v[0].encode() for k, v in urllib.parse.parse_qs(body.decode("utf-8")).items()}

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, code: int, obj) -> None:
        self._send(code, json.dumps(obj).encode(), "application/json")

    def _text(self, code: int, text: str) -> None:
        self._send(code, text.encode(), "text/plain; charset=utf-8")

    def _dispatch(self, routes: dict) -> None:
        path = urllib.parse.urlsplit(self.path).path
        fn = routes.get(path)
        if fn is None:
            self._json(404, {"status": "error", "message": f"no route {self.command} {path}"})
            return
        try:
            fn(self)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as exc:  # noqa: BLE001 - every failure becomes a 500 with its message
            self._json(500, {"status": "error", "message": f"{type(exc).__name__}: {exc}"})

    def do_GET(self) -> None:
        self._dispatch(GET_ROUTES)

    def do_POST(self) -> None:
        self._dispatch(POST_ROUTES)

    # --- endpoints ------------------------------------------------------------------------------
    def screenshot(self) -> None:
        try:
            fmt, quality = screenshot_params(urllib.parse.urlsplit(self.path).query)
        except ValueError as exc:
            self._json(400, {"status": "error", "message": str(exc)})
            return
        self._send(200, grab_screen(fmt, quality), f"image/{fmt}")

    def execute(self) -> None:
        data = self._json_body()
        shell = bool(data.get("shell", False))
        timeout = float(data.get("timeout") or DEFAULT_TIMEOUT_S)
        code, obj = run_command(data.get("command"), shell, timeout)
        self._json(code, obj)

    def launch(self) -> None:
        data = self._json_body()
        shell = bool(data.get("shell", False))
        command = data.get("command")
        try:
            launch(command, shell)
        except Exception as exc:  # noqa: BLE001
            self._json(500, {"status": "error", "message": str(exc)})
            return
        shown = command if shell or isinstance(command, str) else " ".join(map(str, command or []))
        self._text(200, f"{shown} launched successfully")

    def file(self) -> None:
        form = self._form()
        if "file_path" not in form:
            self._json(400, {"error": "file_path is required"})
            return
        path = os.path.expandvars(os.path.expanduser(form["file_path"].decode()))
        try:
            with open(path, "rb") as f:
                data = f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            self._json(404, {"error": "File not found"})
            return
        self._send(200, data, "application/octet-stream")

    def upload(self) -> None:
        form = self._form()
        if "file_path" not in form or "file_data" not in form:
            self._json(400, {"error": "file_path and file_data are required"})
            return
        path = os.path.expandvars(os.path.expanduser(form["file_path"].decode()))
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(form["file_data"])
        self._text(200, f"File Uploaded: {len(form['file_data'])} bytes")

    def screen_size(self) -> None:
        self._body()
        w, h = screen_size()
        self._json(200, {"width": w, "height": h})

    def cursor_position(self) -> None:
        x, y = pointer().position()
        self._json(200, [x, y])

    def platform(self) -> None:
        self._text(200, "Linux")

    def health(self) -> None:
        if x_is_up():
            self._json(200, {"status": "ok", "display": DISPLAY})
        else:
            self._json(503, {"status": "error", "message": f"X display {DISPLAY} does not answer"})

    def reset(self) -> None:
        self._body()
        self._json(200, _boot.reset())  # a failure (a process survived, a file cannot be restored) -> 500

    def activate_window(self) -> None:
        data = self._json_body()
        name = data.get("window_name")
        if not name:
            self._text(400, "window_name required")
            return
        ids = find_windows(name, bool(data.get("strict", False)))
        if not ids:
            self._text(404, f"Window {name} not found")
            return
        subprocess.run(["xdotool", "windowactivate", "--sync", ids[0]], timeout=10,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        self._text(200, "Window activated successfully")

    def close_window(self) -> None:
        data = self._json_body()
        name = data.get("window_name")
        if not name:
            self._text(400, "window_name required")
            return
        ids = find_windows(name, bool(data.get("strict", False)))
        if not ids:
            self._text(404, f"Window {name} not found")
            return
        for wid in ids:
            subprocess.run(["xdotool", "windowclose", wid], timeout=10,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        self._text(200, "Window closed successfully")


GET_ROUTES = {
    "/screenshot": Handler.screenshot,
    "/cursor_position": Handler.cursor_position,
    "/platform": Handler.platform,
    "/health": Handler.health,
}
POST_ROUTES = {
    "/execute": Handler.execute,
    "/setup/execute": Handler.execute,
    "/setup/launch": Handler.launch,
    "/file": Handler.file,
    "/setup/upload": Handler.upload,
    "/screen_size": Handler.screen_size,
    "/setup/activate_window": Handler.activate_window,
    "/setup/close_window": Handler.close_window,
    "/reset": Handler.reset,
}


class UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class TCPHTTPServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True


def serve() -> None:
    global _boot
    _boot = BootState()  # before the first request: only the base processes and the boot files exist
    tcp = os.environ.get("ARPO_CONTROLLER_TCP")
    if tcp:
        host, _, port = tcp.rpartition(":")
        server: socketserver.BaseServer = TCPHTTPServer((host or "0.0.0.0", int(port)), Handler)
    else:
        os.makedirs(os.path.dirname(SOCKET_PATH), exist_ok=True)
        try:
            os.unlink(SOCKET_PATH)
        except FileNotFoundError:
            pass
        # Bind under a temporary name and rename, so the host never connects to a half-set-up socket.
        tmp = SOCKET_PATH + ".tmp"
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        server = UnixHTTPServer(tmp, Handler)
        os.chmod(tmp, 0o666)
        os.rename(tmp, SOCKET_PATH)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    sys.stderr.write(f"controller: serving on {tcp or SOCKET_PATH} for display {DISPLAY} "
                     f"(pid {os.getpid()}, {time.strftime('%H:%M:%S')})\n")
    server.serve_forever(poll_interval=0.5)


if __name__ == "__main__":
    serve()
