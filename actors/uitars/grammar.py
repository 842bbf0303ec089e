"""A regular expression for constrained decoding that only admits parseable UI-TARS replies.

Role: passed as SGLang's ``sampling_params["regex"]`` (also accepted by arpo-serve), it makes even an untrained
or tiny random policy emit ``Thought: ...\\nAction: ...`` replies that ``actions.parse_reply`` accepts, so the
whole pipeline (prompt -> generate -> parse -> execute -> train) runs before the policy has learnt the format.

Invariant (property-tested): every string the regex fully matches parses with ``parse_reply`` in either
coordinate mode. Only constructs both Python ``re`` and xgrammar's regex front end accept are used: literals,
escaped metacharacters, character classes, ``{m,n}`` repeats, groups and alternation. Points use the plain
``(x,y)`` form because ``<|box_start|>`` is a special token that constrained decoding cannot emit as text.
"""

from __future__ import annotations

DEFAULT_ACTIONS: tuple[str, ...] = (
    "click", "left_double", "right_single", "drag", "hotkey", "type", "scroll", "wait", "finished",
)
"""The actions of ARPO's prompt. ``call_user`` (FAIL) is available but not a default."""

HOTKEYS: tuple[str, ...] = (
    "enter", "esc", "tab", "backspace", "delete", "space", "up", "down", "left", "right",
    "ctrl a", "ctrl c", "ctrl v", "ctrl x", "ctrl z", "ctrl s", "ctrl f", "alt f4", "ctrl shift t",
)
"""Key combinations the regex offers to ``hotkey``; all are canonical (``actions.canonical_key``)."""


def int_range_regex(n: int, *, fixed_width: bool = False) -> str:
    """Regex matching exactly the decimal integers 0..n.

    Variable width (default): no sign, no leading zeros. Built digit by digit: all shorter numbers, then for each
    position of n a smaller digit there followed by any digits, then n itself. Example: 1931 -> ``[0-9]|[1-9][0-9]|
    [1-9][0-9]{2}|1[0-8][0-9]{2}|19[0-2][0-9]|193[0-1]|1931`` (as a group).

    ``fixed_width=True``: every integer is written with exactly ``len(str(n))`` digits, zero-padded (139 ->
    ``0[0-9]{2}|1[0-2][0-9]|13[0-9]|139``; 999 -> ``[0-9]{3}``). A sampler then always emits the same number of
    digit positions, so an untrained policy clicks every part of the range alike instead of preferring short
    numbers (issue 12 measured hit rates of 0.41 vs 0.01 between buttons with variable widths).

    Raises ValueError for n < 0.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    s = str(n)
    if fixed_width:
        if set(s) == {"9"}:
            return f"([0-9]{{{len(s)}}})"
        return "(" + "|".join(_below_prefix(s, lo_first=0) + [s]) + ")"
    parts = ["[0-9]" if len(s) > 1 else f"[0-{s}]"]
    for length in range(2, len(s)):
        parts.append(f"[1-9][0-9]{{{length - 1}}}" if length > 2 else "[1-9][0-9]")
    if len(s) > 1:
        parts += _below_prefix(s, lo_first=1)
        parts.append(s)
    return "(" + "|".join(parts) + ")"


def _below_prefix(s: str, *, lo_first: int) -> list[str]:
    """Alternatives for the len(s)-digit strings below s: s[:i], a smaller digit at i (>= lo_first at i = 0),
    then any digits."""
    parts = []
    for i, ch in enumerate(s):
        lo = lo_first if i == 0 else 0
        hi = int(ch) - 1
        if hi >= lo:
            rest = len(s) - i - 1
            tail = "" if rest == 0 else ("[0-9]" if rest == 1 else f"[0-9]{{{rest}}}")
            digit = str(lo) if lo == hi else f"[{lo}-{hi}]"
            parts.append(f"{s[:i]}{digit}{tail}")
    return parts


def action_regex(*, max_thought_chars: int = 20, max_coord_digits: int = 4, max_text_chars: int = 16,
                 actions: tuple[str, ...] = DEFAULT_ACTIONS, max_x: int | None = None,
                 max_y: int | None = None, fixed_width: bool = False) -> str:
    """Regex for ``Thought: <words of letters>\\nAction: <one action call>``.

    Args:
        max_thought_chars: the thought is 1..max_thought_chars of ``[A-Za-z ]`` (letters as a label is shown).
        max_coord_digits: each coordinate is 1..max_coord_digits decimal digits (the parser clamps to the screen).
        max_x, max_y: when given, x is limited to 0..max_x and y to 0..max_y instead (pass the resized image's
            width - 1 and height - 1 so every point lies on the image the model sees; 999 for relative1000).
        fixed_width: with max_x and max_y, write every coordinate zero-padded to the width of its maximum
            (``int_range_regex(..., fixed_width=True)``), e.g. ``(045,730)`` for relative1000.
        max_text_chars: ``type`` content is 1..max_text_chars of ``[a-z0-9 ]`` plus an optional trailing
            ``\\n`` escape (submit); ``finished`` content is 0..max_text_chars of the same.
        actions: which action calls to allow; names from ``DEFAULT_ACTIONS`` plus ``"call_user"``.
    Returns:
        The regex source string (no anchors; SGLang and xgrammar match it against the whole reply).
    Raises:
        ValueError: unknown action name, an empty action tuple, a bound below 1, a negative max_x / max_y, or
            fixed_width without max_x and max_y.
    """
    if min(max_thought_chars, max_coord_digits, max_text_chars) < 1:
        raise ValueError("max_thought_chars, max_coord_digits and max_text_chars must all be >= 1")
    if (max_x is not None and max_x < 0) or (max_y is not None and max_y < 0):
        raise ValueError(f"max_x and max_y must be >= 0, got {max_x}, {max_y}")
    if fixed_width and (max_x is None or max_y is None):
        raise ValueError("fixed_width needs max_x and max_y (the width of a coordinate is that of its maximum)")
    num = f"[0-9]{{1,{max_coord_digits}}}"
    x = num if max_x is None else int_range_regex(max_x, fixed_width=fixed_width)
    y = num if max_y is None else int_range_regex(max_y, fixed_width=fixed_width)
    point = rf"'\({x},{y}\)'"
    text = f"[a-z0-9 ]{{1,{max_text_chars}}}"
    alternatives = {
        "click": rf"click\(start_box={point}\)",
        "left_double": rf"left_double\(start_box={point}\)",
        "right_single": rf"right_single\(start_box={point}\)",
        "drag": rf"drag\(start_box={point}, end_box={point}\)",
        "hotkey": r"hotkey\(key='(" + "|".join(HOTKEYS) + r")'\)",
        "type": rf"type\(content='{text}(\\n)?'\)",
        "scroll": rf"scroll\(start_box={point}, direction='(up|down|left|right)'\)",
        "wait": r"wait\(\)",
        "finished": rf"finished\(content='[a-z0-9 ]{{0,{max_text_chars}}}'\)",
        "call_user": r"call_user\(\)",
    }
    if not actions:
        raise ValueError("actions must name at least one action")
    unknown = [a for a in actions if a not in alternatives]
    if unknown:
        raise ValueError(f"unknown actions {unknown}; choose from {sorted(alternatives)}")
    body = "|".join(alternatives[a] for a in actions)
    return rf"Thought: [A-Za-z ]{{1,{max_thought_chars}}}\nAction: ({body})"
