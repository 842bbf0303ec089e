"""UI-TARS replies -> typed actions in real screen pixels.

Role: the pure parser of the policy's output language (UI-TARS's action space; sources
below). A reply looks like::

    Thought: I need to open the file menu.
    Action: click(start_box='<|box_start|>(235,512)<|box_end|>')

Owns: the ``Action`` value type, the key-name vocabulary, ``smart_resize`` and the coordinate mapping.
Invariants: a returned ``Action`` is complete and executable (points inside the screen, a known scroll
direction, known keys); anything else raises ``ActionParseError`` with a message naming what was wrong.

Sources (facts, not code): bytedance/UI-TARS ``codes/ui_tars/action_parser.py`` (``smart_resize``,
``parse_action_to_structure_output``: UI-TARS-1.5 / Qwen2.5-VL coordinates are absolute pixels of the
smart-resized image, divided by the resized width/height; Qwen2-VL-era models use 0..1000 relative
coordinates, divided by 1000; ``point=``/``start_point=``/``end_point=`` and ``<point>x y</point>`` are
rewritten to ``start_box``/``end_box``; a box of 4 numbers means its centre; several actions may be separated
by a blank line), and dvlab-research/ARPO ``verl/trainer/gui_agent.py`` (``finished``, ``wait`` and
``call_user`` end the action list; ``call_user`` means FAIL).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, NamedTuple

from arpo_async.model.inputs import ModelInputError
from arpo_async.model.inputs import smart_resize as _qwen_smart_resize

CoordinateMode = Literal["absolute", "relative1000"]

ACTION_KINDS: tuple[str, ...] = (
    "click", "left_double", "right_single", "hover", "drag", "hotkey", "key_down", "key_up",
    "type", "scroll", "wait", "finished", "fail",
)
"""Every ``Action.kind``. ``fail`` is UI-TARS's ``call_user()`` (OSWorld's FAIL: the agent gives up)."""

TERMINAL_KINDS: frozenset[str] = frozenset({"finished", "fail"})
SCROLL_DIRECTIONS: tuple[str, ...] = ("up", "down", "left", "right")

# Canonical key names (pyautogui's spelling, which UI-TARS was trained to emit) and their aliases.
_KEY_ALIASES: dict[str, str] = {
    "control": "ctrl", "ctl": "ctrl", "return": "enter", "escape": "esc", "del": "delete",
    "arrowup": "up", "arrowdown": "down", "arrowleft": "left", "arrowright": "right",
    "cmd": "win", "command": "win", "super": "win", "meta": "win", "windows": "win", "option": "alt",
    "page_up": "pageup", "page_down": "pagedown", "pgup": "pageup", "pgdn": "pagedown", "caps_lock": "capslock",
    "spacebar": "space", "back": "backspace", "ins": "insert", "printscreen": "print", "prtsc": "print",
}
NAMED_KEYS: frozenset[str] = frozenset({
    "ctrl", "shift", "alt", "win", "enter", "esc", "tab", "backspace", "delete", "space", "up", "down", "left",
    "right", "pageup", "pagedown", "home", "end", "insert", "capslock", "print", "menu",
    *(f"f{i}" for i in range(1, 13)),
})
PUNCTUATION_KEYS: frozenset[str] = frozenset("`-=[]\\;',./+")
"""Single printable keys accepted besides letters and digits (``hotkey(key='ctrl +')``)."""


class ActionParseError(ValueError):
    """A reply is not a well-formed UI-TARS action; the message says what is wrong and quotes the culprit."""


class Size(NamedTuple):
    """An image or screen size in pixels."""

    width: int
    height: int


@dataclass(frozen=True)
class Action:
    """One executable GUI action, coordinates in real screen pixels (floats, clamped to the screen).

    Attributes:
        kind: one of ``ACTION_KINDS``.
        point: (x, y) target of click / left_double / right_single / hover / drag start; the scroll position
            (``None`` for a scroll at the current pointer); ``None`` for keyboard and control actions.
        end_point: (x, y) drag end; ``None`` otherwise.
        text: ``type`` content (a trailing ``"\\n"`` means "then press Enter") or ``finished`` content.
        key: ``hotkey`` / ``key_down`` / ``key_up`` keys, canonical names joined by single spaces
            (``"ctrl shift t"``); ``None`` otherwise.
        direction: scroll direction, one of ``SCROLL_DIRECTIONS``; ``None`` otherwise.
    """

    kind: str
    point: tuple[float, float] | None = None
    end_point: tuple[float, float] | None = None
    text: str | None = None
    key: str | None = None
    direction: str | None = None

    @property
    def keys(self) -> tuple[str, ...]:
        """The canonical key names of ``key``, in press order (empty when ``key`` is None)."""
        return tuple(self.key.split(" ")) if self.key else ()

    @property
    def submits(self) -> bool:
        """True for a ``type`` whose content ends in a newline (press Enter after typing)."""
        return self.kind == "type" and bool(self.text) and self.text.endswith("\n")


@dataclass(frozen=True)
class Parsed:
    """A parsed reply.

    Attributes:
        thought: the text after ``Thought:`` (or ``Action_Summary:``), stripped; ``""`` when absent.
        actions: the actions in execution order, at least one. As in ARPO, when a control action
            (``finished``, ``fail``, ``wait``) appears, it alone is kept.
    """

    thought: str
    actions: tuple[Action, ...]

    @property
    def action(self) -> Action:
        """The first action (the only one in the usual one-action reply)."""
        return self.actions[0]


def canonical_key(name: str) -> str:
    """Map one UI-TARS key name to its canonical spelling.

    Args:
        name: a key as the model writes it: ``"Ctrl"``, ``"arrowdown"``, ``"Return"``, ``"a"``, ``"F5"``.
    Returns:
        lowercase canonical name: a member of ``NAMED_KEYS``, one letter/digit, or one of ``PUNCTUATION_KEYS``.
    Raises:
        ActionParseError: unknown key.
    """
    raw = name.strip()
    k = raw.lower()
    k = _KEY_ALIASES.get(k, k)
    if k in NAMED_KEYS or k in PUNCTUATION_KEYS or (len(k) == 1 and k.isascii() and k.isalnum()):
        return k
    raise ActionParseError(f"unknown key {name!r}; expected a letter, a digit, punctuation or one of "
                           f"{sorted(NAMED_KEYS)}")


def smart_resize(*, width: int, height: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 2_116_800) -> Size:
    """The size Qwen2-VL / Qwen2.5-VL's image processor resizes an image to (the size the model sees).

    Both sides become multiples of ``factor`` with the aspect ratio kept as closely as possible and the area
    within [min_pixels, max_pixels]. A (width, height) view of `arpo_async.model.inputs.smart_resize`, the one
    implementation that actors, arpo-serve and the trainer share (source: Qwen2-VL ``smart_resize``).
    Defaults are ARPO's processor settings (min 3136, max 2,116,800 = 2,691 tokens at 1920x1080).
    Example: 1920x1080 -> 1932x1092.

    Args:
        width, height: the original image size in pixels (> 0).
    Returns:
        Size(width, height) after resizing.
    Raises:
        ValueError: a non-positive side, or an aspect ratio above 200.
    """
    try:
        h, w = _qwen_smart_resize(height, width, factor, min_pixels, max_pixels)
    except ModelInputError as e:
        raise ValueError(str(e)) from e
    return Size(w, h)


# ---------------------------------------------------------------------------------------------------------------
# Reply -> (thought, action strings)

_SPECIAL_TOKENS = ("<|im_end|>", "<|endoftext|>")
_THOUGHT = re.compile(r"(?:Thought|Action_Summary):\s*(.*?)(?=\s*Action:|\Z)", re.DOTALL)
_CALL = re.compile(r"\A\s*([A-Za-z_]\w*)\s*\((.*)\)\s*\Z", re.DOTALL)
_KWARG = re.compile(r"""\s*([A-Za-z_]\w*)\s*=\s*(?:'((?:[^'\\]|\\.)*)'|"((?:[^"\\]|\\.)*)")\s*(,|\Z)""", re.DOTALL)
_FREE_TEXT = re.compile(r"""\A\s*content\s*=\s*(['"])(.*)\1\s*\Z""", re.DOTALL)
_NUM = r"\s*(-?\d+(?:\.\d+)?)\s*"
_TUPLE = re.compile(rf"\A\s*[(\[]{_NUM},{_NUM}(?:,{_NUM},{_NUM})?[)\]]\s*\Z")
_POINT_TAG = re.compile(rf"\A\s*<point>{_NUM}[\s,]{_NUM}</point>\s*\Z")
_BBOX_TAG = re.compile(rf"\A\s*<bbox>{_NUM}[\s,]{_NUM}[\s,]{_NUM}[\s,]{_NUM}</bbox>\s*\Z")
_ESCAPES = {"n": "\n", "t": "\t", "'": "'", '"': '"', "\\": "\\"}


def _unescape(s: str) -> str:
    """Python-style escapes the prompt asks for (\\', \\", \\n, \\t, \\\\); other backslashes stay."""
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), m.group(0)), s, flags=re.DOTALL)


def _split_reply(text: str) -> tuple[str, list[str]]:
    for tok in _SPECIAL_TOKENS:
        text = text.replace(tok, "")
    text = text.strip()
    if "Action:" not in text:
        raise ActionParseError(f"reply has no 'Action:' part: {text[:200]!r}")
    m = _THOUGHT.search(text)
    thought = m.group(1).strip() if m else ""
    body = text.split("Action:")[-1].strip()
    if not body:
        raise ActionParseError("reply has an empty 'Action:' part")
    calls = [c.strip() for c in re.split(r"\)\s*\n\s*\n", body)]
    # re.split ate each closing parenthesis but the last: put them back.
    calls = [c + ")" for c in calls[:-1]] + calls[-1:]
    return thought, [c for c in calls if c]


def _parse_call(call: str) -> tuple[str, dict[str, str]]:
    """``name(k='v', ...)`` -> (name, {k: unescaped v}). Content of type/finished may hold unescaped quotes."""
    m = _CALL.match(call)
    if not m:
        raise ActionParseError(f"action is not a call like name(arg='...'): {call[:200]!r}")
    name, args = m.group(1), m.group(2)
    if name in ("type", "finished"):
        free = _FREE_TEXT.match(args)  # greedy: the last matching quote closes the content
        if free:
            return name, {"content": _unescape(free.group(2))}
    kwargs: dict[str, str] = {}
    pos = 0
    while pos < len(args):
        km = _KWARG.match(args, pos)
        if not km or km.end() == pos:
            if args[pos:].strip() == "":
                break
            raise ActionParseError(f"cannot read the arguments of {name}(...) at {args[pos:pos + 80]!r}; "
                                   f"expected key='value' pairs")
        value = km.group(2) if km.group(2) is not None else km.group(3)
        kwargs[km.group(1)] = _unescape(value)
        pos = km.end()
    return name, kwargs


# ---------------------------------------------------------------------------------------------------------------
# Coordinates

def _read_xy(value: str, arg: str) -> tuple[float, float]:
    """A box/point string in model coordinates -> its (x, y) centre in model coordinates."""
    v = value.replace("<|box_start|>", "").replace("<|box_end|>", "").strip()
    for pattern in (_TUPLE, _POINT_TAG, _BBOX_TAG):
        m = pattern.match(v)
        if m:
            nums = [float(g) for g in m.groups() if g is not None]
            if len(nums) == 4:
                return (nums[0] + nums[2]) / 2, (nums[1] + nums[3]) / 2
            return nums[0], nums[1]
    raise ActionParseError(f"{arg}={value!r} is not a point; expected '(x,y)', '[x1,y1,x2,y2]', "
                           f"'<point>x y</point>' or '<|box_start|>(x,y)<|box_end|>'")


class _Mapper:
    """Model coordinates -> screen pixels. Formula (UI-TARS action_parser.py + parsing_response_to_pyautogui_code):
    absolute: x_screen = x / resized_w * screen_w; relative1000: x_screen = x / 1000 * screen_w;
    then clamped to [0, screen_w - 1] x [0, screen_h - 1]."""

    def __init__(self, resized: tuple[int, int], screen: tuple[int, int], mode: str) -> None:
        if mode not in ("absolute", "relative1000"):
            raise ValueError(f"coordinate_mode must be 'absolute' or 'relative1000', got {mode!r}")
        if min(*resized, *screen) <= 0:
            raise ValueError(f"sizes must be positive, got resized={resized} screen={screen}")
        self.sx = screen[0] / (resized[0] if mode == "absolute" else 1000)
        self.sy = screen[1] / (resized[1] if mode == "absolute" else 1000)
        self.screen = screen

    def __call__(self, xy: tuple[float, float]) -> tuple[float, float]:
        x = min(max(xy[0] * self.sx, 0.0), self.screen[0] - 1.0)
        y = min(max(xy[1] * self.sy, 0.0), self.screen[1] - 1.0)
        return x, y


# ---------------------------------------------------------------------------------------------------------------
# Call -> Action

_POINT_ARGS = {"start_box": "start", "point": "start", "start_point": "start",
               "end_box": "end", "end_point": "end"}
_CLICKS = {"click": "click", "left_single": "click", "left_double": "left_double",
           "right_single": "right_single", "hover": "hover"}
_ALLOWED: dict[str, frozenset[str]] = {
    **{k: frozenset({"start"}) for k in _CLICKS},
    "drag": frozenset({"start", "end"}), "select": frozenset({"start", "end"}),
    "scroll": frozenset({"start", "direction"}),
    "hotkey": frozenset({"key"}), "press": frozenset({"key"}), "keydown": frozenset({"key"}),
    "keyup": frozenset({"key"}), "type": frozenset({"content"}), "finished": frozenset({"content"}),
    "wait": frozenset(), "call_user": frozenset(),
}


def _to_action(name: str, kwargs: dict[str, str], mapper: _Mapper) -> Action:
    if name not in _ALLOWED:
        raise ActionParseError(f"unknown action {name!r}; expected one of {sorted(_ALLOWED)}")
    args: dict[str, str] = {}
    for k, v in kwargs.items():
        slot = _POINT_ARGS.get(k, {"hotkey": "key", "press": "key"}.get(k, k))
        if slot not in _ALLOWED[name]:
            raise ActionParseError(f"{name}() takes no argument {k!r} (allowed: {sorted(_ALLOWED[name])})")
        if slot in args:
            raise ActionParseError(f"{name}() got {slot!r} twice")
        args[slot] = v

    def point(slot: str, required: bool = True) -> tuple[float, float] | None:
        if slot not in args or args[slot].strip() == "":
            if required:
                raise ActionParseError(f"{name}() needs {'a start' if slot == 'start' else 'an end'} point")
            return None
        return mapper(_read_xy(args[slot], f"{name}.{slot}"))

    def keys() -> str:
        names = args.get("key", "").split()
        if len(names) == 1:  # 'ctrl+c' means 'ctrl c'; '+' alone and 'ctrl++' keep their plus key
            names = re.split(r"(?<=.)\+(?=.)", names[0])
        if not names:
            raise ActionParseError(f"{name}() needs a non-empty key='...'")
        return " ".join(canonical_key(p) for p in names)

    if name in _CLICKS:
        return Action(_CLICKS[name], point=point("start"))
    if name in ("drag", "select"):
        return Action("drag", point=point("start"), end_point=point("end"))
    if name == "scroll":
        direction = args.get("direction", "").strip().lower()
        if direction not in SCROLL_DIRECTIONS:
            raise ActionParseError(f"scroll direction must be one of {SCROLL_DIRECTIONS}, got {direction!r}")
        return Action("scroll", point=point("start", required=False), direction=direction)
    if name in ("hotkey", "press"):
        return Action("hotkey", key=keys())
    if name in ("keydown", "keyup"):
        return Action("key_down" if name == "keydown" else "key_up", key=keys())
    if name == "type":
        if "content" not in args:
            raise ActionParseError("type() needs content='...'")
        return Action("type", text=args["content"])
    if name == "finished":
        return Action("finished", text=args.get("content", ""))
    if name == "wait":
        return Action("wait")
    return Action("fail")  # call_user


def parse_reply(text: str, *, resized_size: tuple[int, int], screen_size: tuple[int, int],
                coordinate_mode: CoordinateMode = "absolute") -> Parsed:
    """Parse one policy reply into actions in screen pixels.

    Accepted: ``Thought: ...\\nAction: ...`` (also ``Action_Summary:``, or no thought); every action of the
    UI-TARS space (``click``/``left_single``, ``left_double``, ``right_single``, ``hover``, ``drag``/``select``,
    ``hotkey``/``press``, ``keydown``, ``keyup``, ``type``, ``scroll``, ``wait``, ``finished``, ``call_user``);
    points as ``<|box_start|>(x,y)<|box_end|>``, ``(x,y)``, ``[x1,y1,x2,y2]`` (centre), ``<point>x y</point>``,
    ``<bbox>x1 y1 x2 y2</bbox>``, under ``start_box``/``end_box`` or ``point``/``start_point``/``end_point``;
    several actions separated by a blank line.

    Args:
        text: the decoded reply.
        resized_size: (width, height) of the image the model saw (``smart_resize`` of the screenshot).
        screen_size: (width, height) of the real screen in pixels.
        coordinate_mode: ``"absolute"`` (UI-TARS-1.5 / Qwen2.5-VL: pixels of the resized image) or
            ``"relative1000"`` (Qwen2-VL-era UI-TARS: 0..1000 of each side).
    Returns:
        Parsed(thought, actions), coordinates mapped as x * screen_w / resized_w (absolute) or
        x / 1000 * screen_w (relative1000), clamped to the screen (source: UI-TARS ``action_parser.py``).
    Raises:
        ActionParseError: no ``Action:`` part, an unknown action or argument, a missing or malformed point,
            an unknown key or scroll direction. The message quotes the offending part.
        ValueError: non-positive sizes or an unknown coordinate_mode (a caller bug, not a policy error).
    """
    mapper = _Mapper(tuple(resized_size), tuple(screen_size), coordinate_mode)
    thought, calls = _split_reply(text)
    actions = tuple(_to_action(*_parse_call(call), mapper) for call in calls)
    for a in actions:  # ARPO: finished / wait / call_user replace the whole list
        if a.kind in TERMINAL_KINDS or a.kind == "wait":
            return Parsed(thought, (a,))
    return Parsed(thought, actions)

