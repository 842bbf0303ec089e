"""Actions -> OSWorld's pyautogui code, and the commands that run it inside a desktop
(``actors.action_backend = "pyautogui"``; the faster default is actors/uitars/xdotool.py).

Role: pure translation; nothing here executes anything. :func:`to_pyautogui` writes the Python an OSWorld-style
agent emits for an action (UI-TARS ``parsing_response_to_pyautogui_code``: click, doubleClick, right click,
moveTo + dragTo, hotkey, write(interval=0.1) + press('enter') for a trailing newline, scroll(+-5, x, y); OSWorld's
special actions ``DONE``, ``FAIL``, ``WAIT``). :func:`to_commands` wraps it the way OSWorld's PythonController
runs it (desktop_env/controllers/python.py ``execute_python_command``: ``python -c`` with the prefix
:data:`PKGS_PREFIX`), as argv lists for the controller's ``/execute``, so it needs ``python`` and pyautogui in the
desktop image (python-is-python3, python3-xlib and actors/desktop/image/python-wheels.txt).

Cost: a Python start-up and ``import pyautogui`` per action (~0.2 s), plus pyautogui's own pauses (0.1 s after
each call, 0.1 s per typed character, 1 s per drag), against milliseconds for xdotool.
"""

from __future__ import annotations

from actors.uitars.actions import Action
from actors.uitars.xdotool import SCROLL_CLICKS, UnsupportedActionError

PKGS_PREFIX = "import pyautogui; import time; pyautogui.FAILSAFE = False; {command}"
"""OSWorld PythonController's default ``pkgs_prefix``: what runs before an action's code."""
PYTHON = "python"
"""The interpreter OSWorld's PythonController calls (``python`` on the desktop's PATH)."""


_PYAUTOGUI_KEYS = {"win": "win", "esc": "esc", "capslock": "capslock", "print": "printscreen"}


def to_pyautogui(action: Action) -> str:
    """OSWorld's pyautogui code for ``action`` (for driving real OSWorld VMs), or ``DONE``/``FAIL``/``WAIT``.

    Mapping as UI-TARS ``parsing_response_to_pyautogui_code`` (with ``input_swap=False``, as ARPO runs it):
    click -> ``pyautogui.click(x, y, button='left')``; left_double -> ``doubleClick``; right_single ->
    ``click(button='right')``; hover -> ``moveTo``; drag -> ``moveTo`` + ``dragTo(duration=1.0)``; hotkey ->
    ``hotkey(*keys)``; type -> ``write(text, interval=0.1)`` (+ ``press('enter')`` for a trailing newline);
    scroll up/down -> ``scroll(+-5, x=, y=)``, left/right -> ``hscroll(-+5, ...)``.
    Raises:
        UnsupportedActionError: unknown kind or missing field.
    """
    k = action.kind
    if k == "finished":
        return "DONE"
    if k == "fail":
        return "FAIL"
    if k == "wait":
        return "WAIT"

    def xy(p: tuple[float, float] | None) -> str:
        if p is None:
            raise UnsupportedActionError(f"{k} needs a point: {action}")
        return f"{round(p[0], 3)}, {round(p[1], 3)}"

    lines = ["import pyautogui", "import time"]
    if k == "click":
        lines.append(f"pyautogui.click({xy(action.point)}, button='left')")
    elif k == "left_double":
        lines.append(f"pyautogui.doubleClick({xy(action.point)}, button='left')")
    elif k == "right_single":
        lines.append(f"pyautogui.click({xy(action.point)}, button='right')")
    elif k == "hover":
        lines.append(f"pyautogui.moveTo({xy(action.point)})")
    elif k == "drag":
        lines += [f"pyautogui.moveTo({xy(action.point)})", f"pyautogui.dragTo({xy(action.end_point)}, duration=1.0)"]
    elif k in ("hotkey", "key_down", "key_up"):
        keys = [" " if x == "space" else _PYAUTOGUI_KEYS.get(x, x) for x in action.keys]
        if not keys:
            raise UnsupportedActionError(f"{k} needs keys: {action}")
        if k == "hotkey":
            lines.append(f"pyautogui.hotkey({', '.join(repr(x) for x in keys)})")
        else:
            verb = "keyDown" if k == "key_down" else "keyUp"
            lines += [f"pyautogui.{verb}({x!r})" for x in keys]
    elif k == "type":
        text = action.text or ""
        body = text[:-1] if action.submits else text
        if body:
            lines += [f"pyautogui.write({body!r}, interval=0.1)", "time.sleep(0.5)"]
        if action.submits:
            lines.append("pyautogui.press('enter')")
    elif k == "scroll":
        at = f", x={round(action.point[0], 3)}, y={round(action.point[1], 3)}" if action.point else ""
        amount = {"up": SCROLL_CLICKS, "down": -SCROLL_CLICKS, "left": -SCROLL_CLICKS, "right": SCROLL_CLICKS}
        if action.direction not in amount:
            raise UnsupportedActionError(f"scroll needs a direction: {action}")
        fn = "scroll" if action.direction in ("up", "down") else "hscroll"
        lines.append(f"pyautogui.{fn}({amount[action.direction]}{at})")
    else:
        raise UnsupportedActionError(f"unknown action kind {k!r}")
    return "\n".join(lines)


def to_commands(action: Action) -> list[list[str]]:
    """argv lists that perform ``action`` through pyautogui inside a desktop; run them in order, each must exit 0.

    Returns ``[["python", "-c", PKGS_PREFIX + code]]``, or an empty list for wait, finished and fail (the actor
    handles those itself), the same contract as :func:`actors.uitars.xdotool.to_commands`.
    Raises:
        UnsupportedActionError: unknown kind or missing field.
    """
    code = to_pyautogui(action)
    if code in ("DONE", "FAIL", "WAIT"):
        return []
    return [[PYTHON, "-c", PKGS_PREFIX.format(command=code)]]
