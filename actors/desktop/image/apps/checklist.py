#!/usr/bin/env python3
"""Checklist app: large checkboxes and a Save button.

Save writes the checked options, one per line in the order given, to --result (replacing it).
Usage:
    checklist.py --title T --result PATH OPTION [OPTION ...]
"""
from __future__ import annotations

import tkinter as tk

import arpo_app

BOX = {False: "\u2610", True: "\u2611"}


def main() -> None:
    p = arpo_app.base_parser(__doc__)
    p.add_argument("options", nargs="+")
    args = p.parse_args()

    root = arpo_app.make_root(args.title)
    status = tk.StringVar(value="Not saved")
    widgets: dict[str, tk.Misc] = {}
    values: dict[str, tk.BooleanVar] = {}
    row = 0
    if args.heading:
        tk.Label(root, text=args.heading, font=arpo_app.SMALL_FONT, bg="#f0f0f0").grid(row=0, column=0, pady=10)
        row = 1
    for name in args.options:
        v = tk.BooleanVar(value=False)
        shown = tk.StringVar(value=f"\u2610  {name}")
        v.trace_add("write", lambda *_, v=v, s=shown, n=name: s.set(f"{BOX[v.get()]}  {n}"))
        # indicatoron=False: the whole row is the toggle (green when ticked); the box glyph shows the state.
        cb = tk.Checkbutton(root, textvariable=shown, variable=v, font=arpo_app.FONT, bg="#ffffff",
                            activebackground="#eeeeee", selectcolor="#8fd18f", anchor="w", padx=40,
                            indicatoron=False, relief="raised", offrelief="raised", bd=3)
        cb.grid(row=row, column=0, sticky="nsew", padx=300, pady=6)
        values[name] = v
        widgets[name] = cb
        root.rowconfigure(row, weight=1)
        row += 1

    def save() -> None:
        arpo_app.write_atomic(args.result, "".join(f"{k}\n" for k, v in values.items() if v.get()))
        status.set("Saved")

    b = tk.Button(root, text="Save", font=arpo_app.FONT, bd=4, bg="#4caf50", fg="#ffffff",
                  activebackground="#4caf50", activeforeground="#ffffff", command=save)
    b.grid(row=row, column=0, sticky="nsew", padx=300, pady=16, ipady=12)
    widgets["Save"] = b
    root.rowconfigure(row, weight=1)
    tk.Label(root, textvariable=status, font=arpo_app.SMALL_FONT, bg="#f0f0f0").grid(row=row + 1, column=0, pady=6)
    root.columnconfigure(0, weight=1)
    arpo_app.track_layout(root, args.layout, widgets)
    root.mainloop()


if __name__ == "__main__":
    main()
