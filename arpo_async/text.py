"""Text that can always travel: outside text made UTF-8-encodable where it enters the process.

JSON may spell a lone UTF-16 surrogate (``"\\ud800"``), and Python's json module turns it into a ``str`` that
UTF-8 cannot encode. msgpack refuses such a string, so one odd character in a desktop controller's answer or an
inference server's reply would make the trajectory that carries it unencodable (and, before this module, stop the
actor process). Every JSON answer of a controller or a server is read with :func:`loads_json`, and every text field
of a trajectory passes :func:`encodable` when the message is built (arpo_async.messages).

Role: pure functions; no dependency inside the project.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["encodable", "encodable_json", "loads_json"]


def encodable(text: str) -> str:
    """``text`` with every character UTF-8 cannot encode (a lone surrogate) written as its escape (``\\ud800``);
    ``text`` itself (no copy) when it is already encodable."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def encodable_json(value: Any) -> Any:
    """A parsed JSON value with :func:`encodable` applied to every string in it, keys included (walked without
    recursion, so as deep a value as the parser accepted)."""
    if isinstance(value, str):
        return encodable(value)
    if not isinstance(value, (dict, list)):
        return value
    root = [value]
    stack: list[tuple[Any, Any]] = [(root, 0)]
    while stack:
        parent, key = stack.pop()
        item = parent[key]
        if isinstance(item, str):
            parent[key] = encodable(item)
        elif isinstance(item, list):
            stack.extend((item, i) for i in range(len(item)))
        elif isinstance(item, dict):
            if not all(k.isascii() for k in item):
                fixed = {encodable(k): v for k, v in item.items()}
                item.clear()
                item.update(fixed)
            stack.extend((item, k) for k in item)
    return root[0]


def loads_json(text: str | bytes, **kwargs: Any) -> Any:
    """``json.loads(text, **kwargs)`` with every string made :func:`encodable`.

    Raises:
        ValueError: as json.loads (JSONDecodeError, or UnicodeDecodeError for bytes that are not UTF-8).
        RecursionError: as json.loads, for nesting deeper than the interpreter's recursion limit.
    """
    return encodable_json(json.loads(text, **kwargs))
