"""Async client for a desktop's in-container controller (OSWorld's controller HTTP API).

Talks HTTP over the Unix socket the container's controller listens on (``<socket_dir>/controller.sock``),
or over TCP when given a base URL. Request and response shapes are OSWorld's (desktop_env/server/main.py);
see actors/desktop/image/controller.py for the server side.

Invariant: every call has its own deadline, and every transport failure (missing socket, refused
connection, reset, timeout, HTTP 5xx from a dead controller) raises :class:`DesktopError` naming the
endpoint and the cause, so a killed container surfaces quickly instead of hanging an actor.
"""
from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from arpo_async.text import loads_json

DEFAULT_TIMEOUT_S = 30.0
EXECUTE_GRACE_S = 10.0  # extra client-side time beyond an execute's own timeout


IMAGE_MAGIC = {"png": b"\x89PNG\r\n\x1a\n", "jpeg": b"\xff\xd8\xff"}
"""First bytes of each screenshot encoding the controller can produce."""
DEFAULT_JPEG_QUALITY = 85


def screenshot_endpoint(format: str = "png", quality: int = DEFAULT_JPEG_QUALITY) -> str:
    """The /screenshot path for an encoding: plain ``/screenshot`` for PNG (OSWorld's request), else
    ``/screenshot?format=jpeg&quality=Q``. Raises ValueError on an unknown format or a quality outside 1..100."""
    if format not in IMAGE_MAGIC:
        raise ValueError(f"screenshot format must be one of {sorted(IMAGE_MAGIC)}, got {format!r}")
    if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 100:
        raise ValueError(f"screenshot quality must be an integer 1..100, got {quality!r}")
    return "/screenshot" if format == "png" else f"/screenshot?format={format}&quality={quality}"


class DesktopError(Exception):
    """A desktop (container or its controller) failed or cannot be reached; the message has the cause."""


class RequestRefused(DesktopError):
    """The controller answered but refused the request with a 4xx status (``status``): too large a body or
    file, not a regular file, a malformed request. The desktop itself may be fine."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class NotSupported(RequestRefused):
    """The desktop image lacks what the request needs (HTTP 501: no ffmpeg for recording in the default image,
    no AT-SPI, no gsettings); the message names the package or image that has it. The desktop itself is fine."""


class ControllerClient:
    """One desktop's controller.

    Args:
        socket_path: Unix socket of the controller (e.g. /tmp/arpo-desktops/<run>/<name>/controller.sock).
        base_url: alternatively a TCP base URL such as ``http://10.0.0.5:5000`` (then socket_path is None).
        timeout: default per-request deadline in seconds (execute uses its own timeout + a grace period).
    """

    def __init__(self, socket_path: str | None = None, *, base_url: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S) -> None:
        if (socket_path is None) == (base_url is None):
            raise ValueError("give exactly one of socket_path and base_url")
        self.socket_path = socket_path
        self.base_url = (base_url or "http://desktop").rstrip("/")
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    def __repr__(self) -> str:
        return f"ControllerClient({self.socket_path or self.base_url!r})"

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = (aiohttp.UnixConnector(path=self.socket_path) if self.socket_path
                         else aiohttp.TCPConnector(limit=16))
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def _request(self, method: str, endpoint: str, *, timeout: float | None = None,
                       ok_statuses: tuple[int, ...] = (200,), **kw: Any) -> tuple[int, bytes, str]:
        """Send one request; returns (status, body, content type). Raises DesktopError on failure."""
        deadline = self.timeout if timeout is None else timeout
        try:
            async with asyncio.timeout(deadline):
                async with self._get_session().request(method, self.base_url + endpoint, **kw) as resp:
                    body = await resp.read()
                    status, ctype = resp.status, resp.headers.get("Content-Type", "")
        except TimeoutError as exc:
            raise DesktopError(f"{method} {endpoint} to {self._where()}: no answer within {deadline:g} s") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise DesktopError(f"{method} {endpoint} to {self._where()}: {type(exc).__name__}: {exc}") from exc
        if status not in ok_statuses:
            message = f"{method} {endpoint} to {self._where()}: HTTP {status}: {body[:500].decode('utf-8', 'replace')}"
            if status == 501:
                raise NotSupported(message, status)
            if 400 <= status < 500:
                raise RequestRefused(message, status)
            raise DesktopError(message)
        return status, body, ctype

    def _where(self) -> str:
        return self.socket_path or self.base_url

    @staticmethod
    def _json(endpoint: str, body: bytes) -> Any:
        try:
            return loads_json(body)
        except (ValueError, RecursionError) as exc:  # not JSON, or nested deeper than the parser goes
            raise DesktopError(f"{endpoint}: controller sent invalid JSON: {body[:200]!r}") from exc

    async def screenshot(self, format: str = "png", quality: int = DEFAULT_JPEG_QUALITY) -> bytes:
        """The whole screen with the cursor drawn in, as encoded image bytes.

        Args:
            format: "png" (lossless, OSWorld's format; the request carries no query, so any OSWorld
                controller answers it) or "jpeg" (smaller and faster to encode at high resolutions).
            quality: JPEG quality 1..100 (ignored for PNG).
        Raises:
            ValueError: an unknown format or a quality outside 1..100.
            DesktopError: the controller cannot be reached, or its answer is not an image of that format.
        """
        endpoint = screenshot_endpoint(format, quality)
        _, body, _ = await self._request("GET", endpoint)
        if not body.startswith(IMAGE_MAGIC[format]):
            raise DesktopError(f"/screenshot from {self._where()} is not a {format.upper()} ({len(body)} bytes)")
        return body

    async def execute(self, command: list[str] | str, *, shell: bool = False, timeout: float = 120,
                      setup: bool = False) -> dict:
        """Run a command to completion inside the desktop.

        Returns OSWorld's shape ``{"status": "success"|"error", "output", "error", "returncode"}``; a
        command that fails or times out inside the desktop is a result (status "error"), not an exception.
        Output and error keep at most 1 MiB each (the controller's ARPO_MAX_OUTPUT_MB); when bytes were dropped
        the result also has ``"truncated": True`` and the full sizes in ``output_bytes`` and ``error_bytes``.
        ``setup`` selects /setup/execute (same behaviour, OSWorld's setup route). Raises DesktopError when
        the controller cannot be reached or does not answer within ``timeout`` + 10 s.
        """
        endpoint = "/setup/execute" if setup else "/execute"
        _, body, _ = await self._request(
            "POST", endpoint, json={"command": command, "shell": shell, "timeout": timeout},
            timeout=timeout + EXECUTE_GRACE_S, ok_statuses=(200, 500))
        data = self._json(endpoint, body)
        if not isinstance(data, dict) or "status" not in data:
            raise DesktopError(f"{endpoint}: unexpected answer {data!r}")
        data.setdefault("output", "")
        data.setdefault("error", data.get("message", ""))
        data.setdefault("returncode", -1)
        return data

    async def launch(self, command: list[str] | str, *, shell: bool = False) -> str:
        """Start a process inside the desktop without waiting for it; returns the controller's text."""
        _, body, _ = await self._request("POST", "/setup/launch", json={"command": command, "shell": shell})
        return body.decode("utf-8", "replace")

    async def get_file(self, path: str) -> bytes | None:
        """Bytes of a file inside the desktop, or None when it does not exist (or is a folder). Raises
        RequestRefused when it is not a regular file (a device, a FIFO) or is over the controller's size limit
        (ARPO_MAX_FILE_MB, set by the fleet from the container's memory)."""
        status, body, _ = await self._request("POST", "/file", data={"file_path": path}, ok_statuses=(200, 404))
        return None if status == 404 else body

    async def upload(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` inside the desktop (parent folders are created). Raises RequestRefused when
        the request is over the controller's body limit (ARPO_MAX_BODY_MB) or ``path`` is not a regular file."""
        form = aiohttp.FormData()
        form.add_field("file_path", path)
        form.add_field("file_data", data, filename="upload", content_type="application/octet-stream")
        await self._request("POST", "/setup/upload", data=form)

    async def screen_size(self) -> tuple[int, int]:
        """(width, height) of the screen in pixels."""
        _, body, _ = await self._request("POST", "/screen_size")
        d = self._json("/screen_size", body)
        return int(d["width"]), int(d["height"])

    async def cursor_position(self) -> tuple[int, int]:
        """(x, y) of the pointer in screen pixels."""
        _, body, _ = await self._request("GET", "/cursor_position")
        x, y = self._json("/cursor_position", body)
        return int(x), int(y)

    async def platform(self) -> str:
        """The desktop's OS name as OSWorld reports it ("Linux")."""
        _, body, _ = await self._request("GET", "/platform")
        return body.decode().strip()

    async def activate_window(self, window_name: str, *, strict: bool = False, by_class: bool = False) -> bool:
        """Raise and focus the first window whose title contains ``window_name`` (case-insensitive), or, when
        strict, equals it (case-sensitive); with ``by_class`` match WM_CLASS ("res_name.res_class") instead of
        the title (OSWorld's rules, those of wmctrl -a [-F] [-x]). Returns False when there is no such window."""
        status, _, _ = await self._request("POST", "/setup/activate_window", ok_statuses=(200, 404),
                                           json={"window_name": window_name, "strict": strict, "by_class": by_class})
        return status == 200

    async def close_window(self, window_name: str, *, strict: bool = False, by_class: bool = False) -> bool:
        """Close (gracefully, as wmctrl -c) the first window :meth:`activate_window` would pick. Returns False
        when there is no such window."""
        status, _, _ = await self._request("POST", "/setup/close_window", ok_statuses=(200, 404),
                                           json={"window_name": window_name, "strict": strict, "by_class": by_class})
        return status == 200

    async def accessibility_tree(self, *, timeout: float = 120.0) -> str:
        """The desktop's AT-SPI accessibility tree as OSWorld's XML (root ``desktop-frame``; namespaces st, attr,
        cp, ...; see actors/desktop/image/accessibility.py). Raises NotSupported where the image has no AT-SPI."""
        _, body, _ = await self._request("GET", "/accessibility", timeout=timeout)
        return str(self._json("/accessibility", body)["AT"])

    async def terminal_output(self, *, timeout: float = 120.0) -> str | None:
        """Text of the focused terminal in the active window (read through AT-SPI), or None when there is none.
        Raises NotSupported where the image has no AT-SPI."""
        _, body, _ = await self._request("GET", "/terminal", timeout=timeout)
        return self._json("/terminal", body)["output"]

    async def start_recording(self) -> None:
        """Start recording the screen (ffmpeg x11grab, 30 fps H.264). Raises NotSupported where the image has
        no ffmpeg (the default image; the osworld image has it) and RequestRefused when one already runs."""
        await self._request("POST", "/start_recording", timeout=30.0)

    async def end_recording(self) -> bytes:
        """Stop the recording and return the MP4's bytes (at most the controller's file limit). Raises
        RequestRefused when no recording runs."""
        _, body, _ = await self._request("POST", "/end_recording", timeout=60.0)
        return body

    async def window_size(self, app_class_name: str) -> tuple[int, int] | None:
        """(width, height) of the first window one of whose WM_CLASS parts equals ``app_class_name``
        (case-insensitive), or None when there is none."""
        status, body, _ = await self._request("POST", "/window_size", data={"app_class_name": app_class_name},
                                              ok_statuses=(200, 404))
        if status == 404:
            return None
        d = self._json("/window_size", body)
        return int(d["width"]), int(d["height"])

    async def desktop_path(self) -> str | None:
        """The desktop folder (``$HOME/Desktop``), or None when it does not exist."""
        status, body, _ = await self._request("POST", "/desktop_path", ok_statuses=(200, 404))
        return None if status == 404 else str(self._json("/desktop_path", body)["desktop_path"])

    async def wallpaper(self) -> bytes | None:
        """Bytes of the wallpaper image (GNOME's picture-uri), or None when none is set. Raises NotSupported
        where the image has no gsettings."""
        status, body, _ = await self._request("POST", "/wallpaper", ok_statuses=(200, 404))
        return None if status == 404 else body

    async def change_wallpaper(self, path: str) -> None:
        """Make the image file at ``path`` (inside the desktop) the wallpaper. Raises RequestRefused (404) when
        it does not exist, NotSupported where the image has no gsettings."""
        await self._request("POST", "/setup/change_wallpaper", json={"path": path})

    async def list_directory(self, path: str) -> dict:
        """OSWorld's directory tree of the folder ``path``: ``{"type": "directory", "name", "children"}`` with
        ``{"type": "file", "name"}`` leaves (names sorted). Raises RequestRefused when it is not a folder."""
        _, body, _ = await self._request("POST", "/list_directory", json={"path": path}, timeout=60.0)
        return self._json("/list_directory", body)["directory_tree"]

    async def open_file(self, path: str, *, window_name: str | None = None, timeout: float = 60.0) -> str:
        """Open a file inside the desktop with its default app (xdg-open), or start the program ``path``, and
        wait (up to ``timeout`` s) for a window whose title contains ``window_name`` (default: the file's name)
        to appear, then activate it. Returns the controller's text. Raises RequestRefused (404) when neither a
        file nor a program ``path`` exists, DesktopError when no window appears in time."""
        payload: dict = {"path": path, "timeout_seconds": timeout}
        if window_name:
            payload["window_name"] = window_name
        _, body, _ = await self._request("POST", "/setup/open_file", json=payload, timeout=timeout + EXECUTE_GRACE_S)
        return body.decode("utf-8", "replace")

    async def download_file(self, url: str, path: str, *, timeout: float = 200.0) -> str:
        """Have the desktop itself download ``url`` to ``path`` (OSWorld's /setup/download_file). Desktops run
        without a network, so this fails (DesktopError naming the cause) unless the URL is reachable from inside;
        a task's ``download`` step fetches on the actor host and uploads instead."""
        _, body, _ = await self._request("POST", "/setup/download_file", json={"url": url, "path": path},
                                         timeout=timeout)
        return body.decode("utf-8", "replace")

    async def run_python(self, code: str) -> dict:
        """Run Python ``code`` in the desktop (30 s limit). Returns OSWorld's answer ``{"status", "message",
        "need_more", "output", "error", "return_code"}``; a timeout is a result with status "error"."""
        _, body, _ = await self._request("POST", "/run_python", json={"code": code}, ok_statuses=(200, 500),
                                         timeout=30 + EXECUTE_GRACE_S)
        return self._json("/run_python", body)

    async def run_bash_script(self, script: str, *, timeout: float = 30.0, working_dir: str | None = None) -> dict:
        """Run a bash script in the desktop. Returns OSWorld's answer ``{"status", "output" (stdout and stderr
        merged), "error": "", "returncode"}``; a timeout is a result with status "error"."""
        _, body, _ = await self._request("POST", "/run_bash_script", ok_statuses=(200, 500),
                                         json={"script": script, "timeout": timeout, "working_dir": working_dir},
                                         timeout=timeout + EXECUTE_GRACE_S)
        return self._json("/run_bash_script", body)

    async def health(self, *, timeout: float = 5.0) -> bool:
        """True when the controller answers and its X display is up; False otherwise (never raises
        DesktopError)."""
        try:
            status, _, _ = await self._request("GET", "/health", timeout=timeout, ok_statuses=(200, 503))
        except DesktopError:
            return False
        return status == 200

    async def reset(self, *, timeout: float = 30.0) -> dict:
        """Put the desktop back to its state at boot (ours, POST /reset: kill every app, delete what episodes
        wrote under /root and /tmp, restore /root's files, release keys and buttons, park the pointer).

        Returns the controller's counts ``{"status": "ok", "killed", "removed", "restored", "seconds"}``.
        Raises DesktopError when the controller cannot be reached, has no /reset (an OSWorld controller), or
        the reset failed (a process survived SIGKILL); such a desktop should be replaced, not reused.
        """
        _, body, _ = await self._request("POST", "/reset", timeout=timeout)
        data = self._json("/reset", body)
        if not isinstance(data, dict) or data.get("status") != "ok":
            raise DesktopError(f"/reset on {self._where()}: unexpected answer {data!r}")
        return data

    async def close(self) -> None:
        """Close the HTTP session (idempotent)."""
        if self._session is not None:
            await self._session.close()
            self._session = None
