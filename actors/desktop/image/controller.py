#!/usr/bin/env python3
"""In-container desktop controller: OSWorld's controller HTTP API over a Unix socket.

Runs INSIDE the desktop container with Debian's python3, the standard library, PIL and python3-xlib (and
python3-pyatspi, run in a child process, for the accessibility routes). It owns the X display ``$DISPLAY``
(started by entrypoint.sh) and serves, on the Unix socket ``$ARPO_CONTROLLER_SOCKET`` (default
/run/arpo/controller.sock, mode 0660, in a folder bind-mounted from the host), OSWorld's
``desktop_env/server/main.py`` API as OSWorld's own PythonController and SetupController call it
(desktop_env/controllers/python.py, setup.py), with OSWorld's request and response shapes. Modules:
limits.py (limits, budget, errors), processes.py (running commands), x11windows.py (windows, wmctrl's
matching rules), accessibility.py (the AT-SPI tree), recording.py (ffmpeg), osworld_routes.py (the routes
marked [o] below).

    GET  /screenshot            -> PNG bytes of the whole screen, cursor drawn in (compress_level 1);
                                   ours: optional query ?format=png|jpeg&quality=1..100 (JPEG quality,
                                   default 85; ignored for PNG); 400 on a bad value
    POST /execute, /setup/execute {"command": list|str, "shell": bool, "timeout"?: s}
                                -> {"status": "success", "output", "error", "returncode"}
                                   or HTTP 500 {"status": "error", "message", "output", "error", "returncode"};
                                   ours: output and error keep at most MAX_OUTPUT_BYTES each, and a response
                                   that lost bytes also has "truncated": true, "output_bytes", "error_bytes"
                                   (the full sizes the command wrote)
    POST /setup/launch          {"command", "shell"} -> text; does not wait for the process
    POST /file                  form file_path -> file bytes; 404 {"error": "File not found"} (also for a
                                   folder); ours: 400 for anything but a regular file (a device, a FIFO, a
                                   socket), 413 for a file over MAX_FILE_BYTES
    POST /setup/upload          multipart file_path + file_data -> text; ours: 400 when file_path exists and is
                                   not a regular file
    POST /screen_size           -> {"width", "height"}
    GET  /cursor_position       -> [x, y]
    GET  /platform              -> "Linux"
    POST /setup/activate_window {"window_name", "strict"?, "by_class"?} -> text; the first window wmctrl -a would
                                   pick (title contains the name, case-insensitive; strict: equals it,
                                   case-sensitive; by_class: "res_name.res_class" of WM_CLASS instead of the
                                   title; x11windows.py); ours: 404 when there is none (OSWorld answers 200)
    POST /setup/close_window    {"window_name", "strict"?, "by_class"?} -> text; closes the first such window
                                   gracefully (_NET_CLOSE_WINDOW, as wmctrl -c); ours: 404 when there is none
[o] GET  /accessibility         -> {"AT": XML of the AT-SPI tree, built as OSWorld's server builds it
                                   (accessibility.py)}; ours: 501 where pyatspi or the AT-SPI bus is missing
[o] GET  /terminal              -> {"output": text of the focused terminal of the active window, or null,
                                   "status": "success"}; 501 as /accessibility
[o] POST /start_recording       -> {"status": "success", "message"}; 400 when one runs, 500 when ffmpeg fails
                                   (ffmpeg x11grab into /tmp/recording.mp4; recording.py); ours: 501 where
                                   ffmpeg is missing (the default image; the osworld image has it)
[o] POST /end_recording         -> the MP4's bytes (video/mp4); 400 when none runs, 500 when it is empty
[o] POST /window_size           form app_class_name -> {"width", "height"} of the first window with that
                                   WM_CLASS part; 400 without the field; ours: 404 when none (OSWorld: 500)
[o] POST /desktop_path          -> {"desktop_path": "$HOME/Desktop"}; 404 {"error"} when it does not exist
[o] POST /wallpaper             -> the bytes of the file gsettings' org.gnome.desktop.background picture-uri
                                   names (image/png); 404 when unset; ours: 501 where gsettings is missing
[o] POST /list_directory        {"path"} -> {"directory_tree": {"type": "directory", "name", "children": [...,
                                   {"type": "file", "name"}]}}; 400 {"error"} without a path or for a file;
                                   ours: names sorted, symlink loops cut, 413 above 100000 entries
[o] POST /setup/change_wallpaper {"path"} -> text; 400 without a path, 404 when the file is missing
                                   (gsettings set ... picture-uri file://PATH); ours: 500 when gsettings fails
[o] POST /setup/open_file       {"path", "window_name"?, "timeout_seconds"? (1800)} -> text once a window whose
                                   title contains window_name (default: the file name, with or without its
                                   extension) appears, then activated; an existing file opens with xdg-open,
                                   else path must be a program on PATH (404 otherwise); 500 on timeout;
                                   ours: waits at most 300 s, fails at once when the opener exits non-zero
[o] POST /setup/download_file   {"url", "path"} -> text; 3 tries; 500 with the error (ours: it says that the
                                   desktop has no network; http(s) only; at most MAX_BODY_BYTES)
[o] POST /run_python            {"code"} -> {"status", "message", "need_more": false, "output", "error",
                                   "return_code"} (python3 on a temporary file, 30 s; 500 on timeout)
[o] POST /run_bash_script       {"script", "timeout"? (100), "working_dir"?} -> {"status", "output" (stdout and
                                   stderr merged), "error": "", "returncode"}; 400 for a missing script or
                                   folder, 500 on timeout
[o] POST /execute_with_verification, /setup/execute_with_verification {"command", "shell", "verification"?:
                                   {"window_exists"?, "command_success"?}, "max_wait_time"? (10),
                                   "check_interval"? (1)} -> /execute's answer, + "verification": "passed",
                                   "wait_time"; 500 "verification_failed" when not met in time
    GET  /health                -> {"status": "ok", "display"} once X answers, else 503 (ours)
    POST /reset                 -> {"status": "ok", "killed", "removed", "restored", "seconds"} (ours): puts the
                                   desktop back to its state when the controller started (see BootState),
                                   so one container can serve many episodes; 500 when it cannot

In-place reset (ours; OSWorld reverts a VM snapshot instead): at start the controller records the
desktop's base processes (every process alive then: PID 1, itself, Xvfb, openbox, the session D-Bus and the
AT-SPI bus) and every path under /root and /tmp, with the bytes of /root's files. POST /reset kills every
other process (apps, terminals and their children), deletes the paths that did not exist at start, rewrites
/root's files that changed, releases modifier keys and mouse buttons and puts the pointer back where it was; a
screen recording is stopped and its file deleted. It kills every process outside the base set, commands of
other requests still running included, so call it only on a desktop no episode is using (DesktopPool resets
released desktops). State outside /root and /tmp (a file an agent wrote to /etc, say) is not restored: the
pool bounds how many episodes a container serves (actors.desktop_max_episodes).

Limits (ours; OSWorld's server has none). Every request body needs a Content-Length (411 without one, 400
when it is not a plain non-negative integer or a Transfer-Encoding is sent, 413 above the limit); errors are
JSON {"status": "error", "message"} and close the connection. Environment variables, in MiB (fractions allowed):

    ARPO_MAX_BODY_MB    64  largest request body (a /setup/upload); JSON and url-encoded bodies: ARPO_MAX_JSON_MB
    ARPO_MAX_JSON_MB     1  largest JSON or url-encoded request body (parsed into Python objects, ~30x its size)
    ARPO_MAX_FILE_MB    64  largest file /file, /wallpaper and /end_recording send (and the recording's cap),
                            and largest accessibility tree
    ARPO_MAX_OUTPUT_MB   1  stdout and stderr kept by /execute, each (the rest is read and dropped)

The fleet sets the body and file limits from the container's memory limit (an eighth of it, at most 64).
Requests also share a memory budget (:data:`BUDGET_BYTES`, twice the larger of the body and file limits): a
body, a file read or an /execute answer reserves its worst-case size first and waits (up to
BUDGET_WAIT_S, then 503) while others hold it, so concurrent requests cannot add up past the container's memory.
Commands run with oom_score_adj 1000, so when they exhaust the container's memory the kernel kills them, not
the controller, Xvfb or openbox.

Invariants: every request is handled on its own thread; commands run with DISPLAY set and in their own
session so a timeout kills the whole process group; PID 1 is docker's init (tini), which reaps orphans.
The desktop runs with no capability but CAP_SETGID (actors/desktop/fleet.py): root in here cannot override
file modes, so /reset restores boot modes and opens up folders before deleting or rewriting in them.
Set ARPO_CONTROLLER_TCP=host:port to listen on TCP instead (a container with a network).
"""
from __future__ import annotations

import base64
import contextlib
import ctypes
import ctypes.util
import email.parser
import email.policy
import errno
import io
import json
import os
import quopri
import re
import shutil
import signal
import socketserver
import stat
import subprocess
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler

from PIL import ImageDraw, ImageGrab

import osworld_routes
import x11windows
from limits import (
    ANSWER_EXPANSION, BODY_EXPANSION, DEFAULT_TIMEOUT_S, DISPLAY, DRAIN_MAX_BYTES, IO_TIMEOUT_S, JSON_EXPANSION,
    MAX_BODY_BYTES, MAX_FILE_BYTES, MAX_JSON_BYTES, MIB, MULTIPART_HEADER_MAX, SOCKET_PATH, HTTPError, budget,
    read_regular_file,
)
from processes import launch, run_command



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

    Must be created before the first request is served: then the only processes are the base ones entrypoint.sh
    started (PID 1, the controller, Xvfb, openbox, and where installed the session D-Bus and the AT-SPI bus),
    and no task has touched /root or /tmp. Every process alive then is a base process.
    """

    def __init__(self) -> None:
        self.pids = _pids() | {1, os.getpid()}
        self.paths: set[str] = set()
        self.home_dirs: list[str] = []  # folders under /root, parents first: recreated when an episode deleted them
        self.files: dict[str, bytes] = {}
        self.modes: dict[str, int] = {}  # permission bits of every boot folder and of the files in self.files
        for root in RESET_ROOTS:
            for folder, dirs, files in os.walk(root):
                self.paths.add(folder)
                self.modes[folder] = stat.S_IMODE(os.lstat(folder).st_mode)
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
                        self.modes[path] = stat.S_IMODE(os.lstat(path).st_mode)
        self.pointer = pointer().position()

    def reset(self) -> dict:
        """Put the desktop back to this state; returns counts and seconds. RuntimeError when a process survives."""
        t0 = time.monotonic()
        osworld_routes.on_reset()  # a running screen recording stops (its file is deleted below)
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

    def _restore_modes(self) -> None:
        """Give boot folders and restored files their boot permission bits back (an episode may have made a
        folder unwritable: without CAP_DAC_OVERRIDE root could then not delete in it)."""
        for path, mode in self.modes.items():
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if not stat.S_ISLNK(st.st_mode) and stat.S_IMODE(st.st_mode) != mode:
                os.chmod(path, mode)

    def _restore_files(self) -> tuple[int, int]:
        """Delete paths under RESET_ROOTS that did not exist at start; rewrite /root files that changed."""
        removed = restored = 0
        self._restore_modes()
        for root in RESET_ROOTS:
            for folder, dirs, files in os.walk(root, topdown=True):
                for name in list(dirs):
                    path = os.path.join(folder, name)
                    if path not in self.paths:
                        dirs.remove(name)
                        if os.path.islink(path):
                            os.unlink(path)
                        else:
                            _rmtree(path)
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
                if os.path.lexists(path) and not os.path.islink(path):
                    os.chmod(path, 0o600)  # it may have been made read-only
                with open(path, "wb") as f:
                    f.write(data)
                restored += 1
        self._restore_modes()
        return removed, restored


def _rmtree(path: str) -> None:
    """Delete a folder tree. Root here has no CAP_DAC_OVERRIDE, so a folder an episode made unreadable or
    unwritable (chmod 000) would stop shutil.rmtree: on failure give every folder below its owner's rwx and
    try again; a tree that still survives makes the caller's next check (or the next reset) see it."""
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.lexists(path):
        return
    stack = [path]
    while stack:
        folder = stack.pop()
        try:
            st = os.lstat(folder)
            if not stat.S_ISDIR(st.st_mode):
                continue
            if st.st_mode & 0o700 != 0o700:
                os.chmod(folder, stat.S_IMODE(st.st_mode) | 0o700)
            with os.scandir(folder) as entries:
                stack.extend(e.path for e in entries if e.is_dir(follow_symlinks=False))
        except OSError:
            continue
    shutil.rmtree(path, ignore_errors=True)


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



def parse_multipart(content_type: str, body: bytes) -> dict[str, bytes]:
    """Form fields of a multipart/form-data body -> {name: raw bytes}; ValueError when it is malformed.

    Cuts each part out of ``body`` once (the email package would hold several copies of a large upload);
    only part headers go through the email package. Base64 and quoted-printable parts are decoded.
    """
    ctype = email.parser.BytesHeaderParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n")
    boundary = ctype.get_param("boundary", header="content-type")
    if not boundary or not isinstance(boundary, str):
        raise ValueError("multipart/form-data without a boundary")
    delimiter = b"--" + boundary.encode("latin-1")
    pos = body.find(delimiter)
    if pos < 0:
        raise ValueError("multipart body without its boundary")
    fields: dict[str, bytes] = {}
    while True:
        pos += len(delimiter)
        if body.startswith(b"--", pos):  # the closing delimiter
            return fields
        line_end = body.find(b"\r\n", pos)  # the rest of the delimiter line (transport padding)
        if line_end < 0:
            raise ValueError("multipart part without headers")
        start = line_end + 2
        if body.startswith(b"\r\n", start):
            raw_headers, data_start = b"", start + 2
        else:
            head_end = body.find(b"\r\n\r\n", start, start + MULTIPART_HEADER_MAX)
            if head_end < 0:
                raise ValueError("multipart part headers do not end (or exceed 16 KiB)")
            raw_headers, data_start = body[start:head_end], head_end + 4
        end = body.find(b"\r\n" + delimiter, data_start)
        if end < 0:
            raise ValueError("multipart body is not terminated by its boundary")
        headers = email.parser.BytesHeaderParser(policy=email.policy.HTTP).parsebytes(raw_headers + b"\r\n\r\n")
        name = headers.get_param("name", header="content-disposition")
        if name is not None:
            data = body[data_start:end]
            encoding = str(headers.get("content-transfer-encoding", "")).strip().lower()
            if encoding == "base64":
                data = base64.b64decode(data)
            elif encoding == "quoted-printable":
                data = quopri.decodestring(data)
            fields[str(name)] = data
        pos = end + 2


_DIGITS = re.compile(r"[0-9]+")


def content_length(headers, method: str) -> int:
    """The request's body length from its headers, checked; HTTPError (400, 411, 413) when it is missing for a
    method with a body, is not a plain non-negative integer, disagrees with itself, or exceeds MAX_BODY_BYTES."""
    if headers.get("Transfer-Encoding") is not None:
        raise HTTPError(411 if headers.get("Content-Length") is None else 400,
                        "Transfer-Encoding is not supported: send the body with a Content-Length")
    values = headers.get_all("Content-Length") or []
    if not values:
        if method in ("POST", "PUT", "PATCH"):
            raise HTTPError(411, f"{method} needs a Content-Length header (0 for no body)")
        return 0
    if len({v.strip() for v in values}) != 1:
        raise HTTPError(400, f"conflicting Content-Length headers: {values}")
    raw = values[0].strip()
    if not _DIGITS.fullmatch(raw):
        raise HTTPError(400, f"Content-Length must be a non-negative integer, got {raw[:40]!r}")
    n = int(raw)
    if n > MAX_BODY_BYTES:
        raise HTTPError(413, f"request body of {n} bytes exceeds the controller's limit of {MAX_BODY_BYTES} bytes "
                             "(ARPO_MAX_BODY_MB)")
    return n


def _is_form(ctype: str) -> bool:
    return ctype.split(";", 1)[0].strip().lower() == "multipart/form-data"



class Handler(BaseHTTPRequestHandler):
    server_version = "arpo-controller/1"
    protocol_version = "HTTP/1.1"
    timeout = IO_TIMEOUT_S  # set on the connection: an idle or stalled one is closed, its thread freed

    # --- plumbing -------------------------------------------------------------------------------
    def address_string(self) -> str:  # Unix-socket peers have no address
        return "unix"

    def log_message(self, fmt: str, *args) -> None:
        if os.environ.get("ARPO_CONTROLLER_LOG"):
            sys.stderr.write("controller: " + (fmt % args) + "\n")

    def _body(self) -> bytes:
        """The request body, read (and checked) by _dispatch before the endpoint runs."""
        return self._raw

    def _json_body(self) -> dict:
        body = self._body()
        data = json.loads(body) if body else {}
        if not isinstance(data, dict):
            raise TypeError("request body must be a JSON object")
        return data

    def _form(self) -> dict[str, bytes]:
        ctype = self.headers.get("Content-Type", "")
        body = self._body()
        if _is_form(ctype):
            try:
                return parse_multipart(ctype, body)
            except ValueError as exc:
                raise HTTPError(400, f"bad multipart/form-data body: {exc}") from None
        return {k: v[0].encode() for k, v in urllib.parse.parse_qs(body.decode("utf-8")).items()}

    def _send(self, code: int, body: bytes | bytearray, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _json(self, code: int, obj) -> None:
        self._send(code, json.dumps(obj).encode(), "application/json")

    def _text(self, code: int, text: str) -> None:
        self._send(code, text.encode(), "text/plain; charset=utf-8")

    def _refuse(self, code: int, message: str, **extra) -> None:
        """A JSON error; closes the connection when the request's body was not read (it would be taken for the
        next request)."""
        if not self._body_read:
            self.close_connection = True
        self._json(code, {"status": "error", "message": message, **extra})

    def _read_body(self, n: int) -> bytes:
        data = self.rfile.read(n) if n else b""
        if len(data) != n:
            raise HTTPError(400, f"request body ended after {len(data)} of its {n} bytes")
        self._body_read = True
        return data

    def _declared_length(self) -> int:
        """The Content-Length as sent when it is a plain integer (even over the limit), else 0."""
        raw = (self.headers.get("Content-Length") or "").strip()
        return int(raw) if _DIGITS.fullmatch(raw) and self.headers.get("Transfer-Encoding") is None else 0

    def _drain(self, n: int) -> None:
        """Read and drop a refused body in small chunks (a client writing it would otherwise fail with a
        broken pipe before it reads our answer); the connection is closed afterwards anyway."""
        try:
            while n > 0:
                chunk = self.rfile.read(min(n, 65536))
                if not chunk:
                    break
                n -= len(chunk)
        except OSError:
            pass

    def release_body(self) -> None:
        """Give the body's memory reservation back early (an endpoint that keeps nothing of it)."""
        self._hold.close()

    def _dispatch(self, routes: dict) -> None:
        path = urllib.parse.urlsplit(self.path).path
        fn = routes.get(path)
        self._raw, self._body_read, n = b"", False, 0
        self._hold = contextlib.ExitStack()
        try:
            with self._hold:
                n = content_length(self.headers, self.command)
                multipart = _is_form(self.headers.get("Content-Type", ""))
                if n > MAX_JSON_BYTES and not multipart:
                    raise HTTPError(413, f"a request body that is not multipart/form-data may have at most "
                                         f"{MAX_JSON_BYTES} bytes (ARPO_MAX_JSON_MB); this one has {n}")
                if fn is None:
                    raise HTTPError(404, f"no route {self.command} {path}")
                self._body_read = n == 0
                self._hold.enter_context(budget.hold(n * (BODY_EXPANSION if multipart else JSON_EXPANSION)))
                self._raw = self._read_body(n)
                fn(self)
        except HTTPError as exc:
            if not self._body_read and 0 < (n or self._declared_length()) <= DRAIN_MAX_BYTES:
                self._drain(n or self._declared_length())
            self._refuse(exc.status, str(exc), **exc.extra)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as exc:  # noqa: BLE001 - every failure becomes a 500 with its message
            self._refuse(500, f"{type(exc).__name__}: {exc}")
        finally:
            self._raw = b""

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
        self.release_body()  # the command may run for minutes: hold no reservation meanwhile
        shell = bool(data.get("shell", False))
        timeout = float(data.get("timeout") or DEFAULT_TIMEOUT_S)
        code, obj = run_command(data.get("command"), shell, timeout)
        captured = len(obj.get("output", "")) + len(obj.get("error", ""))
        with budget.hold(ANSWER_EXPANSION * captured):
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
            size = os.stat(path).st_size
        except OSError:
            size = 0  # read_regular_file says why
        with budget.hold(min(max(size, MIB), MAX_FILE_BYTES)):
            data = read_regular_file(path, MAX_FILE_BYTES)
            self._send(200, data, "application/octet-stream")

    def upload(self) -> None:
        form = self._form()
        if "file_path" not in form or "file_data" not in form:
            self._json(400, {"error": "file_path and file_data are required"})
            return
        path = os.path.expandvars(os.path.expanduser(form["file_path"].decode()))
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        # O_NONBLOCK: opening a FIFO with no reader fails at once (ENXIO) instead of blocking this thread
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                raise HTTPError(400, f"cannot upload to {path}: not a regular file") from None
            raise
        with open(fd, "wb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise HTTPError(400, f"cannot upload to {path}: not a regular file")
            os.set_blocking(fd, True)
            f.truncate(0)
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

    def _window(self) -> x11windows.Window | None:
        """The window a /setup/activate_window or /setup/close_window request names (x11windows: wmctrl's rules
        for strict and by_class); answers 400 itself and returns None when window_name is missing."""
        data = self._json_body()
        name = data.get("window_name")
        if not name:
            self._text(400, "window_name required")
            return None
        window = x11windows.find(DISPLAY, str(name), strict=bool(data.get("strict", False)),
                                 by_class=bool(data.get("by_class", False)))
        if window is None:
            raise HTTPError(404, f"Window {name} not found")
        return window

    def activate_window(self) -> None:
        window = self._window()
        if window is not None:
            x11windows.activate(window)
            self._text(200, "Window activated successfully")

    def close_window(self) -> None:
        window = self._window()
        if window is not None:
            x11windows.close(DISPLAY, window)
            self._text(200, "Window closed successfully.")


GET_ROUTES = {
    "/screenshot": Handler.screenshot,
    "/cursor_position": Handler.cursor_position,
    "/platform": Handler.platform,
    "/health": Handler.health,
    **osworld_routes.GET_ROUTES,
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
    **osworld_routes.POST_ROUTES,
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
        os.chmod(tmp, 0o660)  # root (the host's actors) only; the folder is 0700 besides
        os.rename(tmp, SOCKET_PATH)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    sys.stderr.write(f"controller: serving on {tcp or SOCKET_PATH} for display {DISPLAY} "
                     f"(pid {os.getpid()}, {time.strftime('%H:%M:%S')})\n")
    server.serve_forever(poll_interval=0.5)


if __name__ == "__main__":
    serve()
