"""The controller's view of the X screen: screenshots, the pointer position, the screen size, whether X is up.

Owns: one shared libX11 connection for XQueryPointer (:func:`pointer`, opened on first use, guarded by a lock),
and the screenshot encoding (PNG compress_level 1, OSWorld's format, or JPEG at a chosen quality) with an arrow
cursor drawn in at the pointer (Xvfb's screen has none). Reads ``$DISPLAY`` (limits.DISPLAY) only; writes
nothing. Debian's python3, PIL (python3-pil, built against libxcb) and ctypes only.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import io
import subprocess
import threading
import urllib.parse

from PIL import ImageDraw, ImageGrab

from limits import DISPLAY


# An arrow cursor, 12 x 19 px, tip at (0, 0): drawn white with a black outline at the pointer.
_ARROW = [(0, 0), (0, 16), (4, 12), (7, 18), (9, 17), (6, 11), (11, 11)]


class _XPointer:
    """Queries the X pointer position through libX11 (XQueryPointer) on one shared connection."""

    def __init__(self, display: str) -> None:
        name = ctypes.util.find_library("X11") or "libX11.so.6"
        self._x = ctypes.CDLL(name)
        self._x.XOpenDisplay.restype = ctypes.c_void_p
        self._x.XOpenDisplay.argtypes = [ctypes.c_char_p]
        self._x.XDefaultRootWindow.restype = ctypes.c_ulong
        self._x.XDefaultRootWindow.argtypes = [ctypes.c_void_p]
        self._x.XQueryPointer.argtypes = [ctypes.c_void_p, ctypes.c_ulong] + [ctypes.c_void_p] * 7
        self._lock = threading.Lock()
        self._dpy = self._x.XOpenDisplay(display.encode())
        if not self._dpy:
            raise RuntimeError(f"cannot open X display {display}")
        self._root = self._x.XDefaultRootWindow(self._dpy)

    def position(self) -> tuple[int, int]:
        root_ret, child_ret = ctypes.c_ulong(), ctypes.c_ulong()
        rx, ry, wx, wy = ctypes.c_int(), ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        mask = ctypes.c_uint()
        with self._lock:
            self._x.XQueryPointer(self._dpy, self._root, ctypes.byref(root_ret), ctypes.byref(child_ret),
                                  ctypes.byref(rx), ctypes.byref(ry), ctypes.byref(wx), ctypes.byref(wy),
                                  ctypes.byref(mask))
        return rx.value, ry.value


_pointer: _XPointer | None = None  # opened on first use
_pointer_lock = threading.Lock()


def pointer() -> _XPointer:
    """The shared X pointer query (RuntimeError when the display cannot be opened)."""
    global _pointer
    with _pointer_lock:
        if _pointer is None:
            _pointer = _XPointer(DISPLAY)
        return _pointer


SCREENSHOT_FORMATS = ("png", "jpeg")
DEFAULT_JPEG_QUALITY = 85


def grab_screen(fmt: str = "png", quality: int = DEFAULT_JPEG_QUALITY) -> bytes:
    """The whole screen, arrow cursor drawn at the pointer, encoded as PNG (compress_level 1, lossless,
    OSWorld's format) or JPEG (``quality`` 1..100, 4:2:0 subsampling)."""
    image = ImageGrab.grab(xdisplay=DISPLAY)
    if image.mode != "RGB":
        image = image.convert("RGB")
    x, y = pointer().position()
    draw = ImageDraw.Draw(image)
    draw.polygon([(x + dx, y + dy) for dx, dy in _ARROW], fill=(255, 255, 255), outline=(0, 0, 0))
    out = io.BytesIO()
    if fmt == "jpeg":
        image.save(out, format="JPEG", quality=quality)
    else:
        image.save(out, format="PNG", compress_level=1)
    return out.getvalue()


def screenshot_params(query: str) -> tuple[str, int]:
    """``format`` and ``quality`` from a /screenshot query string; ValueError on a bad value."""
    q = urllib.parse.parse_qs(query)
    fmt = (q.get("format") or ["png"])[0].lower()
    if fmt == "jpg":
        fmt = "jpeg"
    if fmt not in SCREENSHOT_FORMATS:
        raise ValueError(f"format must be one of {', '.join(SCREENSHOT_FORMATS)}, got {fmt!r}")
    raw = (q.get("quality") or [str(DEFAULT_JPEG_QUALITY)])[0]
    try:
        quality = int(raw)
    except ValueError:
        raise ValueError(f"quality must be an integer 1..100, got {raw!r}") from None
    if not 1 <= quality <= 100:
        raise ValueError(f"quality must be an integer 1..100, got {quality}")
    return fmt, quality


def screen_size() -> tuple[int, int]:
    """(width, height) of the screen in pixels."""
    return ImageGrab.grab(xdisplay=DISPLAY).size


def x_is_up() -> bool:
    """Whether the X display answers (xdpyinfo within 5 s)."""
    try:
        return subprocess.run(["xdpyinfo", "-display", DISPLAY], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=5, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
