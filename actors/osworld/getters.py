"""OSWorld's getters (desktop_env/evaluators/getters/*.py, ``get_<type>``), run on the actor host against our
controller: what the desktop holds after the episode, in the shape OSWorld's getter returns (a local file path
in the evaluation's cache folder for file getters, a string for command-line getters, dicts/lists for rules and
app settings), so OSWorld's metrics can be applied to it unchanged.

:data:`BASE_GETTERS` maps each type to an async ``(controller, config, EvalContext) -> value``. A getter that finds
nothing returns what OSWorld's returns then (usually None; the Chrome preference getters return their
defaults). Chrome's profile is the one the browser wrote (:func:`chrome_profile_dir`): ``~/.config/google-chrome``
(OSWorld's path) or ``~/.config/chromium`` (Debian's Chromium, which the osworld image runs as google-chrome).
"""
from __future__ import annotations

import asyncio
import json
import sqlite3
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.desktop.controller_client import ControllerClient
from actors.osworld.chrome import CHROME_DIRS, ChromeTabsError, chrome_tabs
from actors.osworld.downloads import DownloadCache, DownloadError

VLC_HTTP = ("127.0.0.1", 8080, "password")
"""VLC's web interface in the desktop: host, port, password (OSWorld's env.vlc_port and its fixed password)."""


class GetterError(Exception):
    """A getter's spec is malformed or it needs something we cannot provide (e.g. a cloud file offline)."""


@dataclass
class EvalContext:
    """Per-evaluation scratch space: ``cache_dir`` holds fetched files (removed afterwards); ``downloads`` serves
    ``cloud_file``; ``task_id`` finds the task's files in the mirror; ``outputs`` has the postconfig steps'
    named stdout/stderr texts ({file name: text}, SetupContext.outputs) that ``cache_file`` reads."""

    cache_dir: Path
    downloads: DownloadCache = field(default_factory=DownloadCache)
    task_id: str = ""
    outputs: dict[str, str] = field(default_factory=dict)


async def _save(ctx: EvalContext, dest: str, data: bytes) -> str:
    local = ctx.cache_dir / Path(dest).name
    await asyncio.to_thread(local.write_bytes, data)
    return str(local)


async def get_vm_file(c: ControllerClient, config: dict, ctx: EvalContext) -> Any:
    """OSWorld get_vm_file: fetch ``path`` into the cache as ``dest``; returns the local path, or None when the
    file does not exist. With ``multi``: lists ``path``/``dest``, returns the paths at ``gives`` (default [0])
    as a list (or the single path when one is given)."""
    paths = config["path"] if config.get("multi") else [config["path"]]
    dests = config["dest"] if config.get("multi") else [config.get("dest") or Path(config["path"]).name]
    out: list[str | None] = []
    for path, dest in zip(paths, dests, strict=True):
        data = await c.get_file(path)
        out.append(None if data is None else await _save(ctx, dest, data))
    if not config.get("multi"):
        return out[0]
    gives = config.get("gives", [0])
    picked = [out[i] for i in gives]
    return picked[0] if len(picked) == 1 else picked


async def get_cloud_file(c: ControllerClient, config: dict, ctx: EvalContext) -> Any:
    """OSWorld get_cloud_file: the file at ``path`` (a URL) fetched through the download cache (the mirror of
    OSWorld's files first) into the cache as ``dest``; with ``multi``, lists as in vm_file. GetterError when
    it cannot be had (offline without a mirror)."""
    urls = config["path"] if config.get("multi") else [config["path"]]
    dests = config["dest"] if config.get("multi") else [config["dest"]]
    out = []
    for url, dest in zip(urls, dests, strict=True):
        try:
            local = await ctx.downloads.fetch(url, Path(dest).name, ctx.task_id)
        except DownloadError as exc:
            raise GetterError(f"cloud_file: {exc}") from exc
        out.append(await _save(ctx, dest, await asyncio.to_thread(local.read_bytes)))
    if not config.get("multi"):
        return out[0]
    picked = [out[i] for i in config.get("gives", [0])]
    return picked[0] if len(picked) == 1 else picked


async def get_vm_command_line(c: ControllerClient, config: dict, ctx: EvalContext) -> str | None:
    """OSWorld get_vm_command_line: stdout of ``command`` run in the desktop (None if it could not run)."""
    r = await c.execute(config["command"], shell=bool(config.get("shell", False)))
    return r["output"] if r["status"] == "success" else None


async def get_vm_command_error(c: ControllerClient, config: dict, ctx: EvalContext) -> str | None:
    """OSWorld get_vm_command_error: stderr of ``command`` run in the desktop (None if it could not run)."""
    r = await c.execute(config["command"], shell=bool(config.get("shell", False)))
    return r["error"] if r["status"] == "success" else None


async def get_vm_terminal_output(c: ControllerClient, config: dict, ctx: EvalContext) -> str | None:
    """OSWorld get_vm_terminal_output: the focused terminal's text (controller /terminal), or None."""
    return await c.terminal_output()


async def get_rule(c: ControllerClient, config: dict, ctx: EvalContext) -> Any:
    """OSWorld get_rule: the literal ``rules`` object of the getter spec."""
    return config["rules"]


async def get_vm_screen_size(c: ControllerClient, config: dict, ctx: EvalContext) -> dict:
    """OSWorld get_vm_screen_size: {"width", "height"} of the desktop's screen."""
    w, h = await c.screen_size()
    return {"width": w, "height": h}


async def get_vm_window_size(c: ControllerClient, config: dict, ctx: EvalContext) -> dict | None:
    """OSWorld get_vm_window_size: {"width", "height"} of the window of class ``app_class_name``, or None."""
    size = await c.window_size(config["app_class_name"])
    return None if size is None else {"width": size[0], "height": size[1]}


async def get_vm_wallpaper(c: ControllerClient, config: dict, ctx: EvalContext) -> str | None:
    """OSWorld get_vm_wallpaper: the wallpaper image saved in the cache as ``dest``; None when none is set."""
    data = await c.wallpaper()
    return None if data is None else await _save(ctx, config["dest"], data)


async def get_list_directory(c: ControllerClient, config: dict, ctx: EvalContext) -> dict:
    """OSWorld get_list_directory: the directory tree of ``path`` ({"type", "name", "children"})."""
    return await c.list_directory(config["path"])


# ------------------------------------------------------------------------------------------------------- apps

async def _home_file(c: ControllerClient, config: dict, ctx: EvalContext, path: str) -> str | None:
    data = await c.get_file(path)
    return None if data is None else await _save(ctx, config["dest"], data)


async def get_vlc_config(c: ControllerClient, config: dict, ctx: EvalContext) -> str | None:
    """OSWorld get_vlc_config: ~/.config/vlc/vlcrc saved in the cache as ``dest`` (None when missing; OSWorld
    then fails writing None)."""
    return await _home_file(c, config, ctx, "~/.config/vlc/vlcrc")


async def get_gimp_config_file(c: ControllerClient, config: dict, ctx: EvalContext) -> str | None:
    """OSWorld get_gimp_config_file: ~/.config/GIMP/2.10/<file_name> saved as ``dest``; None when missing."""
    name = config["file_name"]
    if "/" in name or name in ("", ".", ".."):
        raise GetterError(f"gimp_config_file: bad file_name {name!r}")
    return await _home_file(c, config, ctx, f"~/.config/GIMP/2.10/{name}")


VLC_STATUS_SCRIPT = r'''
import base64, sys, urllib.request
host, port, password = sys.argv[1], sys.argv[2], sys.argv[3]
req = urllib.request.Request(f"http://{host}:{port}/requests/status.xml")
req.add_header("Authorization", "Basic " + base64.b64encode(f":{password}".encode()).decode())
try:
    sys.stdout.write(urllib.request.urlopen(req, timeout=10).read().decode("utf-8", "replace"))
except Exception as exc:
    sys.stderr.write(repr(exc)); sys.exit(1)
'''


async def get_vlc_playing_info(c: ControllerClient, config: dict, ctx: EvalContext) -> str | None:
    """OSWorld get_vlc_playing_info: VLC's /requests/status.xml (its web interface, inside the desktop) saved as
    ``dest``; None when VLC's web interface does not answer."""
    host, port, password = VLC_HTTP
    r = await c.execute(["python3", "-c", VLC_STATUS_SCRIPT, host, str(port), password], timeout=30)
    if r["status"] != "success" or r["returncode"] != 0:
        return None
    return await _save(ctx, config["dest"], r["output"].encode())


VIDEO_TYPES = ("3gp", "3gpp", "3gpp2", "avi", "divx", "dv", "fli", "flv", "mp2t", "mp4", "mp4v-es", "mpeg",
    "mpeg-system", "msvideo", "ogg", "quicktime", "vnd.divx", "vnd.mpegurl", "vnd.rn-realvideo", "webm",
    "x-anim", "x-avi", "x-flc", "x-fli", "x-flv", "x-m4v", "x-matroska", "x-mpeg", "x-mpeg-system",
    "x-mpeg2", "x-ms-asf", "x-ms-asf-plugin", "x-ms-asx", "x-ms-wm", "x-ms-wmv", "x-ms-wmx", "x-ms-wvx",
    "x-msvideo", "x-nsv", "x-ogm", "x-ogm+ogg", "x-theora", "x-theora+ogg")
"""The ``video/<type>`` names OSWorld's get_default_video_player queries (getters/vlc.py), in its order."""


VIDEO_PLAYER_TIMEOUT_S = 300.0
"""Deadline of the 43 ``xdg-mime`` queries of :func:`get_default_video_player` together: they took 59-73 s in an
osworld desktop on 2 cores at load 22-28 (about 3.5 s of it CPU), where a 60 s deadline cut them off."""


async def get_default_video_player(c: ControllerClient, config: dict, ctx: EvalContext) -> str:
    """OSWorld get_default_video_player: the most common ``xdg-mime query default video/<ext>`` answer over
    OSWorld's list of video types; "unknown" when there is none.

    Raises:
        GetterError: the queries did not finish within :data:`VIDEO_PLAYER_TIMEOUT_S` (or the shell failed),
            so the evaluation is a harness error rather than a score of 0 for an answer nobody read.
    """
    script = ("for e in " + " ".join(VIDEO_TYPES)
              + "; do printf '%s\\037' \"$(xdg-mime query default video/$e 2>/dev/null)\"; done")
    r = await c.execute(script, shell=True, timeout=VIDEO_PLAYER_TIMEOUT_S)
    if r["status"] != "success":
        raise GetterError(f"default_video_player: xdg-mime queries failed or took over {VIDEO_PLAYER_TIMEOUT_S:g} s: "
                          f"{(r.get('error') or r.get('output') or '').strip()[:200]}")
    out = r.get("output") or ""
    apps = [a + "\n" for a in out.split("\x1f") if a.strip()]  # OSWorld keeps the command's newline
    return Counter(apps).most_common(1)[0][0] if apps else "unknown"


# ----------------------------------------------------------------------------------------------------- chrome

async def chrome_profile_dir(c: ControllerClient) -> str:
    """The browser's user-data folder in the desktop: the first of :data:`CHROME_DIRS` whose
    ``Default/Preferences`` exists (only the browser writes that file: a setup step such as
    update_browse_history may have created the other folder), else the first that exists, else OSWorld's."""
    script = ('for f in Default/Preferences .; do for d in "$@"; do case "$d" in "~/"*) d="$HOME/${d#??}";; esac; '
              '[ -e "$d/$f" ] && { echo "$d"; exit 0; }; done; done')  # the controller may have expanded ~ already
    r = await c.execute(["sh", "-c", script, "sh", *CHROME_DIRS], timeout=10)
    found = (r.get("output") or "").strip() if r["status"] == "success" else ""
    return found or CHROME_DIRS[0]


async def _chrome_file(c: ControllerClient, rel: str) -> bytes | None:
    return await c.get_file(f"{await chrome_profile_dir(c)}/{rel}")


async def _chrome_json(c: ControllerClient, rel: str) -> dict | None:
    data = await _chrome_file(c, rel)
    try:
        value = json.loads(data) if data is not None else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


async def get_default_search_engine(c, config, ctx) -> str:
    """OSWorld get_default_search_engine: Preferences' default_search_provider_data.template_url_data.short_name
    ("Google" when unset or unreadable)."""
    prefs = await _chrome_json(c, "Default/Preferences") or {}
    return prefs.get("default_search_provider_data", {}).get("template_url_data", {}).get("short_name", "Google")


async def get_profile_name(c, config, ctx) -> str | None:
    """OSWorld get_profile_name: Preferences' profile.name (None when unreadable)."""
    prefs = await _chrome_json(c, "Default/Preferences")
    return None if prefs is None else prefs.get("profile", {}).get("name")


async def get_chrome_font_size(c, config, ctx) -> dict:
    """OSWorld get_chrome_font_size: Preferences' webkit.webprefs (Chrome's defaults when unset)."""
    prefs = await _chrome_json(c, "Default/Preferences")
    if prefs is None:
        return {"default_fixed_font_size": 13, "default_font_size": 16}
    return prefs.get("webkit", {}).get("webprefs", {"default_fixed_font_size": 13, "default_font_size": 16,
                                                     "minimum_font_size": 13})


async def get_enable_do_not_track(c, config, ctx) -> str:
    """OSWorld get_enable_do_not_track: "true"/"false" from Preferences' enable_do_not_track."""
    prefs = await _chrome_json(c, "Default/Preferences") or {}
    return "true" if prefs.get("enable_do_not_track", {}) else "false"


async def get_enable_enhanced_safety_browsing(c, config, ctx) -> str:
    """OSWorld get_enable_enhanced_safety_browsing: "true"/"false" from Preferences' safebrowsing.enhanced
    ("Google" when unreadable, as OSWorld returns)."""
    prefs = await _chrome_json(c, "Default/Preferences")
    if prefs is None:
        return "Google"
    return "true" if prefs.get("safebrowsing", {}).get("enhanced", {}) else "false"


async def get_new_startup_page(c, config, ctx) -> str:
    """OSWorld get_new_startup_page: "true" when Preferences has no session or restore_on_startup is 5."""
    prefs = await _chrome_json(c, "Default/Preferences")
    if prefs is None:
        return "Google"
    if "session" not in prefs:
        return "true"
    return "true" if prefs.get("session", {}).get("restore_on_startup", {}) == 5 else "false"


async def get_data_delete_automacally(c, config, ctx) -> str:
    """OSWorld get_data_delete_automacally (sic): "true" when Preferences' profile has
    default_content_setting_values."""
    prefs = await _chrome_json(c, "Default/Preferences")
    if prefs is None or not isinstance(prefs.get("profile"), dict):
        return "Google"
    return "true" if prefs["profile"].get("default_content_setting_values") is not None else "false"


async def get_enabled_experiments(c, config, ctx) -> list:
    """OSWorld get_enabled_experiments: ``Local State``'s browser.enabled_labs_experiments ([] when unset)."""
    state = await _chrome_json(c, "Local State") or {}
    return state.get("browser", {}).get("enabled_labs_experiments", [])


async def get_bookmarks(c, config, ctx) -> Any:
    """OSWorld get_bookmarks: the Bookmarks file's ``roots`` ([] when there is no Bookmarks file)."""
    data = await _chrome_file(c, "Default/Bookmarks")
    if not data:
        return []
    return json.loads(data).get("roots", {})


def _sqlite_rows(path: str, query: str) -> list | None:
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            return [list(r) for r in conn.execute(query).fetchall()]
        finally:
            conn.close()
    except sqlite3.Error:
        return None


async def _chrome_sqlite(c, config, ctx, rel: str, query: str) -> list | None:
    data = await _chrome_file(c, rel)
    if data is None:
        return None
    return await asyncio.to_thread(_sqlite_rows, await _save(ctx, config["dest"], data), query)


async def get_history(c, config, ctx) -> list | None:
    """OSWorld get_history: rows (url, title, last_visit_time) of the History database (None when missing)."""
    return await _chrome_sqlite(c, config, ctx, "Default/History", "SELECT url, title, last_visit_time FROM urls")


async def get_cookie_data(c, config, ctx) -> list | None:
    """OSWorld get_cookie_data: every row of the Cookies database's cookies table (None when missing)."""
    return await _chrome_sqlite(c, config, ctx, "Default/Cookies", "SELECT * FROM cookies")


async def get_shortcuts_on_desktop(c, config, ctx) -> dict:
    """OSWorld get_shortcuts_on_desktop: {file name: text} of the ``.desktop`` files in the Desktop folder."""
    desktop = await c.desktop_path()
    if desktop is None:
        return {}
    tree = await c.list_directory(desktop)
    out = {}
    for entry in tree.get("children", []):
        if entry.get("name", "").endswith(".desktop"):
            data = await c.get_file(f"{desktop}/{entry['name']}")
            if data is not None:
                out[entry["name"]] = data.decode("utf-8", "replace")
    return out


async def get_open_tabs_info(c, config, ctx) -> list:
    """OSWorld get_open_tabs_info: [{"title", "url"}] of the browser's open tabs ([] when no browser answers)."""
    try:
        return await chrome_tabs(c, "list", wait_s=5)
    except ChromeTabsError:
        return []


async def get_active_tab_info(c, config, ctx) -> dict | None:
    """OSWorld get_active_tab_info, as far as the DevTools HTTP endpoint tells: {"title", "url", "content"} of
    the most recently active tab (content is empty: reading a page needs its websocket, and pages have no
    network here); None when no browser answers."""
    tabs = await get_open_tabs_info(c, config, ctx)
    return {"title": tabs[0]["title"], "url": tabs[0]["url"], "content": ""} if tabs else None


Getter = Callable[[ControllerClient, dict, EvalContext], Awaitable[Any]]
BASE_GETTERS: dict[str, Getter] = {
    "vm_file": get_vm_file, "cloud_file": get_cloud_file, "vm_command_line": get_vm_command_line,
    "vm_command_error": get_vm_command_error, "vm_terminal_output": get_vm_terminal_output, "rule": get_rule,
    "vm_screen_size": get_vm_screen_size, "vm_window_size": get_vm_window_size, "vm_wallpaper": get_vm_wallpaper,
    "list_directory": get_list_directory, "vlc_config": get_vlc_config, "vlc_playing_info": get_vlc_playing_info,
    "gimp_config_file": get_gimp_config_file, "default_video_player": get_default_video_player,
    "default_search_engine": get_default_search_engine, "profile_name": get_profile_name,
    "chrome_font_size": get_chrome_font_size, "enable_do_not_track": get_enable_do_not_track,
    "enable_enhanced_safety_browsing": get_enable_enhanced_safety_browsing,
    "new_startup_page": get_new_startup_page, "data_delete_automacally": get_data_delete_automacally,
    "enabled_experiments": get_enabled_experiments, "bookmarks": get_bookmarks, "history": get_history,
    "cookie_data": get_cookie_data, "shortcuts_on_desktop": get_shortcuts_on_desktop,
    "open_tabs_info": get_open_tabs_info, "active_tab_info": get_active_tab_info,
}
"""Getter type -> implementation (OSWorld's names) for this module's getters; actors.osworld.getter_table.GETTERS
has every getter (these, getters_web's and getters_more's)."""
