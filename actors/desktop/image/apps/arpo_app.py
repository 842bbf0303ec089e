"""Shared helpers for the Tk apps under test (runs inside the desktop with Debian's python3 + Tk).

Every app opens one undecorated window filling the screen at +0+0 (openbox maximises it too), uses
large fonts so targets are easy to hit, writes its result file atomically, and writes a layout file
(JSON: widget name -> {"x", "y", "w", "h", "cx", "cy"} in screen pixels) each time its window settles.
The layout is a test and debugging aid: tests use it to click a widget's centre; an agent never reads it.
"""
from __future__ import annotations

import argparse
import json
import os
import tkinter as tk

FONT = ("DejaVu Sans", 26, "bold")
SMALL_FONT = ("DejaVu Sans", 18)


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--title", required=True, help="window title (setup steps wait for it)")
    p.add_argument("--result", required=True, help="file the app writes its result to")
    p.add_argument("--layout", default="/tmp/arpo/layout.json", help="file the widget layout is written to")
    p.add_argument("--heading", default="", help="text shown at the top of the window")
    return p


def make_root(title: str) -> tk.Tk:
    """A Tk root filling the whole screen at +0+0."""
    root = tk.Tk(className="ArpoApp")
    root.title(title)
    w, h = root.winfo_screenwidth(), root.winfo_screenheight()
    root.geometry(f"{w}x{h}+0+0")
    root.configure(bg="#f0f0f0")
    return root


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file and rename, so readers never see half a file."""
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def widget_box(widget: tk.Misc) -> dict[str, int]:
    x, y = widget.winfo_rootx(), widget.winfo_rooty()
    w, h = widget.winfo_width(), widget.winfo_height()
    return {"x": x, "y": y, "w": w, "h": h, "cx": x + w // 2, "cy": y + h // 2}


def write_layout(root: tk.Tk, path: str, widgets: dict[str, tk.Misc]) -> None:
    """Write the layout file now: every widget's screen box, and the window's as "_window"."""
    root.update_idletasks()
    layout = {name: widget_box(w) for name, w in widgets.items()}
    layout["_window"] = widget_box(root)
    write_atomic(path, json.dumps(layout, indent=1, sort_keys=True))


def track_layout(root: tk.Tk, path: str, widgets: dict[str, tk.Misc]) -> None:
    """Rewrite the layout file whenever the window settles (after it is mapped or resized); ``widgets`` is read
    at each write, so an app may change it."""
    pending = {"id": None}

    def write() -> None:
        pending["id"] = None
        write_layout(root, path, widgets)

    def schedule(_event=None) -> None:
        if pending["id"] is not None:
            root.after_cancel(pending["id"])
        pending["id"] = root.after(50, write)

    root.bind("<Configure>", lambda e: schedule() if e.widget is root else None, add="+")
    root.bind("<Map>", lambda e: schedule() if e.widget is root else None, add="+")
