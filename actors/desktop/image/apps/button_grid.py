#!/usr/bin/env python3
"""Button grid app: N large labelled buttons in a grid filling the window.

Clicking a button writes its label (no newline) to --result, replacing what was there, and shows it
in the status line. Usage:
    button_grid.py --title T --result PATH [--cols C] [--colours] LABEL [LABEL ...]
"""
from __future__ import annotations

import math
import tkinter as tk

import arpo_app

COLOURS = {"red": "#d62728", "green": "#2ca02c", "blue": "#1f77b4", "yellow": "#f2d21b",
           "orange": "#ff7f0e", "purple": "#9467bd", "pink": "#e377c2", "grey": "#7f7f7f",
           "brown": "#8c564b", "cyan": "#17becf", "black": "#111111", "white": "#ffffff"}
DARK = {"red", "green", "blue", "purple", "brown", "black", "grey"}


def main() -> None:
    p = arpo_app.base_parser(__doc__)
    p.add_argument("--cols", type=int, default=0, help="columns (default: ceil(sqrt(N)))")
    p.add_argument("--colours", action="store_true", help="paint each button in the colour it names")
    p.add_argument("labels", nargs="+")
    args = p.parse_args()

    root = arpo_app.make_root(args.title)
    n = len(args.labels)
    cols = args.cols or math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    status = tk.StringVar(value="Last clicked: none")

    row0 = 0
    if args.heading:
        tk.Label(root, text=args.heading, font=arpo_app.SMALL_FONT, bg="#f0f0f0").grid(
            row=0, column=0, columnspan=cols, sticky="nsew", pady=6)
        row0 = 1
    buttons: dict[str, tk.Misc] = {}

    def clicked(label: str) -> None:
        arpo_app.write_atomic(args.result, label)
        status.set(f"Last clicked: {label}")

    for i, label in enumerate(args.labels):
        key = label.lower()
        opts = {}
        if args.colours and key in COLOURS:
            fg = "#ffffff" if key in DARK else "#000000"
            opts = {"bg": COLOURS[key], "activebackground": COLOURS[key], "fg": fg, "activeforeground": fg}
        b = tk.Button(root, text=label, font=arpo_app.FONT, relief="raised", bd=4,
                      command=lambda lab=label: clicked(lab), **opts)
        b.grid(row=row0 + i // cols, column=i % cols, sticky="nsew", padx=12, pady=12)
        buttons[label] = b
    tk.Label(root, textvariable=status, font=arpo_app.SMALL_FONT, bg="#f0f0f0").grid(
        row=row0 + rows, column=0, columnspan=cols, sticky="nsew", pady=6)
    for c in range(cols):
        root.columnconfigure(c, weight=1, uniform="col")
    for r in range(rows):
        root.rowconfigure(row0 + r, weight=1, uniform="row")

    arpo_app.track_layout(root, args.layout, buttons)
    root.mainloop()


if __name__ == "__main__":
    main()
