#!/usr/bin/env python3
"""Settings app: section tabs down the left half, the open section's switches on the right half.

No section is open at start, so no switch can be reached with one click: a task "open section S, turn on switch
W" needs two actions in order, and with --apply ("... then click Apply") three. Each switch is a large toggle
button. Without --apply every change writes the switches that are on, one "<section>/<switch>" per line in the
order given, to --result (replacing it); with --apply only the Apply button (shown with the open section) writes
them. The layout file holds the tabs by name and, while a section is open, its switches as "<section>/<switch>"
and "Apply".
Usage:
    settings.py --title T --result PATH [--apply] SECTION=SWITCH,SWITCH [SECTION=SWITCH,...] ...
"""
from __future__ import annotations

import tkinter as tk

import arpo_app

OFF, ON = "#ffffff", "#8fd18f"


def parse_sections(specs: list[str]) -> dict[str, list[str]]:
    """``["Sound=Mute,Beep", ...]`` -> ``{"Sound": ["Mute", "Beep"], ...}`` (SystemExit on a malformed one)."""
    sections: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, switches = spec.partition("=")
        if not sep or not name or not switches:
            raise SystemExit(f"settings.py: section {spec!r} must look like NAME=SWITCH,SWITCH")
        sections[name] = switches.split(",")
    return sections


def main() -> None:
    p = arpo_app.base_parser(__doc__)
    p.add_argument("--apply", action="store_true", help="changes are written only when Apply is clicked")
    p.add_argument("sections", nargs="+", metavar="SECTION=SWITCH,SWITCH")
    args = p.parse_args()
    sections = parse_sections(args.sections)

    root = arpo_app.make_root(args.title)
    root.columnconfigure(0, weight=1, uniform="half")
    root.columnconfigure(1, weight=1, uniform="half")
    root.rowconfigure(0, weight=1)
    tabs = tk.Frame(root, bg="#dcdcdc")
    tabs.grid(row=0, column=0, sticky="nsew")
    panel = tk.Frame(root, bg="#f0f0f0")
    panel.grid(row=0, column=1, sticky="nsew")
    state = {f"{s}/{w}": False for s, switches in sections.items() for w in switches}
    tab_widgets: dict[str, tk.Misc] = {}
    shown: dict[str, tk.Misc] = {}
    widgets: dict[str, tk.Misc] = {}  # what the layout file holds: the tabs and the open section's buttons

    def write_result() -> None:
        arpo_app.write_atomic(args.result, "".join(f"{key}\n" for key, on in state.items() if on))

    def flip(key: str, button: tk.Button) -> None:
        state[key] = not state[key]
        button.configure(bg=ON if state[key] else OFF, activebackground=ON if state[key] else OFF,
                         text=("\u2611  " if state[key] else "\u2610  ") + key.split("/", 1)[1])
        if not args.apply:
            write_result()

    def open_section(name: str) -> None:
        for widget in panel.winfo_children():
            widget.destroy()
        for key in shown:
            widgets.pop(key)
        shown.clear()
        for tab, widget in tab_widgets.items():
            widget.configure(relief="sunken" if tab == name else "raised", bg="#b8cff5" if tab == name else "#ffffff")
        rows = [*sections[name], *(["Apply"] if args.apply else [])]
        panel.columnconfigure(0, weight=1)
        for row, switch in enumerate(rows):
            panel.rowconfigure(row, weight=1, uniform="row")
            if switch == "Apply":
                b = tk.Button(panel, text="Apply", font=arpo_app.FONT, bd=4, bg="#4caf50", fg="#ffffff",
                              activebackground="#4caf50", activeforeground="#ffffff", command=write_result)
                shown["Apply"] = b
            else:
                key = f"{name}/{switch}"
                b = tk.Button(panel, font=arpo_app.FONT, bd=3, relief="raised", anchor="w", padx=30,
                              bg=ON if state[key] else OFF, activebackground=ON if state[key] else OFF,
                              text=("\u2611  " if state[key] else "\u2610  ") + switch)
                b.configure(command=lambda k=key, btn=b: flip(k, btn))
                shown[key] = b
            b.grid(row=row, column=0, sticky="nsew", padx=24, pady=12)
        widgets.update(shown)
        root.after(50, arpo_app.write_layout, root, args.layout, widgets)

    tk.Label(panel, text="Pick a section", font=arpo_app.SMALL_FONT, bg="#f0f0f0").pack(expand=True)
    tabs.columnconfigure(0, weight=1)
    for row, name in enumerate(sections):
        tabs.rowconfigure(row, weight=1, uniform="tab")
        t = tk.Button(tabs, text=name, font=arpo_app.FONT, bd=3, relief="raised", bg="#ffffff",
                      activebackground="#b8cff5", command=lambda n=name: open_section(n))
        t.grid(row=row, column=0, sticky="nsew", padx=24, pady=12)
        tab_widgets[name] = t
    widgets.update(tab_widgets)
    arpo_app.track_layout(root, args.layout, widgets)
    root.mainloop()


if __name__ == "__main__":
    main()
