"""Actions -> xdotool argv lists that perform them inside a desktop (``actors.action_backend = "xdotool"``; the
pyautogui backend, OSWorld's way, is actors/uitars/pyautogui.py).

Role: pure translation; the desktop runs the commands (through the controller's ``/execute``, which takes an
argv list, never a shell string). Nothing here executes anything.

Pointer actions are one xdotool process each: ``xdotool mousemove X-1 Y mousemove --sync X Y click --delay 0 1``.
- ``click`` sleeps ~100 ms after clicking unless given ``--delay`` (xdotool's ``cmd_click.c``: ``delay = 100000;
  /* 100ms */`` passed to ``xdo_click_window_multiple``; measured with Debian 12's xdotool 3.20160805); ``--delay 0``
  removes that, and ``--sync`` returns only once the pointer is at (X, Y), so the window manager and the app
  have seen the pointer enter before the button press arrives. ``--sync`` waits for the pointer to *change*
  position (it hung ~15 s when already at the target), hence the unsynced one-pixel move before it.
- Focus: while this project's desktop image was built (Xvfb + openbox), the first click on an unfocused window
  was sometimes lost. Activating "the
  window under the cursor" first is not possible robustly with Debian 12's xdotool (3.20160805):
  ``getmouselocation`` there does not push onto the window stack (so ``windowactivate %1`` cannot follow it),
  it reports openbox's frame rather than the client, and ``windowactivate`` needs EWMH and fails (aborting the
  chain) on the root window or without a window manager. Openbox's default click-to-focus binding replays the
  press to the client; measured on Xvfb + openbox + Tk, alternating these commands between two unfocused
  windows delivered 200 of 200 clicks, and the first click on a just-mapped window too. So pointer actions
  rely on ``--sync`` and openbox's replay, with no activation step.

Coordinates are rounded to whole pixels. Keys use X keysym names. The commands need ``DISPLAY`` set in the
environment they run in (the controller's). Measured costs: a click ~4 ms, a double click ~85 ms (xdotool sleeps
``--delay`` after each of the two clicks), typing ~12 ms per character.
"""

from __future__ import annotations

from actors.uitars.actions import Action

SCROLL_CLICKS = 5
"""Wheel clicks per scroll action (UI-TARS/OSWorld: pyautogui.scroll(+-5))."""
DOUBLE_CLICK_GAP_MS = 40
"""Gap between the two clicks of a double click: well inside every toolkit's double-click time (>= 200 ms)."""
DRAG_STEPS = 4
"""Intermediate pointer moves of a drag, so toolkits see motion past their drag threshold between the ends."""

_KEYSYMS: dict[str, str] = {
    "ctrl": "ctrl", "shift": "shift", "alt": "alt", "win": "super", "enter": "Return", "esc": "Escape",
    "tab": "Tab", "backspace": "BackSpace", "delete": "Delete", "space": "space", "up": "Up", "down": "Down",
    "left": "Left", "right": "Right", "pageup": "Prior", "pagedown": "Next", "home": "Home", "end": "End",
    "insert": "Insert", "capslock": "Caps_Lock", "print": "Print", "menu": "Menu",
    "`": "grave", "-": "minus", "=": "equal", "[": "bracketleft", "]": "bracketright", "\\": "backslash",
    ";": "semicolon", "'": "apostrophe", ",": "comma", ".": "period", "/": "slash", "+": "plus",
    **{f"f{i}": f"F{i}" for i in range(1, 13)},
}
_BUTTONS = {"up": "4", "down": "5", "left": "6", "right": "7"}


class UnsupportedActionError(ValueError):
    """An Action that this backend cannot perform (an unknown kind, or a missing field)."""


def keysym(key: str) -> str:
    """Canonical UI-TARS key name (``actions.canonical_key``) -> X keysym name for ``xdotool key``.

    Letters and digits map to themselves; ``ctrl``/``shift``/``alt``/``super`` are xdotool's modifier aliases.
    Raises:
        UnsupportedActionError: a name outside the canonical vocabulary.
    """
    if key in _KEYSYMS:
        return _KEYSYMS[key]
    if len(key) == 1 and key.isascii() and key.isalnum():
        return key
    raise UnsupportedActionError(f"no X keysym for key {key!r}")


def _pixel(p: tuple[float, float] | None, action: Action) -> tuple[int, int]:
    if p is None:
        raise UnsupportedActionError(f"{action.kind} needs a point: {action}")
    return int(round(p[0])), int(round(p[1]))


def _move(p: tuple[int, int], prev: tuple[int, int] | None = None) -> list[str]:
    """xdotool words that put the pointer at ``p`` and wait (--sync) until it is there.

    ``mousemove --sync`` waits for the pointer to *change* position, so it hangs (about 15 s, measured) when the
    pointer is already at the target. With no known previous position, a first unsynced move one pixel to the
    side (left, or right at x=0: always on screen) guarantees a change; the X server applies both moves in order.
    When ``prev`` (the pointer's position from the same chain) equals ``p``, nothing is emitted.
    """
    x, y = p
    if prev == p:
        return []
    nudge = ["mousemove", str(x - 1 if x >= 1 else x + 1), str(y)] if prev is None else []
    return [*nudge, "mousemove", "--sync", str(x), str(y)]


def to_commands(action: Action, *, type_delay_ms: int = 12) -> list[list[str]]:
    """xdotool argv lists that perform ``action``; run them in order, each must exit 0.

    Args:
        action: a parsed action (screen pixels).
        type_delay_ms: delay between typed characters (xdotool's default is 12 ms).
    Returns:
        A list of argv lists (each starting with ``"xdotool"``); empty for wait, finished and fail, which the
        actor handles itself (wait = sleep and screenshot; finished/fail end the episode).
    Raises:
        UnsupportedActionError: unknown kind or missing field.
    """
    k = action.kind
    if k in ("wait", "finished", "fail"):
        return []
    if k in ("click", "left_double", "right_single", "hover"):
        click = {"click": ["click", "--delay", "0", "1"],
                 "left_double": ["click", "--repeat", "2", "--delay", str(DOUBLE_CLICK_GAP_MS), "1"],
                 "right_single": ["click", "--delay", "0", "3"], "hover": []}[k]
        return [["xdotool", *_move(_pixel(action.point, action)), *click]]
    if k == "drag":
        if action.point is None or action.end_point is None:
            raise UnsupportedActionError(f"drag needs both points: {action}")
        (sx, sy), (ex, ey) = action.point, action.end_point
        start = _pixel(action.point, action)
        argv = ["xdotool", *_move(start), "mousedown", "1"]
        prev = start
        for i in range(1, DRAG_STEPS + 1):
            t = i / DRAG_STEPS
            p = _pixel((sx + (ex - sx) * t, sy + (ey - sy) * t), action)
            argv += _move(p, prev)
            prev = p
        return [argv + ["mouseup", "1"]]
    if k == "scroll":
        button = _BUTTONS.get(action.direction or "")
        if button is None:
            raise UnsupportedActionError(f"scroll needs a direction: {action}")
        move = _move(_pixel(action.point, action)) if action.point is not None else []
        return [["xdotool", *move, "click", "--repeat", str(SCROLL_CLICKS), "--delay", "0", button]]
    if k in ("hotkey", "key_down", "key_up"):
        if not action.keys:
            raise UnsupportedActionError(f"{k} needs keys: {action}")
        verb = {"hotkey": "key", "key_down": "keydown", "key_up": "keyup"}[k]
        return [["xdotool", verb, "+".join(keysym(x) for x in action.keys)]]
    if k == "type":
        text = action.text or ""
        body = text[:-1] if action.submits else text
        commands = []
        if body:
            commands.append(["xdotool", "type", "--delay", str(type_delay_ms), "--", body])
        if action.submits:
            commands.append(["xdotool", "key", "Return"])
        return commands
    raise UnsupportedActionError(f"unknown action kind {k!r}")
