"""The desktop's top-level windows for the controller: listing, matching the way OSWorld does, acting on them.

Owns: the window list as the window manager publishes it (EWMH ``_NET_CLIENT_LIST`` on the root window, in
mapping order), each window's title (``_NET_WM_NAME``, else ``WM_NAME``) and class (``WM_CLASS``), and the
matching rules of OSWorld's window routes. OSWorld's server (desktop_env/server/main.py, routes
/setup/activate_window, /setup/close_window, /setup/open_file) shells out to ``wmctrl``; the rules here are
wmctrl's (``-a``/``-c`` with ``-x`` for by_class and ``-F`` for strict), applied in-process with python-xlib:

* by title (default): the first window whose title contains ``name``, compared case-insensitively;
* strict: the title must equal ``name`` exactly, case-sensitively (wmctrl ``-F``);
* by_class: compare against ``"<res_name>.<res_class>"`` of WM_CLASS instead of the title (wmctrl ``-x``).

wmctrl acts on the FIRST match only, and so do the routes. Activation uses xdotool (``windowactivate --sync``
sends EWMH ``_NET_ACTIVE_WINDOW``, as wmctrl -a does, and waits until the window is active); closing sends
``_NET_CLOSE_WINDOW`` (wmctrl -c). Needs python3-xlib (Debian) and a window manager that publishes
``_NET_CLIENT_LIST`` (openbox does).
"""
from __future__ import annotations

import subprocess
from dataclasses import dataclass

from Xlib import X, display, error
from Xlib.protocol import event

XDOTOOL_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Window:
    """One top-level client window: X id, title ("" when it has none) and WM_CLASS (res_name, res_class)."""

    wid: int
    title: str
    wm_class: tuple[str, ...]

    @property
    def class_string(self) -> str:
        """``"res_name.res_class"``, the string wmctrl -x matches (e.g. ``"gnome-terminal-server.Gnome-terminal"``)."""
        return ".".join(self.wm_class)


def _title(d: display.Display, win) -> str:
    prop = win.get_full_property(d.intern_atom("_NET_WM_NAME"), d.intern_atom("UTF8_STRING"))
    if prop is not None and prop.value:
        value = prop.value
        return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    name = win.get_wm_name()
    if isinstance(name, bytes):
        return name.decode("latin-1")
    return name or ""


def _open(display_name: str) -> display.Display:
    try:
        return display.Display(display_name)
    except Exception as exc:  # noqa: BLE001 - Xlib raises several unrelated types here
        raise RuntimeError(f"cannot open X display {display_name}: {exc}") from exc


def _clients(d: display.Display) -> list[Window]:
    prop = d.screen().root.get_full_property(d.intern_atom("_NET_CLIENT_LIST"), X.AnyPropertyType)
    out = []
    for wid in (prop.value if prop is not None else []):
        try:
            win = d.create_resource_object("window", wid)
            out.append(Window(int(wid), _title(d, win), tuple(win.get_wm_class() or ())))
        except error.XError:
            continue  # it vanished while we read it
    return out


def client_windows(display_name: str) -> list[Window]:
    """Every client window the window manager manages, in ``_NET_CLIENT_LIST`` order (oldest first).

    Windows that vanish while being read are skipped. Raises RuntimeError when the X display cannot be opened.
    """
    d = _open(display_name)
    try:
        return _clients(d)
    finally:
        d.close()


def matches(window: Window, name: str, *, strict: bool = False, by_class: bool = False) -> bool:
    """wmctrl's rule (see the module docstring): substring, case-insensitive; ``strict``: equal, case-sensitive;
    ``by_class``: against ``res_name.res_class`` instead of the title."""
    subject = window.class_string if by_class else window.title
    if strict:
        return subject == name
    return name.lower() in subject.lower()


def find(display_name: str, name: str, *, strict: bool = False, by_class: bool = False) -> Window | None:
    """The first window :func:`matches` selects, or None."""
    for w in client_windows(display_name):
        if matches(w, name, strict=strict, by_class=by_class):
            return w
    return None


def window_size(display_name: str, app_class_name: str) -> tuple[int, int] | None:
    """(width, height) in pixels of the first window one of whose WM_CLASS parts equals ``app_class_name``
    (case-insensitive; OSWorld route /window_size), or None when there is none."""
    d = _open(display_name)
    try:
        for w in _clients(d):
            if app_class_name.lower() in (part.lower() for part in w.wm_class):
                try:
                    geom = d.create_resource_object("window", w.wid).get_geometry()
                except error.XError:
                    continue
                return int(geom.width), int(geom.height)
        return None
    finally:
        d.close()


def _xdotool(*args: str) -> bool:
    res = subprocess.run(["xdotool", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         timeout=XDOTOOL_TIMEOUT_S, check=False)
    return res.returncode == 0


def activate(window: Window) -> bool:
    """Raise and focus ``window`` (EWMH activation, waits until it is active); False when xdotool fails."""
    return _xdotool("windowactivate", "--sync", str(window.wid))


def close(display_name: str, window: Window) -> None:
    """Ask the window manager to close ``window`` gracefully (EWMH ``_NET_CLOSE_WINDOW``, as wmctrl -c does:
    the app gets WM_DELETE_WINDOW and may ask to save first)."""
    d = _open(display_name)
    try:
        root = d.screen().root
        msg = event.ClientMessage(window=d.create_resource_object("window", window.wid),
                                  client_type=d.intern_atom("_NET_CLOSE_WINDOW"),
                                  data=(32, [X.CurrentTime, 2, 0, 0, 0]))  # 2: the request comes from a pager/tool
        root.send_event(msg, event_mask=X.SubstructureRedirectMask | X.SubstructureNotifyMask)
        d.sync()
    finally:
        d.close()


def screen_size(display_name: str) -> tuple[int, int]:
    """(width, height) of the X screen in pixels (OSWorld route /screen_size reads it the same way)."""
    d = _open(display_name)
    try:
        s = d.screen()
        return int(s.width_in_pixels), int(s.height_in_pixels)
    finally:
        d.close()
