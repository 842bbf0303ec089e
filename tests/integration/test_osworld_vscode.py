"""VS Code in the osworld image (code-server in a Chromium app window, behind ``code``; see
actors/desktop/vscode_layer.py and the profile's ``code`` script), in a real osworld-image desktop: ``code PATH``
through the controller opens a window titled as VS Code's, the server answers on loopback, a second ``code`` reuses
it, a setting written at VS Code's settings path is what OSWorld's vs_code evaluator reads (task 9439a27b's
check_json_settings through the real getter and metric), a local .vsix installs and task 0512bb38's evaluator
(``code --list-extensions | grep``) sees it, and a marketplace install fails offline (code-server's gallery is
Open VSX). Would fail on a main without VS Code: ``code`` is not in the image (the launch answers HTTP 500)."""
from __future__ import annotations

import json

import pytest

from actors.evaluation import evaluate
from arpo_async.tasks import Task

pytestmark = [pytest.mark.docker, pytest.mark.osworld_image]

WINDOW_DEADLINE_S = 180
"""Seconds for code-server's first start and its window's title on a loaded 2-core machine (a few seconds idle)."""
SETTINGS = "/home/user/.config/Code/User/settings.json"
TASK_9439A27B = {  # OSWorld's vs_code/9439a27b-18ae-42d8-9778-5f68f891805e.json, its evaluator as published
    "id": "9439a27b-18ae-42d8-9778-5f68f891805e",
    "instruction": "Please help me modify the setting of VS Code to keep my cursor focused on the debug console "
                   "when debugging in VS Code, instead of automatically focusing back on the Editor.",
    "evaluator": {"func": "check_json_settings",
                  "result": {"type": "vm_file", "path": SETTINGS, "dest": "settings.json"},
                  "expected": {"type": "rule", "rules": {"expected": {"debug.focusEditorOnBreak": False}}}}}

TASK_0512BB38 = {  # OSWorld's vs_code/0512bb38-d531-4acf-9e7e-0add90816068.json, its evaluator as published
    "id": "0512bb38-d531-4acf-9e7e-0add90816068",
    "instruction": 'Please help me install an extension in VS Code from a local VSIX file "/home/user/test.vsix".',
    "evaluator": {"func": "is_extension_installed",
                  "result": {"type": "vm_command_line",
                             "command": ["code", "--list-extensions", "|", "grep", "undefined_publisher.test"]},
                  "expected": {"type": "rule", "rules": {"type": "contain", "expected": "undefined_publisher.test"}}}}
MANIFEST = ('<?xml version="1.0" encoding="utf-8"?><PackageManifest Version="2.0.0" '
            'xmlns="http://schemas.microsoft.com/developer/vsx-schema/2011"><Metadata><Identity Language="en-US" '
            'Id="test" Version="0.0.1" Publisher="undefined_publisher"/><DisplayName>test</DisplayName></Metadata>'
            '<Installation><InstallationTarget Id="Microsoft.VisualStudio.Code"/></Installation><Dependencies/>'
            '<Assets><Asset Type="Microsoft.VisualStudio.Code.Manifest" Path="extension/package.json" '
            'Addressable="true"/></Assets></PackageManifest>')
PACKAGE = {"name": "test", "publisher": "undefined_publisher", "version": "0.0.1", "engines": {"vscode": "^1.0.0"}}
MAKE_VSIX = (f"import sys, zipfile\nwith zipfile.ZipFile(sys.argv[1], 'w') as z:\n"
             f"    z.writestr('extension.vsixmanifest', {MANIFEST!r})\n"
             f"    z.writestr('extension/package.json', {json.dumps(PACKAGE)!r})\n")
"""Writes a minimal VS Code extension package (a .vsix: a zip with extension.vsixmanifest and
extension/package.json), undefined_publisher.test as task 0512bb38's file is."""


async def _wait_window(c, title: str) -> None:
    """Poll inside the desktop (bounded by WINDOW_DEADLINE_S) until a visible window's title holds ``title``
    (``xdotool search --sync`` can die of BadWindow while Chromium maps and drops its windows)."""
    r = await c.execute(["timeout", str(WINDOW_DEADLINE_S), "sh", "-c", 'until xdotool search --onlyvisible --name '
                         '"$0" >/dev/null 2>&1; do sleep 0.1; done', title], timeout=WINDOW_DEADLINE_S + 30)
    assert r["returncode"] == 0, f"no window titled {title!r} within {WINDOW_DEADLINE_S} s: {r}"


async def test_code_opens_vs_code_whose_settings_reach_osworlds_evaluator(osworld_desktop, tmp_path):
    c = osworld_desktop.controller
    r = await c.execute(["sh", "-c", "mkdir -p /tmp/x && printf 'print(1)\\n' > /tmp/x/a.py"])
    assert r["returncode"] == 0, r
    task = Task.from_dict(TASK_9439A27B, check_names=True)
    assert await evaluate(c, task, "DONE") == 0.0  # untouched: no settings.json yet

    await c.launch(["code", "/tmp/x"])  # as OSWorld's launch step: returns at once
    await _wait_window(c, "x - Visual Studio Code")  # the workbench titles it "<folder> - Visual Studio Code"
    page = await c.execute(["python3", "-c", "import urllib.request; print(urllib.request.urlopen("
                            "'http://127.0.0.1:18080/?folder=/tmp/x', timeout=30).read().decode())"], timeout=60)
    assert page["returncode"] == 0 and "vscode" in page["output"].lower(), page
    servers = await c.execute(["pgrep", "-fc", "code-server/out/node/entry.js --config"])

    r = await c.execute(["code", "/tmp/x/a.py"], timeout=120)  # a second `code`: same server, a new window
    assert r["returncode"] == 0, r
    await _wait_window(c, "a.py - Visual Studio Code")  # a file opens in an empty window, as `code FILE` does
    again = await c.execute(["pgrep", "-fc", "code-server/out/node/entry.js --config"])
    assert again["output"].strip() == servers["output"].strip() == "1", (servers, again)

    # VS Code's settings file, where OSWorld's getter reads it; the workbench would write the same file
    await c.upload(SETTINGS, json.dumps({"debug.focusEditorOnBreak": False}).encode())
    assert await evaluate(c, task, "DONE") == 1.0
    await c.upload(SETTINGS, json.dumps({"debug.focusEditorOnBreak": True}).encode())
    assert await evaluate(c, task, "DONE") == 0.0

    # task 0512bb38: a local .vsix (OSWorld downloads one; this one is made here) installs offline, and the
    # task's own evaluator (`code --list-extensions | grep ...`) sees it; untouched it scores 0
    vsix_task = Task.from_dict(TASK_0512BB38, check_names=True)
    assert await evaluate(c, vsix_task, "DONE") == 0.0
    r = await c.execute(["python3", "-c", MAKE_VSIX, "/tmp/test.vsix"])
    assert r["returncode"] == 0, r
    r = await c.execute(["code", "--install-extension", "/tmp/test.vsix"], timeout=180)
    assert r["returncode"] == 0, r
    assert await evaluate(c, vsix_task, "DONE") == 1.0
    # a marketplace id cannot install: code-server's gallery (Open VSX) is out of reach offline
    market = await c.execute(["code", "--install-extension", "njpwerner.autodocstring"], timeout=180)
    listed = await c.execute(["code", "--list-extensions"], timeout=180)
    assert market["returncode"] != 0 and listed["output"].split() == ["undefined_publisher.test"], (market, listed)
