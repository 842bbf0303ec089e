#!/usr/bin/env python3
"""Menu app: a toolbar of large menu buttons ("File", "Edit") with drop-down menus.

Choosing a menu item writes "<menu>/<item>" (no newline) to --result, replacing it, and shows it.
Menus: File (New, Open, Export, Close) and Edit (Copy, Paste, Select All); no item quits the app. The layout file holds the
menu buttons and, once a menu has been opened, its items as "<menu>/<item>".
Usage:
    menu_app.py --title T --result PATH
"""
from __future__ import annotations

import tkinter as tk

import arpo_app

MENUS = {"File": ["New", "Open", "Export", "Close"], "Edit": ["Copy", "Paste", "Select All"]}


def main() -> None:
    p = arpo_app.base_parser(__doc__)
    args = p.parse_args()

    root = arpo_app.make_root(args.title)
    status = tk.StringVar(value="Last command: none")
    widgets: dict[str, tk.Misc] = {}
    bar = tk.Frame(root, bg="#dcdcdc", bd=2, relief="raised")
    bar.pack(side="top", fill="x")

    def chosen(path: str) -> None:
        arpo_app.write_atomic(args.result, path)
        status.set(f"Last command: {path}")

    menus: dict[str, tk.Menu] = {}
    for name, items in MENUS.items():
        mb = tk.Menubutton(bar, text=name, font=arpo_app.FONT, bg="#dcdcdc", activebackground="#bbbbbb",
                           padx=40, pady=12, relief="flat")
        menu = tk.Menu(mb, tearoff=False, font=arpo_app.FONT, bg="#ffffff", activebackground="#3874d8",
                       activeforeground="#ffffff")
        for item in items:
            menu.add_command(label=item, command=lambda pth=f"{name}/{item}": chosen(pth))
        mb.configure(menu=menu)
        mb.pack(side="left")
        widgets[name] = mb
        menus[name] = menu

    body = tk.Label(root, text=args.heading or "Document", font=arpo_app.FONT, bg="#ffffff")
    body.pack(side="top", fill="both", expand=True, padx=20, pady=20)
    tk.Label(root, textvariable=status, font=arpo_app.SMALL_FONT, bg="#f0f0f0").pack(side="bottom", pady=8)

    def record_items(name: str) -> None:
        # Called once the drop-down is mapped: add its items' screen boxes to the layout file.
        menu = menus[name]
        if not menu.winfo_ismapped():
            return
        mx, my, mw = menu.winfo_rootx(), menu.winfo_rooty(), menu.winfo_width()
        ends = [menu.yposition(i) for i in range(menu.index("end") + 1)] + [menu.winfo_height()]
        for i, item in enumerate(MENUS[name]):
            y0, y1 = my + ends[i], my + ends[i + 1]
            extra[f"{name}/{item}"] = {"x": mx, "y": y0, "w": mw, "h": y1 - y0,
                                       "cx": mx + mw // 2, "cy": (y0 + y1) // 2}
        write_layout()

    extra: dict[str, dict] = {}

    def write_layout() -> None:
        import json
        layout = {k: arpo_app.widget_box(w) for k, w in widgets.items()}
        layout.update(extra)
        layout["_window"] = arpo_app.widget_box(root)
        arpo_app.write_atomic(args.layout, json.dumps(layout, indent=1, sort_keys=True))

    for name, menu in menus.items():
        menu.bind("<Map>", lambda e, n=name: root.after(30, record_items, n), add="+")
    arpo_app.track_layout(root, args.layout, widgets)
    root.mainloop()


if __name__ == "__main__":
    main()
