"""The controller's routes: every path, method, status code and body shape of OSWorld's controller API.

Serves OSWorld's ``desktop_env/server/main.py`` API as OSWorld's own PythonController and SetupController call
it (desktop_env/controllers/python.py, setup.py), with OSWorld's request and response shapes. Owns the URL map
(:func:`url_map`: every path with its method and view) and the core routes' views; the routes marked [o] are
osworld_routes.py's, merged in. Views are plain functions ``view(request) -> Response`` (server.Request, the
answers of server.py) and run under server.App's hardening (body limits, the memory budget, errors as JSON);
/reset resets the boot state (reset.BootState) that controller.py records before the first request. Any other
path is a 404 and a listed path with another method a 405 (JSON refusals, as OSWorld's Flask answers 404/405);
GET routes also answer HEAD (werkzeug's routing), without a body.

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
                                   desktop back to its state when the controller started (reset.py),
                                   so one container can serve many episodes; 500 when it cannot
"""
from __future__ import annotations

import errno
import functools
import os
import stat

from werkzeug.routing import Map
from werkzeug.wrappers import Response

import osworld_routes
import screen
import server
import x11windows
from limits import ANSWER_EXPANSION, DEFAULT_TIMEOUT_S, DISPLAY, MAX_FILE_BYTES, MIB, HTTPError, \
    read_regular_file
from processes import launch, run_command
from reset import BootState
from server import Request, bytes_answer, json_answer, text_answer


def screenshot(request: Request) -> Response:
    try:
        fmt, quality = screen.screenshot_params(request.query_string.decode("latin-1"))
    except ValueError as exc:
        return json_answer(400, {"status": "error", "message": str(exc)})
    return bytes_answer(screen.grab_screen(fmt, quality), f"image/{fmt}")


def execute(request: Request) -> Response:
    data = request.json_object()
    request.release_body()  # the command may run for minutes: hold no reservation meanwhile
    shell = bool(data.get("shell", False))
    timeout = float(data.get("timeout") or DEFAULT_TIMEOUT_S)
    code, obj = run_command(data.get("command"), shell, timeout)
    request.reserve(ANSWER_EXPANSION * (len(obj.get("output", "")) + len(obj.get("error", ""))))
    return json_answer(code, obj)


def launch_command(request: Request) -> Response:
    data = request.json_object()
    shell = bool(data.get("shell", False))
    command = data.get("command")
    try:
        launch(command, shell)
    except Exception as exc:  # noqa: BLE001
        return json_answer(500, {"status": "error", "message": str(exc)})
    shown = command if shell or isinstance(command, str) else " ".join(map(str, command or []))
    return text_answer(200, f"{shown} launched successfully")


def file(request: Request) -> Response:
    form = request.form_fields()
    if "file_path" not in form:
        return json_answer(400, {"error": "file_path is required"})
    path = os.path.expandvars(os.path.expanduser(form["file_path"].decode()))
    try:
        size = os.stat(path).st_size
    except OSError:
        size = 0  # read_regular_file says why
    request.reserve(min(max(size, MIB), MAX_FILE_BYTES))
    return bytes_answer(read_regular_file(path, MAX_FILE_BYTES), "application/octet-stream")


def upload(request: Request) -> Response:
    form = request.form_fields()
    if "file_path" not in form or "file_data" not in form:
        return json_answer(400, {"error": "file_path and file_data are required"})
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
    return text_answer(200, f"File Uploaded: {len(form['file_data'])} bytes")


def screen_size(request: Request) -> Response:
    w, h = screen.screen_size()
    return json_answer(200, {"width": w, "height": h})


def cursor_position(request: Request) -> Response:
    x, y = screen.pointer().position()
    return json_answer(200, [x, y])


def platform(request: Request) -> Response:
    return text_answer(200, "Linux")


def health(request: Request) -> Response:
    if screen.x_is_up():
        return json_answer(200, {"status": "ok", "display": DISPLAY})
    return json_answer(503, {"status": "error", "message": f"X display {DISPLAY} does not answer"})


def reset(boot: BootState, request: Request) -> Response:
    return json_answer(200, boot.reset())  # a failure (a process survived, a file cannot be restored) -> 500


def _window(request: Request) -> x11windows.Window | Response:
    """The window a /setup/activate_window or /setup/close_window request names (x11windows: wmctrl's rules for
    strict and by_class), or the 400 answer when window_name is missing; HTTPError 404 when there is none."""
    data = request.json_object()
    name = data.get("window_name")
    if not name:
        return text_answer(400, "window_name required")
    window = x11windows.find(DISPLAY, str(name), strict=bool(data.get("strict", False)),
                             by_class=bool(data.get("by_class", False)))
    if window is None:
        raise HTTPError(404, f"Window {name} not found")
    return window


def activate_window(request: Request) -> Response:
    window = _window(request)
    if isinstance(window, Response):
        return window
    x11windows.activate(window)
    return text_answer(200, "Window activated successfully")


def close_window(request: Request) -> Response:
    window = _window(request)
    if isinstance(window, Response):
        return window
    x11windows.close(DISPLAY, window)
    return text_answer(200, "Window closed successfully.")


GET_ROUTES = {
    "/screenshot": screenshot,
    "/cursor_position": cursor_position,
    "/platform": platform,
    "/health": health,
    **osworld_routes.GET_ROUTES,
}
POST_ROUTES = {
    "/execute": execute,
    "/setup/execute": execute,
    "/setup/launch": launch_command,
    "/file": file,
    "/setup/upload": upload,
    "/screen_size": screen_size,
    "/setup/activate_window": activate_window,
    "/setup/close_window": close_window,
    **osworld_routes.POST_ROUTES,
}


def url_map(boot: BootState) -> Map:
    """The controller's routes with their views; POST /reset resets ``boot``."""
    return server.url_map(GET_ROUTES, {**POST_ROUTES, "/reset": functools.partial(reset, boot)})
