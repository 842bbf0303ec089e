"""OSWorld's remaining getters (files, slides, VS Code, time rules, the accessibility tree), from OSWorld's published
package desktop-env 1.0.2 (https://pypi.org/project/desktop-env/1.0.2/ , desktop_env/evaluators/getters/*.py,
the version actors.osworld.metric_env pins), run on the actor host against our controller.

Two of them call OSWorld's own getter code in the metrics worker (:func:`actors.osworld.metrics.
call_osworld_getter`), because they are long pure rules or need pandas: rule_relativeTime (getters/misc.py) and
content_from_vm_file (getters/file.py, with the file fetched here first). The others are short and mirrored here,
each naming the function it mirrors.

``cache_file`` reads a file of the evaluation's cache folder: in OSWorld that folder receives the ``stdout`` of
the evaluator's postconfig ``execute``/``command`` steps (SetupController._execute_setup writes
``cache_dir/<stdout>``); :mod:`actors.osworld.setup` keeps those texts in ``SetupContext.outputs`` and the
evaluation hands them over in ``EvalContext.outputs``. OSWorld's getter never downloads anything.
"""
from __future__ import annotations

import asyncio
import posixpath
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any

from actors.desktop.controller_client import ControllerClient, NotSupported
from actors.osworld.getters import EvalContext, GetterError, _save, get_vm_file
from actors.osworld.metrics import MetricError, call_osworld_getter

VSCODE_REPLAY_PAUSE_S = 1.0
"""OSWorld get_vscode_config waits this long after running the command before reading its output file."""


def cache_name(name: Any, what: str) -> str:
    """``name`` if it is a plain file name (no folder, not "." or ".."); else GetterError naming ``what``."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
        raise GetterError(f"{what}: {name!r} is not a plain file name in the evaluation's cache folder")
    return name


async def get_cache_file(c: ControllerClient, config: dict, ctx: EvalContext) -> str:
    """Mirrors OSWorld get_cache_file (getters/file.py, desktop-env 1.0.2): the path of ``path`` in the
    evaluation's cache folder, where the postconfig step that named it as its ``stdout``/``stderr`` put its text
    (``ctx.outputs``). OSWorld asserts it exists; we raise GetterError naming it."""
    local = ctx.cache_dir / cache_name(config.get("path"), "cache_file")
    if local.name in ctx.outputs:
        await asyncio.to_thread(local.write_text, ctx.outputs[local.name], encoding="utf-8")
    if not await asyncio.to_thread(local.is_file):
        raise GetterError(f"cache_file: {local.name} is not in the evaluation's cache folder (no postconfig "
                          f"step wrote it as its stdout)")
    return str(local)


async def get_vscode_config(c: ControllerClient, config: dict, ctx: EvalContext) -> str | None:
    """Mirrors OSWorld get_vscode_config (getters/vscode.py, desktop-env 1.0.2): in the focused window, press
    Ctrl+Shift+P, type ``vscode_extension_command``, press Enter (OSWorld's get_replay through pyautogui), wait
    :data:`VSCODE_REPLAY_PAUSE_S`, then fetch ``path`` into the cache as ``dest`` (None when the file does not
    exist, e.g. when no VS Code ran the command)."""
    command = str(config["vscode_extension_command"])
    script = ("import pyautogui, sys; pyautogui.FAILSAFE = False; pyautogui.hotkey('ctrl', 'shift', 'p'); "
              "pyautogui.typewrite(sys.argv[1]); pyautogui.press('enter')")
    r = await c.execute(["python3", "-c", script, command], timeout=60)
    if r["status"] != "success" or r["returncode"] != 0:
        raise GetterError(f"vscode_config: typing the command failed: {(r.get('error') or '')[-300:]}")
    await asyncio.sleep(VSCODE_REPLAY_PAUSE_S)  # OSWorld's pause for VS Code to write the file
    return await get_vm_file(c, {"path": config["path"], "dest": config["dest"]}, ctx)


async def get_content_from_vm_file(c: ControllerClient, config: dict, ctx: EvalContext) -> Any:
    """OSWorld get_content_from_vm_file (getters/file.py, desktop-env 1.0.2), its own code run in the metrics
    worker on the file fetched from ``path`` (file_type xlsx, file_content last_row: the last row's values as
    strings). GetterError when OSWorld's code raises (an unsupported file_type, an unreadable file)."""
    local = await get_vm_file(c, {"path": config["path"], "dest": posixpath.basename(config["path"])}, ctx)
    files = {config["path"]: local} if local else {}
    try:
        return await call_osworld_getter("file", "get_content_from_vm_file", config,
                                         {"cache_dir": str(ctx.cache_dir / "osworld-getter"), "files": files})
    except MetricError as exc:
        raise GetterError(f"content_from_vm_file: {exc}") from exc


async def get_rule_relativeTime(c: ControllerClient, config: dict, ctx: EvalContext) -> Any:
    """OSWorld get_rule_relativeTime (getters/misc.py, desktop-env 1.0.2), its own code run in the metrics worker:
    the ``rules`` with their relative times ("next Monday", "10th next month", ...) turned into dates in the
    ``rules.timezone`` (else the actor host's timezone by IP lookup, else UTC, as OSWorld). GetterError when
    OSWorld's code raises (an unknown relative time)."""
    try:
        return await call_osworld_getter("misc", "get_rule_relativeTime", config)
    except MetricError as exc:
        raise GetterError(f"rule_relativeTime: {exc}") from exc


async def get_time_diff_range(c: ControllerClient, config: dict, ctx: EvalContext) -> Any:
    """Mirrors OSWorld get_time_diff_range (getters/misc.py, desktop-env 1.0.2): ``diff_range_in_minutes`` (None
    when absent)."""
    return config.get("diff_range_in_minutes")


async def get_accessibility_tree(c: ControllerClient, config: dict, ctx: EvalContext) -> str | None:
    """Mirrors OSWorld get_accessibility_tree (getters/misc.py, desktop-env 1.0.2): the desktop's accessibility
    tree as OSWorld's XML (None where the desktop has no AT-SPI)."""
    try:
        return await c.accessibility_tree()
    except NotSupported:
        return None


P_NS = "{http://schemas.openxmlformats.org/presentationml/2006/main}"
A_NS = "{http://schemas.openxmlformats.org/drawingml/2006/main}"
R_EMBED = "{http://schemas.openxmlformats.org/officeDocument/2006/relationships}embed"
RELS_NS = {"r": "http://schemas.openxmlformats.org/package/2006/relationships"}


def _slide_media(pptx: str, slide: int, kind: str) -> tuple[str, str] | None:
    """("zip", member) or ("vm", path) of the first ``kind`` ("audio", or "image" for the background) related to
    slide ``slide`` (0-based) of ``pptx``; None when there is none."""
    with zipfile.ZipFile(pptx) as z:
        names = set(z.namelist())
        image_id = None
        if kind == "image":
            if f"ppt/slides/slide{slide + 1}.xml" not in names:
                return None
            root = ET.fromstring(z.read(f"ppt/slides/slide{slide + 1}.xml"))
            image_id = next((b.attrib.get(R_EMBED) for bg in root.iter(f"{P_NS}bgPr")
                             for b in bg.iter(f"{A_NS}blip")), None)
            if image_id is None:
                return None
        rels = f"ppt/slides/_rels/slide{slide + 1}.xml.rels"
        if rels not in names:
            return None
        for rel in ET.fromstring(z.read(rels)).findall("r:Relationship", RELS_NS):
            if kind not in rel.attrib.get("Type", "") or (image_id is not None and rel.attrib.get("Id") != image_id):
                continue
            target = rel.attrib["Target"]
            if target.startswith(".."):
                return "zip", posixpath.normpath(posixpath.join("ppt/slides", target.replace("\\", "/")))
            if not target.startswith("file://"):
                raise GetterError(f"slide {slide}: {kind} target {target!r} is neither in the file nor file://")
            return "vm", target[len("file://"):]
    return None


async def _media_in_slide(c: ControllerClient, config: dict, ctx: EvalContext, kind: str) -> str | None:
    pptx = await get_vm_file(c, {"path": config["ppt_file_path"],
                                 "dest": PurePosixPath(config["ppt_file_path"]).name}, ctx)
    if pptx is None:
        raise GetterError(f"{kind} in slide: {config['ppt_file_path']} does not exist in the desktop")
    try:
        found = await asyncio.to_thread(_slide_media, pptx, int(config["slide_index"]), kind)
        if found is None:
            return None
        where, member = found
        if where == "vm":
            return await get_vm_file(c, {"path": member, "dest": config["dest"]}, ctx)
        data = await asyncio.to_thread(zipfile.ZipFile(pptx).read, member)
    except (zipfile.BadZipFile, ET.ParseError, KeyError) as exc:
        raise GetterError(f"{kind} in slide: {config['ppt_file_path']}: {type(exc).__name__}: {exc}") from exc
    return await _save(ctx, Path(member).name, data)


async def get_audio_in_slide(c: ControllerClient, config: dict, ctx: EvalContext) -> str | None:
    """Mirrors OSWorld get_audio_in_slide (getters/impress.py, desktop-env 1.0.2): the first audio file related
    to slide ``slide_index`` (0-based) of the .pptx at ``ppt_file_path``: extracted from the file when embedded
    (saved under its own name), else the linked ``file://`` file fetched from the desktop as ``dest``; None when
    the slide has none."""
    return await _media_in_slide(c, config, ctx, "audio")


async def get_background_image_in_slide(c: ControllerClient, config: dict, ctx: EvalContext) -> str | None:
    """Mirrors OSWorld get_background_image_in_slide (getters/impress.py, desktop-env 1.0.2): the image of slide
    ``slide_index``'s background fill (``p:bgPr``'s ``a:blip``), embedded or linked as in
    :func:`get_audio_in_slide`; None when the slide has no background image."""
    return await _media_in_slide(c, config, ctx, "image")


MORE_GETTERS = {
    "cache_file": get_cache_file, "vscode_config": get_vscode_config,
    "content_from_vm_file": get_content_from_vm_file, "rule_relativeTime": get_rule_relativeTime,
    "time_diff_range": get_time_diff_range, "accessibility_tree": get_accessibility_tree,
    "audio_in_slide": get_audio_in_slide, "background_image_in_slide": get_background_image_in_slide,
}
"""Getter type -> implementation for these getters (merged into actors.osworld.getter_table.GETTERS)."""
