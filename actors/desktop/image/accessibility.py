"""The desktop's accessibility (AT-SPI) tree as OSWorld's controller serves it, and the terminal output read from it.

Facts mirrored from OSWorld desktop_env/server/main.py (routes /accessibility and /terminal, Linux branch,
``_create_atspi_node``); the code is ours (standard library + Debian's python3-pyatspi, no lxml):

* the answer is XML: a root ``<desktop-frame>`` declaring the namespaces of :data:`NS` (prefixes st, attr, cp,
  doc, docattr, txt, val, act), one child per application registered on the AT-SPI bus;
* an element per accessible, its tag the role name with spaces as dashes ("push button" -> ``push-button``;
  "unknown" when empty); attributes: ``name``; ``st:<state>="true"`` per state (``STATE_FOCUSED`` ->
  ``st:focused``); ``attr:<key>`` per object attribute; ``cp:screencoord="(x, y)"`` and ``cp:size="(w, h)"`` in
  screen pixels when the node is both visible and showing; ``image="true"`` / ``selection="true"`` when it
  implements Image / Selection; ``val:value``, ``val:min``, ``val:max``, ``val:step`` for Value;
  ``act:<action>_desc`` and ``act:<action>_kb`` per action (spaces in the name as dashes); its text content
  (Text interface; U+FFFC and U+FFFD removed) as the element's text;
* at most :data:`MAX_DEPTH` levels and :data:`MAX_WIDTH` children per node; a spreadsheet's table (an app whose
  tree has a ``document spreadsheet``) lists only its showing cells: row by row from the first showing cell,
  stopping at the first row with no showing cell after it (500 rows/columns scanned at most before one shows);
* /terminal: the text of the focused ``terminal`` of the active frame of ``gnome-terminal-server``, or null.
  Ours: any application's active frame is searched (a VTE terminal other than GNOME's counts too).

Ours: at most :data:`MAX_NODES` elements and :data:`DEADLINE_S` seconds per tree (the rest is left out, an app
that hangs cannot hold the request forever); characters XML 1.0 forbids are dropped; attribute keys that are not
XML names are skipped. Raises :class:`Unavailable` when pyatspi is not installed or the AT-SPI bus cannot be
reached.

Run as a program (``python3 accessibility.py tree|terminal``) by the controller, one process per request: a
fresh AT-SPI client sees the current set of applications (libatspi updates its caches only from a running
GLib main loop, which the controller has not), and an app that hangs the walk is killed with the process.
Prints the XML (tree) or JSON ``{"output": text|null}`` (terminal) on stdout; exit status 3 with the reason on
stderr when AT-SPI is unavailable.
"""
from __future__ import annotations

import json
import re
import sys
import time

NS = {
    "st": "https://accessibility.ubuntu.example.org/ns/state",
    "attr": "https://accessibility.ubuntu.example.org/ns/attributes",
    "cp": "https://accessibility.ubuntu.example.org/ns/component",
    "doc": "https://accessibility.ubuntu.example.org/ns/document",
    "docattr": "https://accessibility.ubuntu.example.org/ns/document/attributes",
    "txt": "https://accessibility.ubuntu.example.org/ns/text",
    "val": "https://accessibility.ubuntu.example.org/ns/value",
    "act": "https://accessibility.ubuntu.example.org/ns/action",
}
"""OSWorld's namespace map for Ubuntu trees (prefix -> URI)."""
MAX_DEPTH = 50
MAX_WIDTH = 1024
MAX_NODES = 50_000
DEADLINE_S = 60.0
SCAN_LIMIT = 500  # a spreadsheet table: rows (and columns) scanned before giving up on finding a showing cell

_XML_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_XML_BAD = re.compile("[^\t\n\r\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


class Unavailable(RuntimeError):
    """The AT-SPI tree cannot be read here (no pyatspi in the image, or no accessibility bus)."""


class _Node:
    """An XML element under construction: tag, ordered attributes (already prefixed), text, children."""

    __slots__ = ("tag", "attrs", "text", "children")

    def __init__(self, tag: str, attrs: dict[str, str], text: str = "") -> None:
        self.tag, self.attrs, self.text, self.children = tag, attrs, text, []


def _escape(text: str, quote: bool) -> str:
    text = _XML_BAD.sub("", text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    if quote:
        text = text.replace('"', "&quot;").replace("\n", "&#10;").replace("\r", "&#13;").replace("\t", "&#9;")
    return text


def serialise(node: _Node, root: bool = True) -> str:
    """XML text of ``node`` and its subtree; the root element declares every namespace of :data:`NS`."""
    out: list[str] = []

    def emit(n: _Node, decl: bool) -> None:
        out.append("<" + n.tag)
        if decl:
            out.extend(f' xmlns:{p}="{uri}"' for p, uri in NS.items())
        out.extend(f' {k}="{_escape(v, True)}"' for k, v in n.attrs.items())
        if not n.text and not n.children:
            out.append("/>")
            return
        out.append(">" + _escape(n.text, False))
        for c in n.children:
            emit(c, False)
        out.append(f"</{n.tag}>")

    emit(node, root)
    return "".join(out)


class _Walker:
    """One tree walk with a node budget and a deadline (ours)."""

    def __init__(self, pyatspi) -> None:
        self.pyatspi = pyatspi
        self.nodes = 0
        self.deadline = time.monotonic() + DEADLINE_S

    def exhausted(self) -> bool:
        return self.nodes >= MAX_NODES or time.monotonic() > self.deadline

    def node(self, acc, depth: int, flag: str | None = None) -> _Node:
        pa = self.pyatspi
        self.nodes += 1
        attrs: dict[str, str] = {"name": acc.name or ""}
        states = acc.getState().get_states()
        for st in states:
            name = pa.StateType._enum_lookup[st].split("_", 1)[1].lower()
            if name:
                attrs[f"st:{name}"] = "true"
        try:
            for key, value in (acc.get_attributes() or {}).items():
                if key and _XML_NAME.fullmatch(key):
                    attrs[f"attr:{key}"] = str(value)
        except Exception:  # noqa: BLE001 - an app may fail one query; the node is still listed
            pass
        if attrs.get("st:visible") == "true" and attrs.get("st:showing") == "true":
            try:
                x, y, w, h = tuple(acc.queryComponent().getExtents(pa.XY_SCREEN))[:4]
                attrs["cp:screencoord"] = str((x, y))
                attrs["cp:size"] = str((w, h))
            except NotImplementedError:
                pass
        text = ""
        try:
            t = acc.queryText()
            text = t.getText(0, t.characterCount).replace("\ufffc", "").replace("\ufffd", "")
        except NotImplementedError:
            pass
        for iface, key in (("queryImage", "image"), ("querySelection", "selection")):
            try:
                getattr(acc, iface)()
                attrs[key] = "true"
            except NotImplementedError:
                pass
        try:
            value = acc.queryValue()
            for key, get in (("value", lambda: value.currentValue), ("min", lambda: value.minimumValue),
                             ("max", lambda: value.maximumValue), ("step", lambda: value.minimumIncrement)):
                try:
                    attrs[f"val:{key}"] = str(get())
                except Exception:  # noqa: BLE001
                    pass
        except NotImplementedError:
            pass
        try:
            action = acc.queryAction()
            for i in range(action.nActions):
                name = action.getName(i).replace(" ", "-")
                if _XML_NAME.fullmatch(name + "_desc"):
                    attrs[f"act:{name}_desc"] = action.getDescription(i)
                    attrs[f"act:{name}_kb"] = action.getKeyBinding(i)
        except NotImplementedError:
            pass
        raw_role = acc.getRoleName().strip()
        tag = (raw_role or "unknown").replace(" ", "-")
        if not _XML_NAME.fullmatch(tag):
            tag = "unknown"
        if not flag and raw_role == "document spreadsheet":
            flag = "calc"
        element = _Node(tag, attrs, text)
        if depth >= MAX_DEPTH or self.exhausted():
            return element
        if flag == "calc" and tag == "table":
            self._showing_cells(acc, element, depth)
            return element
        try:
            for i, child in enumerate(acc):
                if i == MAX_WIDTH or self.exhausted():
                    break
                element.children.append(self.node(child, depth + 1, flag))
        except Exception:  # noqa: BLE001 - OSWorld ignores errors while listing children, so do we
            pass
        return element

    def _showing_cells(self, table_acc, element: _Node, depth: int) -> None:
        """A spreadsheet table's showing cells, row-major, the way OSWorld walks them (module docstring)."""
        showing_state = self.pyatspi.STATE_SHOWING
        table = table_acc.queryTable()
        n_rows, n_cols = table.nRows, table.nColumns
        first_col = None
        for row in range(n_rows):
            col = first_col or 0
            while col < n_cols:
                cell = table.getAccessibleAt(row, col)
                if cell is not None and cell.getState().contains(showing_state):
                    if first_col is None:
                        first_col = col
                    element.children.append(self.node(cell, depth + 1, "calc"))
                elif first_col is not None or col >= SCAN_LIMIT:
                    break
                if self.exhausted():
                    return
                col += 1
            if (first_col is not None and col == first_col) or (first_col is None and row >= SCAN_LIMIT):
                return


def _pyatspi():
    try:
        import pyatspi  # noqa: PLC0415 - optional: only images with python3-pyatspi have it
    except ImportError as exc:
        raise Unavailable(f"pyatspi is not installed in this desktop image ({exc}); add python3-pyatspi and "
                          "at-spi2-core to its packages") from None
    return pyatspi


def tree_xml() -> str:
    """The whole desktop's AT-SPI tree as OSWorld's XML string (the "AT" of /accessibility)."""
    pyatspi = _pyatspi()
    walker = _Walker(pyatspi)
    root = _Node("desktop-frame", {})
    for app in _apps(pyatspi):
        if walker.exhausted():
            break
        try:
            root.children.append(walker.node(app, 1))
        except Exception:  # noqa: BLE001 - an app that quit mid-walk is left out
            continue
    return serialise(root)


def _apps(pyatspi) -> list:
    try:
        return list(pyatspi.Registry.getDesktop(0))
    except Exception as exc:  # noqa: BLE001 - GLib errors when the bus is missing
        raise Unavailable(f"the AT-SPI bus does not answer: {type(exc).__name__}: {exc}") from exc


def terminal_output() -> str | None:
    """The text of the focused terminal in the active window (right-stripped), or None when there is none."""
    pyatspi = _pyatspi()
    found: list[str] = []
    for app in _apps(pyatspi):
        try:
            frames = [f for f in app if f.getRoleName() == "frame" and f.getState().contains(pyatspi.STATE_ACTIVE)]
            for frame in frames:
                _focused_terminals(pyatspi, frame, found, 0)
        except Exception:  # noqa: BLE001 - an app that quit mid-walk
            continue
    return found[0].rstrip() if len(found) == 1 else None


def _focused_terminals(pyatspi, acc, found: list[str], depth: int) -> None:
    if depth > MAX_DEPTH:
        return
    if acc.getRoleName() == "terminal" and acc.getState().contains(pyatspi.STATE_FOCUSED):
        try:
            t = acc.queryText()
            found.append(t.getText(0, t.characterCount))
        except NotImplementedError:
            found.append("")
    for i, child in enumerate(acc):
        if i == MAX_WIDTH:
            break
        _focused_terminals(pyatspi, child, found, depth + 1)


def main(argv: list[str]) -> int:
    """``tree`` -> the XML on stdout; ``terminal`` -> JSON {"output"}; exit 3 when AT-SPI is unavailable."""
    if len(argv) != 1 or argv[0] not in ("tree", "terminal"):
        sys.stderr.write("usage: accessibility.py tree|terminal\n")
        return 2
    try:
        if argv[0] == "tree":
            sys.stdout.write(tree_xml())
        else:
            sys.stdout.write(json.dumps({"output": terminal_output()}))
    except Unavailable as exc:
        sys.stderr.write(str(exc))
        return 3
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
