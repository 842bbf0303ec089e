"""The pyautogui action backend (OSWorld's way of acting) and the config key that chooses it, and the
accessibility XML writer of the desktop controller: pure functions, no desktop."""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from actors.episode import ACTION_BACKENDS
from actors.uitars import pyautogui, xdotool
from actors.uitars.actions import Action
from arpo_async.config import ConfigError, load_config

IMAGE_DIR = Path(__file__).resolve().parents[2] / "actors" / "desktop" / "image"

EVERY_ACTION = [
    Action("click", point=(10.4, 20.6)), Action("left_double", point=(1.0, 2.0)),
    Action("right_single", point=(3.0, 4.0)), Action("hover", point=(5.0, 6.0)),
    Action("drag", point=(1.0, 1.0), end_point=(50.0, 60.0)), Action("hotkey", key="ctrl shift t"),
    Action("key_down", key="shift"), Action("key_up", key="shift"), Action("type", text="it's \"x\"\\n\n"),
    Action("type", text="plain"), Action("scroll", point=(7.0, 8.0), direction="down"),
    Action("scroll", direction="left"),
]


@pytest.mark.parametrize("action", EVERY_ACTION, ids=lambda a: a.kind)
def test_every_action_is_one_python_command_with_osworlds_prefix(action):
    [argv] = pyautogui.to_commands(action)
    assert argv[:2] == ["python", "-c"]
    assert argv[2].startswith("import pyautogui; import time; pyautogui.FAILSAFE = False; ")
    compile(argv[2], "<action>", "exec")  # valid Python, quotes in typed text escaped


def test_the_code_is_ui_tars_mapping():
    [argv] = pyautogui.to_commands(Action("click", point=(10.4, 20.6)))
    assert argv[2].endswith("pyautogui.click(10.4, 20.6, button='left')")
    [argv] = pyautogui.to_commands(Action("type", text="ok\n"))
    assert argv[2].endswith("pyautogui.write('ok', interval=0.1)\ntime.sleep(0.5)\npyautogui.press('enter')")


@pytest.mark.parametrize("kind", ["wait", "finished", "fail"])
def test_control_actions_run_nothing(kind):
    assert pyautogui.to_commands(Action(kind)) == [] == xdotool.to_commands(Action(kind))


def test_config_chooses_the_backend():
    assert load_config().actors.action_backend == "xdotool"
    assert load_config(None, ['actors.action_backend="pyautogui"']).actors.action_backend == "pyautogui"
    with pytest.raises(ConfigError, match="actors.action_backend: must be 'xdotool' or 'pyautogui'"):
        load_config(None, ['actors.action_backend="xdg"'])
    assert ACTION_BACKENDS == {"xdotool": xdotool.to_commands, "pyautogui": pyautogui.to_commands}


@pytest.fixture
def accessibility():
    sys.path.insert(0, str(IMAGE_DIR))
    try:
        import accessibility as module  # noqa: PLC0415 - the controller's module, standard library only
        yield module
    finally:
        sys.path.remove(str(IMAGE_DIR))
        sys.modules.pop("accessibility", None)


def test_accessibility_xml_declares_osworlds_namespaces_and_escapes(accessibility):
    node = accessibility._Node
    root = node("desktop-frame", {})
    app = node("application", {"name": "Calc & <Co>", "st:enabled": "true", "attr:toolkit": 'GTK "3"'})
    button = node("push-button", {"name": "OK", "cp:screencoord": "(10, 20)", "cp:size": "(30, 40)"},
                  text="a\x01b\ufffdc\nline")
    app.children.append(button)
    root.children.append(app)
    xml = accessibility.serialise(root)
    parsed = ET.fromstring(xml)
    ns = accessibility.NS
    [a] = parsed
    assert a.get("name") == "Calc & <Co>" and a.get(f"{{{ns['st']}}}enabled") == "true"
    assert a.get(f"{{{ns['attr']}}}toolkit") == 'GTK "3"'
    [b] = a
    assert b.tag == "push-button" and b.get(f"{{{ns['cp']}}}screencoord") == "(10, 20)"
    assert b.text == "ab\ufffdc\nline"  # a control character XML cannot hold is dropped
    assert all(f'xmlns:{p}="{uri}"' in xml.split(">", 1)[0] for p, uri in ns.items())
