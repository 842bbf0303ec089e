"""The controller's HTTP layer on werkzeug (Debian 12's python3-werkzeug, 2.2): the server, each request's
checks and body, the answers and the refusals.

Owns: :func:`listen` (werkzeug.serving's ThreadedWSGIServer on the Unix socket or on TCP, with :class:`Handler`,
werkzeug's WSGIRequestHandler given the IO timeout and quiet logs), :class:`App` (the WSGI application: it checks
each request's Content-Length, reserves the body's memory from the budget, reads the body, routes the request
through a werkzeug.routing Map to its view and turns every failure into a JSON refusal), :class:`Request`
(werkzeug's request with the controller's helpers ``json_object``, ``form_fields``, ``release_body`` and
``reserve``), and the answers views return: :func:`json_answer`, :func:`text_answer`, :func:`bytes_answer`.
Views (routes.py, osworld_routes.py) are plain functions ``view(request) -> werkzeug Response``.

Limits (ours; OSWorld's server has none). Every request body needs a Content-Length (411 without one, 400
when it is not a plain non-negative integer, when two disagree, or when a Transfer-Encoding is sent, 413 above
the limit); refusals are JSON {"status": "error", "message"} (404 for an unknown path, 405 for a known path with
another method). Environment variables, in MiB (fractions allowed):

    ARPO_MAX_BODY_MB    64  largest request body (a /setup/upload); JSON and url-encoded bodies: ARPO_MAX_JSON_MB
    ARPO_MAX_JSON_MB     1  largest JSON or url-encoded request body (parsed into Python objects, ~30x its size)
    ARPO_MAX_FILE_MB    64  largest file /file, /wallpaper and /end_recording send (and the recording's cap),
                            and largest accessibility tree
    ARPO_MAX_OUTPUT_MB   1  stdout and stderr kept by /execute, each (the rest is read and dropped)

The fleet sets the body and file limits from the container's memory limit (an eighth of it, at most 64).
Requests also share a memory budget (limits.BUDGET_BYTES, twice the larger of the body and file limits): a
body, a file read or an answer reserves its worst-case size first (:meth:`Request.reserve`, held until the answer
is sent) and waits (up to BUDGET_WAIT_S, then 503) while others hold it, so concurrent requests cannot add up
past the container's memory.

Invariants: every request is handled on its own thread (daemon threads), at most MAX_CONNECTIONS at once (more
wait in the listen backlog, so connections never exhaust the container's process limit), and every connection
carries one request (werkzeug's server answers each with Connection: close), so a refusal always closes its
connection; a connection that has not sent its headers within HEADER_TIMEOUT_S, or is idle or stalled for
IO_TIMEOUT_S after that, is closed (werkzeug 2.2 first answers a stalled body with a 400); a JSON body that does
not parse, is nested too deeply or is no object is a 400; a
refused body that was not read is drained first (up to DRAIN_MAX_BYTES), so the client sees the answer rather
than a broken pipe. The Unix socket appears only once it listens (bound under a temporary name, then renamed
over the old one), mode 0660.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import threading
import urllib.parse
from collections.abc import Callable, Iterator

from werkzeug.exceptions import ClientDisconnected, HTTPException, MethodNotAllowed, NotFound
from werkzeug.routing import Map, Rule
from werkzeug.serving import ThreadedWSGIServer, WSGIRequestHandler
from werkzeug.wrappers import Request as WerkzeugRequest
from werkzeug.wrappers import Response
from werkzeug.wsgi import ClosingIterator

from forms import is_multipart, parse_multipart
from limits import (
    BODY_EXPANSION, DRAIN_MAX_BYTES, HEADER_TIMEOUT_S, IO_TIMEOUT_S, JSON_EXPANSION, MAX_BODY_BYTES, MAX_CONNECTIONS,
    MAX_JSON_BYTES, HTTPError, budget,
)

View = Callable[["Request"], Response]
CONTENT_LENGTHS = "arpo.content_lengths"
"""The environ key under which :class:`Handler` passes every Content-Length header (werkzeug keeps the last)."""
ANSWER_CHUNK = 1024 * 1024  # bytes answers are sent in slices of this size: see bytes_answer
DRAIN_CHUNK = 64 * 1024
_DIGITS = re.compile(r"[0-9]+")


def content_length(environ: dict) -> int:
    """The request's body length from its headers, checked; HTTPError (400, 411, 413) when it is missing for a
    method with a body, is not a plain non-negative integer, disagrees with itself, comes with a
    Transfer-Encoding, or exceeds MAX_BODY_BYTES."""
    method = environ["REQUEST_METHOD"]
    values = environ.get(CONTENT_LENGTHS)
    if values is None:  # another server than Handler's
        values = [environ["CONTENT_LENGTH"]] if "CONTENT_LENGTH" in environ else []
    if environ.get("HTTP_TRANSFER_ENCODING") is not None:
        raise HTTPError(400 if values else 411,
                        "Transfer-Encoding is not supported: send the body with a Content-Length")
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


def json_answer(status: int, obj) -> Response:
    """``obj`` as JSON (application/json) with HTTP ``status``."""
    return Response(json.dumps(obj), status=status, mimetype="application/json")


def text_answer(status: int, text: str) -> Response:
    """``text`` as text/plain; charset=utf-8 with HTTP ``status``."""
    return Response(text, status=status, mimetype="text/plain")


def bytes_answer(data: bytes | bytearray, content_type: str, status: int = 200) -> Response:
    """``data`` with its Content-Length, sent in ANSWER_CHUNK slices: werkzeug's server writes bytes objects only,
    and slicing sends a bytearray (a file read) without copying it whole."""
    def slices() -> Iterator[bytes]:
        with memoryview(data) as view:
            for start in range(0, len(data), ANSWER_CHUNK):
                yield bytes(view[start:start + ANSWER_CHUNK])

    return Response(slices(), status=status, content_type=content_type, headers={"Content-Length": str(len(data))})


class Request(WerkzeugRequest):
    """werkzeug's request; :class:`App` reads its ``body`` before the view runs and holds the memory it reserved."""

    def __init__(self, environ: dict) -> None:
        super().__init__(environ)
        self.body, self.body_read = b"", False
        self._body_hold = contextlib.ExitStack()  # the body's reservation (release_body gives it back early)
        self._holds = contextlib.ExitStack()  # the answer's reservations: given back once it has been sent

    def json_object(self) -> dict:
        """The body parsed as a JSON object ({} when empty); HTTPError 400 when it is not JSON, is nested too
        deeply for the parser, or is not an object."""
        try:
            data = json.loads(self.body) if self.body else {}
        except RecursionError:
            raise HTTPError(400, "request body: JSON nested too deeply") from None
        except ValueError as exc:
            raise HTTPError(400, f"request body is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise HTTPError(400, "request body must be a JSON object")
        return data

    def form_fields(self) -> dict[str, bytes | bytearray]:
        """The body's form fields, multipart/form-data (forms.py) or url-encoded (the first value of each);
        HTTPError 400 for a malformed multipart body."""
        content_type = self.headers.get("Content-Type", "")
        if is_multipart(content_type):
            try:
                return parse_multipart(content_type, self.body)
            except ValueError as exc:
                raise HTTPError(400, f"bad multipart/form-data body: {exc}") from None
        return {k: v[0].encode() for k, v in urllib.parse.parse_qs(self.body.decode("utf-8")).items()}

    def reserve_body(self, n: int) -> None:
        """Reserve ``n`` bytes of the budget for the body until the answer is sent or :meth:`release_body`."""
        self._body_hold.enter_context(budget.hold(n))

    def release_body(self) -> None:
        """Give the body's memory reservation back early (a view that keeps nothing of it)."""
        self._body_hold.close()

    def reserve(self, n: int) -> None:
        """Reserve ``n`` bytes of the budget for the answer until it has been sent; waits while others hold the
        budget, HTTPError 503 after BUDGET_WAIT_S."""
        self._holds.enter_context(budget.hold(n))

    def release(self) -> None:
        """Give every reservation back (the answer has been sent, or the request failed)."""
        self._holds.close()
        self._body_hold.close()

    def drain(self) -> None:
        """Read and drop a refused body that was not read, when it announced at most DRAIN_MAX_BYTES (a client
        writing it would otherwise fail with a broken pipe before it reads the answer)."""
        raw = (self.environ.get("CONTENT_LENGTH") or "").strip()
        if self.body_read or "HTTP_TRANSFER_ENCODING" in self.environ or not _DIGITS.fullmatch(raw):
            return
        if 0 < int(raw) <= DRAIN_MAX_BYTES:
            with contextlib.suppress(ClientDisconnected, OSError):
                while self.stream.read(DRAIN_CHUNK):
                    pass


class App:
    """The controller's WSGI application: the checks, the body and the budget in front of ``url_map``'s views
    (each Rule's endpoint is its view)."""

    def __init__(self, url_map: Map) -> None:
        self.url_map = url_map

    def __call__(self, environ: dict, start_response) -> ClosingIterator:
        request = Request(environ)
        response = self._answer(request)
        return ClosingIterator(response(environ, start_response), request.release)

    def _answer(self, request: Request) -> Response:
        try:
            return self._run(request)
        except HTTPError as exc:
            return self._refuse(request, exc.status, str(exc), **exc.extra)
        except ClientDisconnected:
            return self._refuse(request, 400, f"request body ended before its Content-Length of "
                                              f"{request.content_length} bytes")
        except (MethodNotAllowed, NotFound) as exc:
            return self._refuse(request, exc.code, f"no route {request.method} {request.path}"
                                + (f" (it takes {', '.join(exc.valid_methods)})" if exc.code == 405 else ""))
        except HTTPException as exc:
            return self._refuse(request, exc.code or 500, exc.description or exc.name)
        except (ConnectionError, TimeoutError):
            request.release()
            raise  # the client went away or stalled: werkzeug's handler drops the connection
        except Exception as exc:  # noqa: BLE001 - every failure becomes a 500 with its message
            return self._refuse(request, 500, f"{type(exc).__name__}: {exc}")

    def _run(self, request: Request) -> Response:
        """Check and read the body, then run the request's view."""
        n = content_length(request.environ)
        multipart = is_multipart(request.headers.get("Content-Type", ""))
        if n > MAX_JSON_BYTES and not multipart:
            raise HTTPError(413, f"a request body that is not multipart/form-data may have at most "
                                 f"{MAX_JSON_BYTES} bytes (ARPO_MAX_JSON_MB); this one has {n}")
        view, _ = self.url_map.bind_to_environ(request.environ).match()
        request.reserve_body(n * (BODY_EXPANSION if multipart else JSON_EXPANSION))
        request.body = request.get_data(cache=False)  # werkzeug's LimitedStream: ClientDisconnected if it ends early
        request.body_read = True
        return view(request)

    @staticmethod
    def _refuse(request: Request, status: int, message: str, **extra) -> Response:
        """The controller's JSON error, {"status": "error", "message", **extra}, once the request's reservations
        are given back and its unread body drained."""
        request.release()
        request.drain()
        return json_answer(status, {"status": "error", "message": message, **extra})


def url_map(get: dict[str, View], post: dict[str, View]) -> Map:
    """A werkzeug Map of the controller's routes: ``get`` and ``post`` map each path to its view."""
    rules = [Rule(path, methods=["GET"], endpoint=view) for path, view in get.items()]
    rules += [Rule(path, methods=["POST"], endpoint=view) for path, view in post.items()]
    return Map(rules, merge_slashes=False)


class Handler(WSGIRequestHandler):
    """werkzeug's request handler with the controller's IO timeout, name and quiet logs; it also passes every
    Content-Length header on (CONTENT_LENGTHS), so App can refuse conflicting ones."""

    server_version = "arpo-controller/1"
    protocol_version = "HTTP/1.1"
    timeout = HEADER_TIMEOUT_S  # set on the connection: one that sends no headers is closed, its thread freed
    body_timeout = IO_TIMEOUT_S  # once the headers are in: the body and the answer get this longer deadline

    def make_environ(self) -> dict:
        self.connection.settimeout(self.body_timeout)
        environ = super().make_environ()
        environ[CONTENT_LENGTHS] = self.headers.get_all("Content-Length") or []
        return environ

    def log(self, type: str, message: str, *args) -> None:  # noqa: A002 - werkzeug's signature
        if os.environ.get("ARPO_CONTROLLER_LOG"):
            sys.stderr.write(f"controller: {type}: {message % args if args else message}\n")


class BoundedServer(ThreadedWSGIServer):
    """werkzeug's threaded server serving at most ``max_connections`` connections at once: the accept loop waits
    for one to end before it takes the next (the rest wait in the listen backlog)."""

    max_connections = MAX_CONNECTIONS

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - werkzeug's BaseWSGIServer arguments
        self._slots, self._stopping = threading.BoundedSemaphore(self.max_connections), False
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address) -> None:  # noqa: ANN001 - socketserver's signature
        while not self._slots.acquire(timeout=0.5):
            if self._stopping:
                self.shutdown_request(request)
                return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:  # noqa: ANN001
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def shutdown(self) -> None:
        self._stopping = True
        super().shutdown()


def listen(app: App, tcp: str, socket_path: str) -> ThreadedWSGIServer:
    """A threaded werkzeug server for ``app``, listening on TCP ``host:port`` when ``tcp`` is set, else on the
    Unix socket ``socket_path`` (its folder created; an old socket replaced; mode 0660)."""
    if tcp:
        host, _, port = tcp.rpartition(":")
        return BoundedServer(host or "0.0.0.0", int(port), app, Handler)
    os.makedirs(os.path.dirname(socket_path), exist_ok=True)
    # Bind under a temporary name (werkzeug removes a leftover one) and rename, so the host never connects to a
    # half-set-up socket.
    tmp = socket_path + ".tmp"
    server = BoundedServer(f"unix://{tmp}", 0, app, Handler)
    os.chmod(tmp, 0o660)  # root (the host's actors) only; the folder is 0700 besides
    os.rename(tmp, socket_path)
    return server
