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


def int_range_regex(n: int) -> str:
    """Regex matching exactly the decimal integers 0..n (no sign, no leading zeros).

    Built digit by digit: all shorter numbers, then for each position of n a smaller digit there followed by
    any digits, then n itself. Example: 1931 -> ``[0-9]|[1-9][0-9]|[1-9][0-9]{2}|1[0-8][0-9]{2}|19[0-2][0-9]|
    193[0-1]|1931`` (as a group). Raises ValueError for n < 0.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    s = str(n)
    parts = ["[0-9]" if len(s) > 1 else f"[0-{s}]"]
    for length in range(2, len(s)):
        parts.append(f"[1-9][0-9]{{{length - 1}}}" if length > 2 else "[1-9][0-9]")
    if len(s) > 1:
        for i, ch in enumerate(s):
            lo = 1 if i == 0 else 0
            hi = int(ch) - 1
            if hi >= lo:
                rest = len(s) - i - 1
                tail = "" if rest == 0 else ("[0-9]" if rest == 1 else f"[0-9]{{{rest}}}")
                parts.append(f"{s[:i]}[{lo}-{hi}]{tail}")
        parts.append(s)
    return "(" + "|".join(parts) + ")"


def action_regex(*, max_thought_chars: int = 20, max_coord_digits: int = 4, max_text_chars: int = 16,
                 actions: tuple[str, ...] = DEFAULT_ACTIONS, max_x: int | None = None,
                 max_y: int | None = None) -> str:
    """Regex for ``Thought: <words of letters>\\nAction: <one action call>``.

    Args:
        max_thought_chars: the thought is 1..max_thought_chars of ``[A-Za-z ]`` (letters as a label is shown).
        max_coord_digits: each coordinate is 1..max_coord_digits decimal digits (the parser clamps to the screen).
        max_x, max_y: when given, x is limited to 0..max_x and y to 0..max_y instead (pass the resized image's
            width - 1 and height - 1 so every point lies on the image the model sees).
        max_text_chars: ``type`` content is 1..max_text_chars of ``[a-z0-9 ]`` plus an optional trailing
            ``\\n`` escape (submit); ``finished`` content is 0..max_text_chars of the same.
        actions: which action calls to allow; names from ``DEFAULT_ACTIONS`` plus ``"call_user"``.
    Returns:
        The regex source string (no anchors; SGLang and xgrammar match it against the whole reply).
    Raises:
        ValueError: unknown action name, an empty action tuple, a bound below 1, or a negative max_x / max_y.
    """
    if min(max_thought_chars, max_coord_digits, max_text_chars) < 1:
        raise ValueError("max_thought_chars, max_coord_digits and max_text_chars must all be >= 1")
    if (max_x is not None and max_x < 0) or (max_y is not None and max_y < 0):
        raise ValueError(f"max_x and max_y must be >= 0, got {max_x}, {max_y}")
    num = f"[0-9]{{1,{max_coord_digits}}}"
    x = num if max_x is None else int_range_regex(max_x)
    y = num if max_y is None else int_range_regex(max_y)
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
