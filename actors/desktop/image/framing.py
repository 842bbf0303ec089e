"""The controller's HTTP layer: listeners, request framing, body limits, answers and refusals.

Owns: the threaded Unix-socket and TCP servers (:func:`listen`), and :class:`RequestHandler`, the base of the
controller's handler (routes.py): it checks and reads each request's body, reserves its memory from the
budget, runs the route, and turns every failure into a JSON answer. Routes use its helpers ``_json_body``,
``_form`` (multipart bodies split by forms.py), ``_send``, ``_json``, ``_text`` and ``release_body``
(osworld_routes.py's handlers too).

Limits (ours; OSWorld's server has none). Every request body needs a Content-Length (411 without one, 400
when it is not a plain non-negative integer or a Transfer-Encoding is sent, 413 above the limit); errors are
JSON {"status": "error", "message"} and close the connection. Environment variables, in MiB (fractions allowed):

    ARPO_MAX_BODY_MB    64  largest request body (a /setup/upload); JSON and url-encoded bodies: ARPO_MAX_JSON_MB
    ARPO_MAX_JSON_MB     1  largest JSON or url-encoded request body (parsed into Python objects, ~30x its size)
    ARPO_MAX_FILE_MB    64  largest file /file, /wallpaper and /end_recording send (and the recording's cap),
                            and largest accessibility tree
    ARPO_MAX_OUTPUT_MB   1  stdout and stderr kept by /execute, each (the rest is read and dropped)

The fleet sets the body and file limits from the container's memory limit (an eighth of it, at most 64).
Requests also share a memory budget (limits.BUDGET_BYTES, twice the larger of the body and file limits): a
body, a file read or an /execute answer reserves its worst-case size first and waits (up to
BUDGET_WAIT_S, then 503) while others hold it, so concurrent requests cannot add up past the container's memory.

Invariants: every request is handled on its own thread; a connection idle or stalled for IO_TIMEOUT_S is
closed; a refused body that was not read is drained (up to DRAIN_MAX_BYTES) and its connection closed, so it
is never taken for the next request. The Unix socket appears only once it listens (bound under a temporary
name, then renamed), mode 0660.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import socketserver
import sys
import urllib.parse
from http.server import BaseHTTPRequestHandler

from forms import is_multipart, parse_multipart
from limits import (
    BODY_EXPANSION, DRAIN_MAX_BYTES, IO_TIMEOUT_S, JSON_EXPANSION, MAX_BODY_BYTES, MAX_JSON_BYTES, HTTPError, budget,
)


_DIGITS = re.compile(r"[0-9]+")


def content_length(headers, method: str) -> int:
    """The request's body length from its headers, checked; HTTPError (400, 411, 413) when it is missing for a
    method with a body, is not a plain non-negative integer, disagrees with itself, or exceeds MAX_BODY_BYTES."""
    if headers.get("Transfer-Encoding") is not None:
        raise HTTPError(411 if headers.get("Content-Length") is None else 400,
                        "Transfer-Encoding is not supported: send the body with a Content-Length")
    values = headers.get_all("Content-Length") or []
    if not values:
        if method in ("POST", "PUT", "PATCH"):
            raise HTTPError(411, f"{method} needs a Content-Length header (0 for no body)")
        return 0
    if len({v.strip() for v in values}) != 1:
        raise HTTPError(400, f"conflicting Content-Length headers: {values}")
    raw = values[0].strip()
    if not _DIGITS.fullmatch(raw):
        raise HTTPError(400, f"Content-Length must be a non-negative integer, got {raw[:40]!r}")
    n = int(raw)
    if n > MAX_BODY_BYTES:
        raise HTTPError(413, f"request body of {n} bytes exceeds the controller's limit of {MAX_BODY_BYTES} bytes "
                             "(ARPO_MAX_BODY_MB)")
    return n


class RequestHandler(BaseHTTPRequestHandler):
    """Framing and hardening for one connection; a subclass adds the routes and calls :meth:`_dispatch`."""

    server_version = "arpo-controller/1"
    protocol_version = "HTTP/1.1"
    timeout = IO_TIMEOUT_S  # set on the connection: an idle or stalled one is closed, its thread freed

    # --- plumbing -------------------------------------------------------------------------------
    def address_string(self) -> str:  # Unix-socket peers have no address
        return "unix"

    def log_message(self, fmt: str, *args) -> None:
        if os.environ.get("ARPO_CONTROLLER_LOG"):
            sys.stderr.write("controller: " + (fmt % args) + "\n")

    def _body(self) -> bytes:
        """The request body, read (and checked) by _dispatch before the endpoint runs."""
        return self._raw

    def _json_body(self) -> dict:
        body = self._body()
        data = json.loads(body) if body else {}
        if not isinstance(data, dict):
            raise TypeError("request body must be a JSON object")
        return data

    def _form(self) -> dict[str, bytes]:
        ctype = self.headers.get("Content-Type", "")
        body = self._body()
        if is_multipart(ctype):
            try:
                return parse_multipart(ctype, body)
            except ValueError as exc:
                raise HTTPError(400, f"bad multipart/form-data body: {exc}") from None
        return {k: v[0].encode() for k, v in urllib.parse.parse_qs(body.decode("utf-8")).items()}

    def _send(self, code: int, body: bytes | bytearray, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _json(self, code: int, obj) -> None:
        self._send(code, json.dumps(obj).encode(), "application/json")

    def _text(self, code: int, text: str) -> None:
        self._send(code, text.encode(), "text/plain; charset=utf-8")

    def _refuse(self, code: int, message: str, **extra) -> None:
        """A JSON error; closes the connection when the request's body was not read (it would be taken for the
        next request)."""
        if not self._body_read:
            self.close_connection = True
        self._json(code, {"status": "error", "message": message, **extra})

    def _read_body(self, n: int) -> bytes:
        data = self.rfile.read(n) if n else b""
        if len(data) != n:
            raise HTTPError(400, f"request body ended after {len(data)} of its {n} bytes")
        self._body_read = True
        return data

    def _declared_length(self) -> int:
        """The Content-Length as sent when it is a plain integer (even over the limit), else 0."""
        raw = (self.headers.get("Content-Length") or "").strip()
        return int(raw) if _DIGITS.fullmatch(raw) and self.headers.get("Transfer-Encoding") is None else 0

    def _drain(self, n: int) -> None:
        """Read and drop a refused body in small chunks (a client writing it would otherwise fail with a
        broken pipe before it reads our answer); the connection is closed afterwards anyway."""
        try:
            while n > 0:
                chunk = self.rfile.read(min(n, 65536))
                if not chunk:
                    break
                n -= len(chunk)
        except OSError:
            pass

    def release_body(self) -> None:
        """Give the body's memory reservation back early (an endpoint that keeps nothing of it)."""
        self._hold.close()

    def _dispatch(self, routes: dict) -> None:
        """Check and read the body, then run ``routes[path](self)``; every failure is answered as JSON."""
        path = urllib.parse.urlsplit(self.path).path
        fn = routes.get(path)
        self._raw, self._body_read, n = b"", False, 0
        self._hold = contextlib.ExitStack()
        try:
            with self._hold:
                n = content_length(self.headers, self.command)
                multipart = is_multipart(self.headers.get("Content-Type", ""))
                if n > MAX_JSON_BYTES and not multipart:
                    raise HTTPError(413, f"a request body that is not multipart/form-data may have at most "
                                         f"{MAX_JSON_BYTES} bytes (ARPO_MAX_JSON_MB); this one has {n}")
                if fn is None:
                    raise HTTPError(404, f"no route {self.command} {path}")
                self._body_read = n == 0
                self._hold.enter_context(budget.hold(n * (BODY_EXPANSION if multipart else JSON_EXPANSION)))
                self._raw = self._read_body(n)
                fn(self)
        except HTTPError as exc:
            if not self._body_read and 0 < (n or self._declared_length()) <= DRAIN_MAX_BYTES:
                self._drain(n or self._declared_length())
            self._refuse(exc.status, str(exc), **exc.extra)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as exc:  # noqa: BLE001 - every failure becomes a 500 with its message
            self._refuse(500, f"{type(exc).__name__}: {exc}")
        finally:
            self._raw = b""


class UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class TCPHTTPServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True


def listen(handler: type[BaseHTTPRequestHandler], tcp: str, socket_path: str) -> socketserver.BaseServer:
    """A threaded server for ``handler``, listening on TCP ``host:port`` when ``tcp`` is set, else on the Unix
    socket ``socket_path`` (its folder created; an old socket replaced; mode 0660)."""
    if tcp:
        host, _, port = tcp.rpartition(":")
        return TCPHTTPServer((host or "0.0.0.0", int(port)), handler)
    os.makedirs(os.path.dirname(socket_path), exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)
    # Bind under a temporary name and rename, so the host never connects to a half-set-up socket.
    tmp = socket_path + ".tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    server = UnixHTTPServer(tmp, handler)
    os.chmod(tmp, 0o660)  # root (the host's actors) only; the folder is 0700 besides
    os.rename(tmp, socket_path)
    return server
