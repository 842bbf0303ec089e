"""The controller's routes that OSWorld's host-side clients call beyond the actors' core set.

Each route mirrors OSWorld desktop_env/server/main.py (its request and response shapes, its status codes) and is
called by OSWorld's PythonController or SetupController (desktop_env/controllers/python.py, setup.py); routes.py's
docstring lists them (marked [o]) with their shapes, and where ours departs ("ours"). Views are plain functions
``view(request) -> Response``: they take server.Request (its ``json_object``, ``form_fields``, ``release_body``,
``reserve``), return server.py's answers and run under server.App's hardening: body limits, the memory budget,
errors as JSON. Standard library, python3-werkzeug, python3-xlib and (for /accessibility and /terminal)
python3-pyatspi only.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

from werkzeug.wrappers import Response

import accessibility
import x11windows
from limits import DISPLAY, MAX_BODY_BYTES, MAX_FILE_BYTES, MAX_OUTPUT_BYTES, HTTPError, budget, read_regular_file
from processes import launch, run_command
from recording import NoFfmpeg, Recorder, RecordingError
from server import Request, bytes_answer, json_answer, text_answer

ANSWER_EXPANSION = 8  # a text answer of n bytes: the str, its JSON and the bytes sent
OPEN_FILE_DEFAULT_S = 1800.0  # OSWorld's TIMEOUT for /setup/open_file
OPEN_FILE_MAX_S = 300.0  # ours: no request waits longer for a window
OPEN_FILE_POLL_S = 0.2
DOWNLOAD_TIMEOUT_S = 60.0
DOWNLOAD_TRIES = 3
RUN_PYTHON_TIMEOUT_S = 30.0
RUN_BASH_DEFAULT_S = 100.0
LIST_DIRECTORY_MAX_ENTRIES = 100_000
WALLPAPER_KEY = ("org.gnome.desktop.background", "picture-uri")
NO_NETWORK_HINT = ("this desktop has no network: a task's `download` setup step fetches on the actor host and "
                   "uploads the file instead")

ACCESSIBILITY_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "accessibility.py")

recorder = Recorder(DISPLAY, MAX_FILE_BYTES)
_accessibility_lock = threading.Lock()


def on_reset() -> None:
    """What /reset must undo here besides processes and files: a running recording."""
    recorder.stop_quietly()


def _expand(path: str) -> str:
    return os.path.expandvars(os.path.expanduser(path))


def _large_json(request: Request, obj) -> Response:
    """A JSON answer whose size is not known in advance (a tree): reserved from the budget once it is built."""
    body = json.dumps(obj).encode()
    request.reserve(len(body))
    return bytes_answer(body, "application/json")


def _file_answer(request: Request, path: str, content_type: str) -> Response:
    try:
        size = os.stat(path).st_size
    except OSError:
        size = 0
    request.reserve(min(max(size, 1 << 20), MAX_FILE_BYTES))
    return bytes_answer(read_regular_file(path, MAX_FILE_BYTES), content_type)


# --- accessibility and terminal --------------------------------------------------------------------------

def _accessibility(what: str) -> str:
    """Run accessibility.py ``what`` (one at a time) and return its stdout; HTTPError 501 when AT-SPI is
    unavailable, 500 when the walk fails or passes its deadline."""
    with _accessibility_lock, budget.hold(MAX_FILE_BYTES):
        status, res = run_command([sys.executable, ACCESSIBILITY_SCRIPT, what], False,
                                  accessibility.DEADLINE_S + 30, cap=MAX_FILE_BYTES)
    if status == 200 and res["returncode"] == 3:
        raise HTTPError(501, res["error"].strip())
    if status != 200 or res["returncode"] != 0:
        raise HTTPError(500, f"reading the accessibility tree failed: {(res.get('error') or '')[-2000:]}")
    return res["output"]


def get_accessibility(request: Request) -> Response:
    return _large_json(request, {"AT": _accessibility("tree")})


def get_terminal(request: Request) -> Response:
    output = json.loads(_accessibility("terminal"))["output"]
    return json_answer(200, {"output": output, "status": "success"})


# --- recording ---------------------------------------------------------------------------------------------

def start_recording(request: Request) -> Response:
    try:
        recorder.start(*x11windows.screen_size(DISPLAY))
    except NoFfmpeg as exc:
        raise HTTPError(501, str(exc)) from None
    except RecordingError as exc:
        return json_answer(exc.status, {"status": "error", "message": str(exc)})
    return json_answer(200, {"status": "success", "message": "Started recording successfully."})


def end_recording(request: Request) -> Response:
    try:
        path = recorder.stop()
    except RecordingError as exc:
        return json_answer(exc.status, {"status": "error", "message": str(exc)})
    return _file_answer(request, path, "video/mp4")


# --- windows, desktop, wallpaper, folders ------------------------------------------------------------------

def window_size(request: Request) -> Response:
    form = request.form_fields()
    if "app_class_name" not in form:
        return json_answer(400, {"error": "app_class_name is required"})
    name = form["app_class_name"].decode("utf-8", "replace")
    size = x11windows.window_size(DISPLAY, name)
    if size is None:  # OSWorld's server answers an error page (500) here
        return json_answer(404, {"error": f"no window of class {name!r}"})
    return json_answer(200, {"width": size[0], "height": size[1]})


def desktop_path(request: Request) -> Response:
    path = os.path.join(os.path.expanduser("~"), "Desktop")
    if os.path.isdir(path):
        return json_answer(200, {"desktop_path": path})
    return json_answer(404, {"error": "Unsupported operating system or desktop path not found"})


def _gsettings(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("gsettings")
    if exe is None:
        raise HTTPError(501, "gsettings is not installed in this desktop image (add libglib2.0-bin and "
                             "dconf-gsettings-backend to its packages)")
    return subprocess.run([exe, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=30, check=False)


def wallpaper(request: Request) -> Response:
    res = _gsettings("get", *WALLPAPER_KEY)
    path = res.stdout.decode("utf-8", "replace").strip().replace("file://", "").replace("'", "")
    if res.returncode != 0 or not path:
        raise HTTPError(404, "Wallpaper file not found")
    return _file_answer(request, urllib.parse.unquote(path), "image/png")


def change_wallpaper(request: Request) -> Response:
    data = request.json_object()
    if not data.get("path"):
        return text_answer(400, "Path not supplied!")
    path = os.path.abspath(_expand(str(data["path"])))
    if not os.path.exists(path):
        return text_answer(404, f"File not found: {path}")
    res = _gsettings("set", *WALLPAPER_KEY, f"file://{path}")
    if res.returncode != 0:  # ours: OSWorld ignores gsettings' exit status
        return text_answer(500, f"Failed to change wallpaper. Error: {res.stderr.decode('utf-8', 'replace').strip()}")
    return text_answer(200, "Wallpaper changed successfully")


def directory_tree(path: str, max_entries: int = LIST_DIRECTORY_MAX_ENTRIES) -> dict:
    """OSWorld's /list_directory tree of ``path``: ``{"type": "directory", "name", "children": [...]}`` with
    ``{"type": "file", "name"}`` leaves; a folder that cannot be read becomes ``{"error": message}``. Symlinked
    folders are followed as OSWorld does; ours: names sorted, a folder already on the current path (a symlink
    loop) is listed without children, and more than ``max_entries`` entries raise HTTPError 413."""
    count = 0

    def walk(folder: str, ancestors: frozenset) -> dict:
        nonlocal count
        tree: dict = {"type": "directory", "name": os.path.basename(folder), "children": []}
        try:
            st = os.stat(folder)
            key = (st.st_dev, st.st_ino)
            if key in ancestors:
                return tree
            names = sorted(os.listdir(folder))
        except OSError as exc:
            return {"error": str(exc)}
        for name in names:
            count += 1
            if count > max_entries:
                raise HTTPError(413, f"{path} holds more than {max_entries} entries; list a smaller folder")
            full = os.path.join(folder, name)
            if os.path.isdir(full):
                tree["children"].append(walk(full, ancestors | {key}))
            else:
                tree["children"].append({"type": "file", "name": name})
        return tree

    return walk(path, frozenset())


def list_directory(request: Request) -> Response:
    data = request.json_object()
    if "path" not in data:
        return json_answer(400, {"error": "Missing 'path' parameter"})
    path = str(data["path"])
    if not os.path.isdir(path):
        return json_answer(400, {"error": "The provided path is not a directory"})
    return _large_json(request, {"directory_tree": directory_tree(path)})


# --- opening and downloading files --------------------------------------------------------------------------

def open_file(request: Request) -> Response:
    data = request.json_object()
    path = data.get("path")
    if not path:
        return text_answer(400, "Path not supplied!")
    try:
        timeout = min(float(data.get("timeout_seconds", OPEN_FILE_DEFAULT_S)), OPEN_FILE_MAX_S)
    except (TypeError, ValueError):
        return text_answer(400, f"Invalid timeout_seconds: {data.get('timeout_seconds')}")
    full = _expand(str(path))
    if os.path.exists(full):
        opener = shutil.which("xdg-open")
        if opener is None:
            raise HTTPError(501, "xdg-open is not installed in this desktop image (add xdg-utils)")
        command = [opener, full]
        name = os.path.basename(full)
        candidates = [data.get("window_name")] if data.get("window_name") else [name, os.path.splitext(name)[0]]
    elif shutil.which(str(path)):
        command = [str(path)]
        candidates = [data.get("window_name") or str(path)]
    else:
        return text_answer(404, f"Application/file not found: {path}")
    candidates = [c for c in candidates if c]
    request.release_body()
    try:
        proc = launch(command, False)
    except OSError as exc:
        return text_answer(500, f"Failed to open {path}. Error: {exc}")
    deadline = time.monotonic() + timeout
    while True:
        for w in x11windows.client_windows(DISPLAY):
            if any(c in w.title for c in candidates):  # OSWorld: a substring of `wmctrl -l`'s line
                x11windows.activate(w)
                return text_answer(200, "File opened and window activated successfully")
        code = proc.poll()
        if code not in (None, 0):  # ours: the opener failed, no window will come
            return text_answer(500, f"Failed to open {path}. Error: {command[0]} exited with status {code}")
        if time.monotonic() > deadline:
            return text_answer(500, f"Failed to find window for {candidates} within {timeout:g} seconds.")
        time.sleep(OPEN_FILE_POLL_S)


def _fetch(url: str, path: str) -> int:
    """Download ``url`` into ``path`` (at most MAX_BODY_BYTES); returns the size. Raises OSError/ValueError."""
    with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as resp:  # noqa: S310 - scheme checked
        expected = int(resp.headers.get("Content-Length") or 0)
        if expected > MAX_BODY_BYTES:
            raise ValueError(f"{expected} bytes is over the controller's limit of {MAX_BODY_BYTES}")
        written = 0
        with open(path, "wb") as f:
            while chunk := resp.read(65536):
                written += len(chunk)
                if written > MAX_BODY_BYTES:
                    raise ValueError(f"more than the controller's limit of {MAX_BODY_BYTES} bytes")
                f.write(chunk)
    if expected and written != expected:
        raise ValueError(f"Download incomplete. Expected {expected} bytes, got {written} bytes")
    return written


def download_file(request: Request) -> Response:
    data = request.json_object()
    url, path = data.get("url"), data.get("path")
    if not url or not path:
        return text_answer(400, "Path or URL not supplied!")
    if urllib.parse.urlsplit(str(url)).scheme not in ("http", "https"):
        return text_answer(400, f"only http and https URLs can be downloaded, not {url!r}")
    request.release_body()
    target = _expand(str(path))
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    error: Exception | None = None
    for _ in range(DOWNLOAD_TRIES):
        try:
            size = _fetch(str(url), target)
        except (OSError, ValueError, urllib.error.URLError) as exc:
            error = exc
            try:
                os.remove(target)
            except OSError:
                pass
            continue
        return text_answer(200, f"File downloaded successfully: {size} bytes")
    return text_answer(500, f"Failed to download {url}. No retries left. Error: {error} ({NO_NETWORK_HINT})")


# --- scripts ----------------------------------------------------------------------------------------------

def _answer(request: Request, code: int, obj: dict) -> Response:
    captured = len(obj.get("output") or "") + len(obj.get("error") or "") + len(obj.get("message") or "")
    request.reserve(ANSWER_EXPANSION * captured)
    return json_answer(code, obj)


def _run_script(interpreter: str, path: str, text: str, timeout: float, **kw) -> tuple[int, dict]:
    """Write ``text`` to ``path``, run ``interpreter path`` (processes.run_command, ``kw`` passed on), delete it."""
    with open(path, "w") as f:
        f.write(text)
    try:
        return run_command([interpreter, path], False, timeout, **kw)
    finally:
        try:
            os.remove(path)
        except OSError:
            pass


def run_python(request: Request) -> Response:
    data = request.json_object()
    code = data.get("code")
    if not code:
        return json_answer(400, {"status": "error", "message": "Code not supplied!"})
    request.release_body()
    status, res = _run_script("/usr/bin/python3", f"/tmp/python_exec_{uuid.uuid4().hex}.py", str(code),
                              RUN_PYTHON_TIMEOUT_S)
    if status != 200:
        timed_out = res.get("returncode") == -9
        return _answer(request, 500, {"status": "error", "need_more": False, "output": None,
                                      "message": ("Execution timeout: Code took too long to execute" if timed_out
                                                  else f"Execution error: {res.get('message')}"),
                                      "error": "TimeoutExpired" if timed_out else res.get("error", "")})
    out, err, rc = res["output"], res["error"], res["returncode"]
    if rc != 0 and not err:
        err = f"Process exited with code {rc}"
    message = out + (("\n" + err) if out and err else err)
    return _answer(request, 200, {"status": "success" if rc == 0 else "error", "message": message,
                                  "need_more": False, "output": out, "error": err, "return_code": rc})


def run_bash_script(request: Request) -> Response:
    data = request.json_object()
    script = data.get("script")
    if not script:
        return json_answer(400, {"status": "error", "output": "Script not supplied!", "error": "", "returncode": -1})
    try:
        timeout = float(data.get("timeout") or RUN_BASH_DEFAULT_S)
    except (TypeError, ValueError):
        return json_answer(400, {"status": "error", "output": f"Invalid timeout: {data.get('timeout')!r}",
                                 "error": "", "returncode": -1})
    cwd = data.get("working_dir")
    if cwd:
        cwd = os.path.expanduser(str(cwd))
        if not os.path.exists(cwd):
            return json_answer(400, {"status": "error", "output": f"Working directory does not exist: {cwd}",
                                     "error": "", "returncode": -1})
    request.release_body()
    script = str(script)
    if "#!/bin/bash" not in script:
        script = "#!/bin/bash\n\n" + script
    status, res = _run_script("/bin/bash", f"/tmp/bash_script_{uuid.uuid4().hex}.sh", script, timeout,
                              cwd=cwd or None, merge_stderr=True)
    if status != 200:
        timed_out = res.get("returncode") == -9
        return _answer(request, 500, {"status": "error", "error": "", "returncode": -1,
                                      "output": (f"Script execution timed out after {timeout:g} seconds" if timed_out
                                                 else f"Failed to execute script: {res.get('message')}")})
    rc = res["returncode"]
    return _answer(request, 200, {"status": "success" if rc == 0 else "error", "output": res["output"],
                                  "error": "", "returncode": rc})


def _verified(verification: dict) -> bool:
    if "window_exists" in verification:
        wanted = str(verification["window_exists"]).lower()
        if not any(wanted in w.title.lower() for w in x11windows.client_windows(DISPLAY)):
            return False
    if "command_success" in verification:
        status, res = run_command(verification["command_success"], True, 5.0, cap=MAX_OUTPUT_BYTES)
        if status != 200 or res["returncode"] != 0:
            return False
    return True


def execute_with_verification(request: Request) -> Response:
    data = request.json_object()
    request.release_body()
    shell = bool(data.get("shell", False))
    verification = data.get("verification") or {}
    try:
        max_wait = float(data.get("max_wait_time", 10))
        interval = float(data.get("check_interval", 1))
    except (TypeError, ValueError):
        return json_answer(400, {"status": "error", "message": "max_wait_time and check_interval must be numbers"})
    status, res = run_command(data.get("command", "" if shell else []), shell, 120.0)
    if status != 200 or not verification:
        return _answer(request, status, res)
    start = time.monotonic()
    while time.monotonic() - start < max_wait:
        if _verified(verification):
            return _answer(request, 200, {**res, "verification": "passed", "wait_time": time.monotonic() - start})
        time.sleep(max(0.05, interval))
    return _answer(request, 500, {**res, "status": "verification_failed", "verification": "failed",
                                  "wait_time": max_wait})


GET_ROUTES = {
    "/accessibility": get_accessibility,
    "/terminal": get_terminal,
}
POST_ROUTES = {
    "/start_recording": start_recording,
    "/end_recording": end_recording,
    "/window_size": window_size,
    "/desktop_path": desktop_path,
    "/wallpaper": wallpaper,
    "/list_directory": list_directory,
    "/setup/change_wallpaper": change_wallpaper,
    "/setup/open_file": open_file,
    "/setup/download_file": download_file,
    "/run_python": run_python,
    "/run_bash_script": run_bash_script,
    "/execute_with_verification": execute_with_verification,
    "/setup/execute_with_verification": execute_with_verification,
}
