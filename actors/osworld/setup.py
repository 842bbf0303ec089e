"""OSWorld's setup step types, run through a desktop's controller (desktop_env/controllers/setup.py,
``SetupController._<type>_setup``).

:data:`SETUP_STEPS` maps each type to an async handler ``(controller, parameters, SetupContext)``. Types:
launch, execute/command, sleep, activate_window, close_window, open, upload_file, download, chrome_open_tabs,
chrome_close_tabs, update_browse_history. Departures from OSWorld, each stricter or needed without a VM:

- a step that fails raises :class:`TaskSetupError` (OSWorld logs and goes on for launch/activate/close/
  chrome steps), except a window step of an evaluator's ``postconfig`` (:attr:`SetupContext.postconfig`);
  an ``until`` never met raises after :data:`UNTIL_TRIALS` tries (OSWorld loops until met);
- ``open`` uses xdg-open where the image has it, else the first installed app of :data:`OPENERS` for the file's
  extension (OSWorld's server runs xdg-open);
- ``download`` fetches on the actor host through :class:`actors.osworld.downloads.DownloadCache` (mirror,
  cache, network) and uploads into the desktop;
- chrome tab steps use the browser's DevTools HTTP endpoint from inside the desktop (:mod:`actors.osworld.chrome`);
- ``activate_window`` / ``close_window`` wait up to :data:`WINDOW_WAIT_S` for the window; for "Google Chrome"
  they also accept a "Chromium" window (the image's Chrome is Chromium).

Command placeholders ``{CLIENT_PASSWORD}``, ``{SCREEN_WIDTH}``, ``{SCREEN_HEIGHT}``, ``{SCREEN_WIDTH_HALF}``,
``{SCREEN_HEIGHT_HALF}`` are replaced as OSWorld's _execute_setup does. :class:`TaskSetupError` carries a
``kind`` (``needs_network``, ``app_missing``, ``setup_failed``) for coverage reports.
"""
from __future__ import annotations

import asyncio
import datetime
import logging
import os
import posixpath
import sqlite3
import stat
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from actors.desktop.controller_client import ControllerClient, DesktopError, RequestRefused
from actors.osworld.chrome import CHROME_DIRS, ChromeTabsError, chrome_tabs
from actors.osworld.downloads import DownloadCache, DownloadError

UNTIL_TRIALS = 31  # at most 31 tries of an `until` step ...
UNTIL_INTERVAL_S = 0.3  # ... 0.3 s apart (OSWorld SetupController._execute_setup sleeps 0.3 s between tries)
UNTIL_DEADLINE_S = 60.0  # ours: an `until` loop also stops after this many seconds in all
CLIENT_PASSWORD = "password"
"""What ``{CLIENT_PASSWORD}`` becomes (OSWorld's default client password for its Ubuntu image)."""
WINDOW_WAIT_S = 60.0
"""activate_window / close_window wait this long for the window to appear (tasks launch an app and activate its
window in the next step; OSWorld's server tries once and only logs a miss). VS Code's first window (code-server
starting, then its workbench titling the window) took 13 s on a loaded 2-core machine, and over 30 s at a load
average of 28 on 2 cores (every vs_code setup of the reference-solution bench failed at 30 s)."""
OPEN_WAIT_S = 30.0
"""``open`` waits this long for a window whose title holds the file's name (OSWorld's server blocks too)."""


class TaskSetupError(Exception):
    """A setup (or postconfig) step is unknown, malformed, or failed inside the desktop.

    ``kind``: ``needs_network`` (a download neither the mirror, the cache nor the network could serve),
    ``app_missing`` (the image lacks a program the step needs), or ``setup_failed``."""

    def __init__(self, message: str, kind: str = "setup_failed") -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class SetupContext:
    """What setup steps need beyond the controller.

    Attributes:
        downloads: the download cache (mirror of OSWorld's files, cache folder, size cap, timeout).
        task_id: the task being set up (finds its files in the mirror).
        screen: (width, height) of the desktop, looked up on first need.
        outputs: {file name: text} of execute/command steps that name a ``stdout``/``stderr`` file (OSWorld's
            SetupController._execute_setup writes those into its cache folder, where the cache_file getter
            reads them); the evaluation hands them to its getters.
        postconfig: the steps are an evaluator's ``postconfig`` (run after the episode): an activate_window or
            close_window whose window is not there within WINDOW_WAIT_S / 4 (the agent closed or never opened it)
            is logged and skipped, as OSWorld's SetupController does, so the episode is scored, not an error.
    """

    downloads: DownloadCache = field(default_factory=DownloadCache)
    task_id: str = ""
    screen: tuple[int, int] | None = None
    outputs: dict[str, str] = field(default_factory=dict)
    postconfig: bool = False


def _params(step: dict) -> dict:
    return step.get("parameters") or {}


async def _substitute(c: ControllerClient, command, ctx: SetupContext):
    """OSWorld's placeholders in a command (a string or a list of strings)."""
    text = command if isinstance(command, str) else " ".join(map(str, command))
    if "{" not in text:
        return command
    if ctx.screen is None and "{SCREEN_" in text:
        ctx.screen = await c.screen_size()
    w, h = ctx.screen or (0, 0)
    subs = {"{CLIENT_PASSWORD}": CLIENT_PASSWORD, "{SCREEN_WIDTH_HALF}": str(w // 2),
            "{SCREEN_HEIGHT_HALF}": str(h // 2), "{SCREEN_WIDTH}": str(w), "{SCREEN_HEIGHT}": str(h)}

    def sub(s: str) -> str:
        for k, v in subs.items():
            s = s.replace(k, v)
        return s
    return sub(command) if isinstance(command, str) else [sub(str(x)) for x in command]


async def _step_launch(c: ControllerClient, p: dict, ctx: SetupContext) -> None:
    """OSWorld's launch: start ``command`` without waiting. A program the image lacks is a TaskSetupError of
    kind app_missing (the controller answers 500 "No such file or directory"), not a dead desktop."""
    if not p.get("command"):
        raise TaskSetupError("launch: parameters need 'command'")
    command = await _substitute(c, p["command"], ctx)
    try:
        await c.launch(command, shell=bool(p.get("shell", False)))
    except DesktopError as exc:
        if "HTTP 500" in str(exc) and "No such file or directory" in str(exc):
            raise TaskSetupError(f"launch {command!r}: not installed in this desktop image",
                                 "app_missing") from exc
        raise


def until_met(result: dict, until: dict) -> bool:
    """OSWorld's ``until`` test: true when ANY given condition holds (``returncode`` equal, ``stdout`` /
    ``stderr`` a substring of the output / error). ``until`` must not be empty."""
    return ("returncode" in until and result.get("returncode") == until["returncode"]
            or "stdout" in until and str(until["stdout"]) in (result.get("output") or "")
            or "stderr" in until and str(until["stderr"]) in (result.get("error") or ""))


async def _step_execute(c: ControllerClient, p: dict, ctx: SetupContext) -> None:
    """OSWorld's execute/command step; ``until`` ({returncode|stdout|stderr}, any one suffices) retries up to
    31 times, 0.3 s apart (and for at most 60 s in all), and raises TaskSetupError if never met. A command that
    cannot run or times out raises TaskSetupError (kind app_missing when it is not installed); a non-zero exit
    without ``until`` is accepted, as in OSWorld."""
    if not p.get("command"):
        raise TaskSetupError("execute: parameters need 'command'")
    command = await _substitute(c, p["command"], ctx)
    until = p.get("until") or {}
    timeout = float(p.get("timeout", 120))
    deadline = time.monotonic() + UNTIL_DEADLINE_S
    for trial in range(1, UNTIL_TRIALS + 1 if until else 2):
        result = await c.execute(command, shell=bool(p.get("shell", False)), timeout=timeout, setup=True)
        if result["status"] != "success":
            why = result.get("error") or result.get("message") or ""
            missing = "No such file or directory" in why or "not found" in why
            raise TaskSetupError(f"execute {command!r} failed: {why[-300:]}",
                                 "app_missing" if missing else "setup_failed")
        if not until or until_met(result, until):
            _keep_outputs(p, result, ctx)
            return
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(UNTIL_INTERVAL_S)
    raise TaskSetupError(f"execute {command!r}: condition {until} not met after {trial} tries; "
                         f"last returncode {result['returncode']}, stderr {result['error'][-300:]!r}")


def _keep_outputs(p: dict, result: dict, ctx: SetupContext) -> None:
    """OSWorld's ``stdout``/``stderr`` parameters: keep the command's output/error text under that file name."""
    for key, field_name in (("stdout", "output"), ("stderr", "error")):
        name = p.get(key)
        if not name:
            continue
        if not isinstance(name, str) or "/" in name or "\\" in name or name in (".", ".."):
            raise TaskSetupError(f"execute: {key} {name!r} must be a plain file name")
        ctx.outputs[name] = result.get(field_name) or ""


async def _step_sleep(c: ControllerClient, p: dict, ctx: SetupContext) -> None:
    seconds = p.get("seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
        raise TaskSetupError(f"sleep: 'seconds' must be a non-negative number, got {seconds!r}")
    await asyncio.sleep(seconds)


def _window_names(name: str) -> list[str]:
    return [name, name.replace("Google Chrome", "Chromium")] if "Google Chrome" in name else [name]


async def wait_for_window(c: ControllerClient, name: str, *, strict: bool = False, by_class: bool = False,
                          verb: str = "activate", deadline_s: float = WINDOW_WAIT_S) -> None:
    """Activate (``verb`` "activate") or close ("close") the first window named ``name`` (wmctrl's rules:
    :meth:`ControllerClient.activate_window`), asking every 0.25 s until there is one, for at most ``deadline_s``
    seconds; "Google Chrome" also matches a "Chromium" window.

    The desktop lists windows with python-xlib (actors/desktop/image/x11windows.py), which skips a window that
    vanishes while it is read; ``xdotool search``, which walks the window tree, dies on such a window (X error
    BadWindow in XQueryTree, exit 1), so this wait does not use it.

    Raises:
        TaskSetupError: no such window within ``deadline_s``.
    """
    act = c.activate_window if verb == "activate" else c.close_window
    deadline = time.monotonic() + deadline_s
    while True:
        for n in _window_names(name):
            if await act(n, strict=strict, by_class=by_class):
                return
        if time.monotonic() > deadline:
            raise TaskSetupError(f"{verb}_window: no visible window named {name!r} within {deadline_s:g} s")
        await asyncio.sleep(0.25)


async def _window_step(c: ControllerClient, p: dict, verb: str, ctx: SetupContext) -> None:
    """activate_window / close_window: OSWorld's ``window_name``, ``strict`` and ``by_class``; in a postconfig a
    window that does not show is logged and skipped (:attr:`SetupContext.postconfig`)."""
    name = p.get("window_name")
    if not name:
        raise TaskSetupError(f"{verb}_window: parameters need 'window_name'")
    try:
        await wait_for_window(c, str(name), strict=bool(p.get("strict", False)),
                              by_class=bool(p.get("by_class", False)), verb=verb,
                              deadline_s=WINDOW_WAIT_S / 4 if ctx.postconfig else WINDOW_WAIT_S)
    except TaskSetupError as exc:
        if not ctx.postconfig:
            raise
        logging.getLogger(__name__).info("postconfig of task %s: %s; going on, as OSWorld does", ctx.task_id, exc)


async def _step_activate_window(c: ControllerClient, p: dict, ctx: SetupContext) -> None:
    await _window_step(c, p, "activate", ctx)


async def _step_close_window(c: ControllerClient, p: dict, ctx: SetupContext) -> None:
    await _window_step(c, p, "close", ctx)


OPENERS: dict[tuple[str, ...], tuple[str, ...]] = {
    (".docx", ".doc", ".odt", ".rtf"): ("libreoffice --writer", "soffice --writer"),
    (".xlsx", ".xls", ".ods", ".csv"): ("libreoffice --calc", "soffice --calc"),
    (".pptx", ".ppt", ".odp"): ("libreoffice --impress", "soffice --impress"),
    (".png", ".jpg", ".jpeg", ".xcf", ".bmp", ".gif", ".tif", ".tiff", ".webp"): ("gimp",),
    (".mp4", ".mp3", ".wav", ".avi", ".mkv", ".webm", ".ogg", ".flac", ".mov"): ("vlc",),
    (".html", ".htm", ".pdf"): ("google-chrome", "chromium"),
    (".txt", ".py", ".md", ".json", ".sh", ".c", ".cpp", ".java", ".js", ".tex", ".xml", ".yaml", ".ini"):
        ("code", "gedit", "mousepad", "xedit"),
}
"""Extension -> commands tried in order, for ``open`` where the image has no xdg-open."""


def _opener_probe(path: str) -> str:
    ext = posixpath.splitext(path)[1].lower()
    cands = next((cmds for exts, cmds in OPENERS.items() if ext in exts), ())
    lines = ['command -v xdg-open >/dev/null && { echo xdg-open; exit 0; }']
    lines += [f'command -v {cmd.split()[0]} >/dev/null && {{ echo "{cmd}"; exit 0; }}' for cmd in cands]
    return "\n".join([*lines, "exit 1"])


async def _step_open(c: ControllerClient, p: dict, ctx: SetupContext) -> None:
    """OSWorld's open (server route /setup/open_file): open ``path`` in its default app and wait (up to
    OPEN_WAIT_S) for a window whose title holds the file's name or its stem (GIMP shows "[stem] (imported)"), and
    raise it. TaskSetupError when the file does not exist or no app for it is installed (kind app_missing)."""
    path = p.get("path")
    if not path:
        raise TaskSetupError("open: parameters need 'path'")
    r = await c.execute(["sh", "-c", 'p="$1"; case "$p" in "~/"*) p="$HOME/${p#\\~/}";; esac; '
                         '[ -e "$p" ] && echo "$p"', "sh", path], timeout=10, setup=True)
    full = (r.get("output") or "").strip()
    if r["returncode"] != 0 or not full:
        raise TaskSetupError(f"open: file not found: {path}")
    probe = await c.execute(_opener_probe(full), shell=True, timeout=10, setup=True)
    opener = (probe.get("output") or "").strip()
    if probe["returncode"] != 0 or not opener:
        raise TaskSetupError(f"open: no app installed to open {path} (no xdg-open, none of the openers for "
                             f"its extension)", "app_missing")
    await c.launch([*opener.split(), full])
    deadline = time.monotonic() + OPEN_WAIT_S
    name = posixpath.basename(full)
    stem = posixpath.splitext(name)[0]
    names = [name] + ([f"[{stem}]"] if stem else [])  # GIMP titles an image "[stem] (imported)-1.0 (RGB ...)"
    while time.monotonic() < deadline:
        for n in names:
            if await c.activate_window(n):
                return
        await asyncio.sleep(0.5)


UPLOAD_MAX_BYTES = 32 * 1024 * 1024
"""Largest local file an ``upload_file`` step sends. With its multipart framing it fits the controller's request
body limit (an eighth of the desktop's memory, at most 64 MiB: actors/desktop/fleet.py controller_env) for
desktops of more than 256 MiB (the default is 512); a smaller desktop refuses it (413, a TaskSetupError). It also
bounds what the actor holds in memory per upload."""


def _read_upload_source(path: str, cap: int) -> bytes:
    """The bytes of the regular file ``path`` on the actor host: TaskSetupError when it is anything else (a
    folder, a device such as /dev/zero, a FIFO: opened without blocking) or holds more than ``cap`` bytes.

    ``path`` must be absolute and free of symlinks (a task file's loader resolves its sources so: arpo_async.tasks):
    it is opened without following a link in its last component, and the file opened must be the one ``path``
    names (``/proc/self/fd``), so a symlink put anywhere on the way after the task loaded is refused, not
    followed. A relative path is refused: it would be read from the actor's working directory."""
    if not os.path.isabs(path):
        raise TaskSetupError(f"upload_file: {path!r} is a relative path; a task file's loader makes it absolute "
                             "(inside the task's folder), a task given as a dict must name an absolute path")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        raise TaskSetupError(f"upload_file: cannot read {path}: {exc}") from exc
    try:
        opened = os.readlink(f"/proc/self/fd/{fd}")
        if opened != os.path.normpath(path):
            raise TaskSetupError(f"upload_file: {path} leads through a symlink to {opened}; refused (sources are "
                                 "resolved when the task loads)")
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TaskSetupError(f"upload_file: {path} is not a regular file")
        if st.st_size > cap:
            raise TaskSetupError(f"upload_file: {path} has {st.st_size} bytes, more than the limit of {cap}")
    except BaseException:
        os.close(fd)
        raise
    with open(fd, "rb", buffering=0) as f:
        data = bytearray()
        while len(data) <= cap:  # read up to the cap even if the file grew since fstat
            chunk = f.read(min(1024 * 1024, cap + 1 - len(data)))
            if not chunk:
                return bytes(data)
            data += chunk
        raise TaskSetupError(f"upload_file: {path} grew past the limit of {cap} bytes while it was read")


async def _step_upload_file(c: ControllerClient, p: dict, ctx: SetupContext) -> None:
    """OSWorld's upload_file: copies local files (on the actor host) into the desktop. Each must be a regular
    file of at most UPLOAD_MAX_BYTES; anything else, an unreadable file or a controller that refuses the upload
    (RequestRefused, e.g. over its body limit) is a TaskSetupError."""
    files = p.get("files")
    if not isinstance(files, list) or not files:
        raise TaskSetupError("upload_file: parameters need 'files': [{local_path, path}, ...]")
    for f in files:
        try:
            local, target = str(f["local_path"]), f["path"]
        except (KeyError, TypeError) as exc:
            raise TaskSetupError(f"upload_file: each file needs 'local_path' and 'path', got {f!r}") from exc
        try:
            data = await asyncio.to_thread(_read_upload_source, local, UPLOAD_MAX_BYTES)
        except OSError as exc:
            raise TaskSetupError(f"upload_file: cannot read {local}: {exc}") from exc
        try:
            await c.upload(target, data)
        except RequestRefused as exc:
            raise TaskSetupError(f"upload_file: the desktop refused {local} -> {target}: {exc}") from exc


async def _step_download(c: ControllerClient, p: dict, ctx: SetupContext) -> None:
    """OSWorld's download: each ``{url, path}`` is fetched on the actor host (DownloadCache: mirror, cache,
    network) and uploaded to ``path`` in the desktop. A file nobody can serve is a TaskSetupError of kind
    needs_network."""
    files = p.get("files")
    if not isinstance(files, list) or not files:
        raise TaskSetupError("download: parameters need 'files': [{url, path}, ...]")
    for f in files:
        if not isinstance(f, dict) or not f.get("url") or not f.get("path"):
            raise TaskSetupError(f"download: each file needs 'url' and 'path', got {f!r}")
        try:
            local = await ctx.downloads.fetch(f["url"], posixpath.basename(f["path"]), ctx.task_id)
        except DownloadError as exc:
            raise TaskSetupError(f"download: {exc}", "needs_network" if exc.kind == "needs_network"
                                 else "setup_failed") from exc
        except ValueError as exc:
            raise TaskSetupError(f"download: {exc}") from exc
        await _step_upload_file(c, {"files": [{"local_path": os.path.realpath(local), "path": f["path"]}]}, ctx)


async def _tabs_step(c: ControllerClient, p: dict, op: str) -> None:
    """chrome_open_tabs (``urls_to_open``) / chrome_close_tabs (``urls_to_close``) through actors.osworld.chrome;
    a website the desktop cannot reach (it has no network) is a TaskSetupError of kind needs_network."""
    key = f"urls_to_{op}"
    urls = p.get(key)
    if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
        raise TaskSetupError(f"chrome_{op}_tabs: parameters need '{key}': [str, ...]")
    try:
        await chrome_tabs(c, op, urls)
    except ChromeTabsError as exc:
        raise TaskSetupError(str(exc), exc.kind) from exc


async def _step_chrome_open_tabs(c: ControllerClient, p: dict, ctx: SetupContext) -> None:
    await _tabs_step(c, p, "open")


async def _step_chrome_close_tabs(c: ControllerClient, p: dict, ctx: SetupContext) -> None:
    await _tabs_step(c, p, "close")


CHROME_HISTORY_PATH = "Default/History"
"""Where update_browse_history writes, under each of actors.osworld.chrome.CHROME_DIRS (OSWorld writes
~/.config/google-chrome/Default/History on Linux x86; Debian's Chromium, the osworld image's google-chrome,
reads ~/.config/chromium: the step runs before the browser starts, so both get the file)."""
HISTORY_SCHEMA = (
    "CREATE TABLE meta(key LONGVARCHAR NOT NULL UNIQUE PRIMARY KEY, value LONGVARCHAR)",
    "CREATE TABLE urls(id INTEGER PRIMARY KEY AUTOINCREMENT, url LONGVARCHAR, title LONGVARCHAR, "
    "visit_count INTEGER DEFAULT 0 NOT NULL, typed_count INTEGER DEFAULT 0 NOT NULL, "
    "last_visit_time INTEGER NOT NULL, hidden INTEGER DEFAULT 0 NOT NULL)",
    "CREATE TABLE visits(id INTEGER PRIMARY KEY AUTOINCREMENT, url INTEGER NOT NULL, visit_time INTEGER NOT NULL, "
    "from_visit INTEGER, transition INTEGER DEFAULT 0 NOT NULL, segment_id INTEGER, visit_duration INTEGER "
    "DEFAULT 0 NOT NULL)",
)
"""The tables of Chrome's History database that OSWorld's update_browse_history writes (it starts from an empty
History file downloaded from its file cache; we create the tables instead; Chrome migrates the rest)."""


def build_history_db(items: list[dict], now: datetime.datetime | None = None) -> bytes:
    """A Chrome History sqlite file holding ``items`` ([{url, title, visit_time_from_now_in_seconds}]), with
    OSWorld's rows: urls(url, title, visit_count 1, typed_count 0, last_visit_time, hidden 0) and visits(url id,
    visit_time, from_visit 0, transition 805306368, segment_id 0, visit_duration 0); times in microseconds
    since 1601-01-01 (Chrome's epoch). Raises KeyError/TypeError on a malformed item."""
    now = now or datetime.datetime.now()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "History")
        conn = sqlite3.connect(path)
        try:
            for sql in HISTORY_SCHEMA:
                conn.execute(sql)
            for item in items:
                t = now - datetime.timedelta(seconds=float(item["visit_time_from_now_in_seconds"]))
                stamp = int((t - datetime.datetime(1601, 1, 1)).total_seconds() * 1_000_000)
                cur = conn.execute("INSERT INTO urls (url, title, visit_count, typed_count, last_visit_time, hidden) "
                                   "VALUES (?, ?, 1, 0, ?, 0)", (str(item["url"]), str(item["title"]), stamp))
                conn.execute("INSERT INTO visits (url, visit_time, from_visit, transition, segment_id, "
                             "visit_duration) VALUES (?, ?, 0, 805306368, 0, 0)", (cur.lastrowid, stamp))
            conn.commit()
        finally:
            conn.close()
        return Path(path).read_bytes()


async def _step_update_browse_history(c: ControllerClient, p: dict, ctx: SetupContext) -> None:
    history = p.get("history")
    if not isinstance(history, list):
        raise TaskSetupError("update_browse_history: parameters need 'history': [{url, title, "
                             "visit_time_from_now_in_seconds}, ...]")
    try:
        data = await asyncio.to_thread(build_history_db, history)
    except (KeyError, TypeError, ValueError) as exc:
        raise TaskSetupError(f"update_browse_history: malformed history item: {exc!r}") from exc
    home = (await c.execute("printf %s \"$HOME\"", shell=True, timeout=10, setup=True))["output"] or "/root"
    for base in CHROME_DIRS:
        await c.upload(f"{base.replace('~', home, 1)}/{CHROME_HISTORY_PATH}", data)


async def _step_googledrive(c: ControllerClient, p: dict, ctx: SetupContext) -> None:
    """OSWorld's googledrive step (SetupController._googledrive_setup) uploads files to the task author's
    Google Drive with stored credentials: not possible here; TaskSetupError kind needs_network."""
    raise TaskSetupError("googledrive: needs Google Drive (OSWorld's PyDrive client, its credentials and "
                         "network); not supported here", "needs_network")


async def _step_login(c: ControllerClient, p: dict, ctx: SetupContext) -> None:
    """OSWorld's login step (SetupController._login_setup) signs in to a live website (e.g. Google Drive) with
    stored credentials through playwright: not possible here; TaskSetupError kind needs_network."""
    raise TaskSetupError(f"login: signs in to the live website {p.get('platform', '?')!r}; needs network and "
                         f"the task author's credentials", "needs_network")


SetupStep = Callable[[ControllerClient, dict, SetupContext], Awaitable[None]]
SETUP_STEPS: dict[str, SetupStep] = {
    "launch": _step_launch,
    "execute": _step_execute,
    "command": _step_execute,
    "sleep": _step_sleep,
    "activate_window": _step_activate_window,
    "close_window": _step_close_window,
    "open": _step_open,
    "upload_file": _step_upload_file,
    "download": _step_download,
    "chrome_open_tabs": _step_chrome_open_tabs,
    "chrome_close_tabs": _step_chrome_close_tabs,
    "update_browse_history": _step_update_browse_history,
    "googledrive": _step_googledrive,
    "login": _step_login,
}


async def run_setup(controller: ControllerClient, steps: list[dict] | tuple[dict, ...],
                    ctx: SetupContext | None = None) -> None:
    """Run OSWorld setup steps in order.

    Args:
        controller: the desktop.
        steps: ``[{"type", "parameters"}, ...]``.
        ctx: downloads cache and task id (default: a SetupContext with the default DownloadCache).
    Raises TaskSetupError naming the step (index and type) for an unknown type or a failed step (its ``kind``
    kept); DesktopError passes through when the desktop cannot be reached.
    """
    ctx = ctx or SetupContext()
    for i, step in enumerate(steps):
        kind = step.get("type") if isinstance(step, dict) else None
        handler = SETUP_STEPS.get(kind)  # type: ignore[arg-type]
        if handler is None:
            raise TaskSetupError(f"setup step {i}: unknown type {kind!r} (supported: {', '.join(sorted(SETUP_STEPS))})")
        try:
            await handler(controller, _params(step), ctx)
        except TaskSetupError as exc:
            raise TaskSetupError(f"setup step {i} ({kind}): {exc}", exc.kind) from exc
