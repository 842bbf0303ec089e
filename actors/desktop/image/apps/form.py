#!/usr/bin/env python3
"""Form app: labelled text fields and a Save button.

Save writes one line per field, "<field>: <value>\\n" in the order given, to --result (replacing it)
and shows "Saved". Usage:
    form.py --title T --result PATH --field NAME [--field NAME ...]
"""
from __future__ import annotations

import tkinter as tk

import arpo_app


def main() -> None:
    p = arpo_app.base_parser(__doc__)
    p.add_argument("--field", action="append", required=True, help="a field label (repeatable)")
    args = p.parse_args()

    root = arpo_app.make_root(args.title)
    status = tk.StringVar(value="Not saved")
    widgets: dict[str, tk.Misc] = {}
    entries: dict[str, tk.Entry] = {}
    row = 0
    if args.heading:
        tk.Label(root, text=args.heading, font=arpo_app.SMALL_FONT, bg="#f0f0f0").grid(
            row=0, column=0, columnspan=2, pady=10)
        row = 1
    for name in args.field:
        tk.Label(root, text=f"{name}:", font=arpo_app.FONT, bg="#f0f0f0", anchor="e").grid(
            row=row, column=0, sticky="nsew", padx=20, pady=20)
        e = tk.Entry(root, font=arpo_app.FONT, bd=3, relief="sunken")
        e.grid(row=row, column=1, sticky="ew", padx=20, pady=20, ipady=10)
        entries[name] = e
        widgets[name] = e
        root.rowconfigure(row, weight=1)
        row += 1

    def save() -> None:
        arpo_app.write_atomic(args.result, "".join(f"{k}: {e.get()}\n" for k, e in entries.items()))
        status.set("Saved")

    b = tk.Button(root, text="Save", font=arpo_app.FONT, bd=4, bg="#4caf50", fg="#ffffff",
                  activebackground="#4caf50", activeforeground="#ffffff", command=save)
    b.grid(row=row, column=0, columnspan=2, sticky="nsew", padx=200, pady=20, ipady=20)
    widgets["Save"] = b
    root.rowconfigure(row, weight=1)
    tk.Label(root, textvariable=status, font=arpo_app.SMALL_FONT, bg="#f0f0f0").grid(
        row=row + 1, column=0, columnspan=2, pady=10)
    root.columnconfigure(0, weight=1)
    root.columnconfigure(1, weight=3)
    arpo_app.track_layout(root, args.layout, widgets)
    root.mainloop()


if __name__ == "__main__":
    main()
