"""The desktop controller's HTTP layer (actors/desktop/image/server.py) on a real Unix socket, on the host.

server.py runs inside the desktop on Debian 12's werkzeug (2.2); here it runs on the host's werkzeug with a few
test views and small limits (ARPO_MAX_BODY_MB=1), so the hardening werkzeug now carries is checked without a
container: the socket's mode and temporary name, every Content-Length refusal, 404/405 as JSON, a body that ends
early, the memory budget's 503 while another request holds it (each request on its own thread), the IO timeout,
the drain of a refused body, and large answers sent in slices. The same checks against the real image are
tests/integration/test_desktop.py's hardening tests.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support import until_sync

IMAGE_DIR = Path(__file__).resolve().parents[2] / "actors" / "desktop" / "image"
IMAGE_MODULES = ("server", "limits", "forms")
MIB = 1024 * 1024


@pytest.fixture
def image_modules(monkeypatch):
    """server.py and the modules it imports, loaded fresh with 1 MiB limits (limits.py reads them at import)."""
    monkeypatch.setenv("ARPO_MAX_BODY_MB", "1")
    monkeypatch.setenv("ARPO_MAX_FILE_MB", "1")
    monkeypatch.setenv("ARPO_MAX_JSON_MB", "0.25")
    for name in IMAGE_MODULES:
        sys.modules.pop(name, None)
    sys.path.insert(0, str(IMAGE_DIR))
    try:
        import limits  # noqa: PLC0415 - the controller's modules, importable only from the image folder
        import server  # noqa: PLC0415
        yield server, limits
    finally:
        sys.path.remove(str(IMAGE_DIR))
        for name in IMAGE_MODULES:
            sys.modules.pop(name, None)


class Controller:
    """A server.py app with test views, served on a Unix socket by a thread."""

    def __init__(self, server, limits, socket_path: Path) -> None:
        self.limits = limits
        self.socket_path = socket_path
        self.holding, self.let_go = threading.Event(), threading.Event()
        self.big = bytearray(os.urandom(2 * server.ANSWER_CHUNK + 7))

        def hold(request):
            request.reserve(limits.budget.capacity)
            self.holding.set()
            self.let_go.wait(10)
            return server.text_answer(200, "held")

        def fail(request):
            raise RuntimeError("boom")

        get = {"/big": lambda request: server.bytes_answer(self.big, "application/octet-stream")}
        post = {"/echo": lambda request: server.json_answer(200, request.json_object()),
                "/form": lambda request: server.json_answer(
                    200, {k: v.decode() for k, v in request.form_fields().items()}),
                "/hold": hold, "/fail": fail}
        self.httpd = server.listen(server.App(server.url_map(get, post)), "", str(socket_path))
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05})
        self.thread.start()

    def exchange(self, data: bytes, *, end_body: bool = False, timeout: float = 10) -> tuple[int, dict, bytes]:
        """Send ``data`` as it is (``end_body``: then shut the write side) and read the answer up to the close:
        (status, lower-cased headers, body); status 0 when the connection closed without an answer."""
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(timeout)
            s.connect(str(self.socket_path))
            s.sendall(data)
            if end_body:
                s.shutdown(socket.SHUT_WR)
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
        if not head:
            return 0, {}, b""
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        assert int(headers.get("content-length", len(body))) == len(body)
        return int(status_line.split()[1]), headers, body

    def post(self, path: str, body: bytes, extra: bytes = b"", **kw) -> tuple[int, dict, bytes]:
        head = b"POST %s HTTP/1.1\r\nHost: d\r\nContent-Length: %d\r\n%s\r\n" % (path.encode(), len(body), extra)
        return self.exchange(head + body, **kw)

    def close(self) -> None:
        self.let_go.set()
        self.httpd.shutdown()
        self.thread.join(10)


@pytest.fixture
def controller(image_modules, tmp_path):
    server, limits = image_modules
    c = Controller(server, limits, tmp_path / "run" / "controller.sock")
    try:
        yield c
    finally:
        c.close()


def refused(answer: tuple[int, dict, bytes], status: int, *words: str) -> None:
    code, headers, body = answer
    message = json.loads(body)
    assert code == status and message["status"] == "error", (code, body)
    assert all(w in message["message"] for w in words), message
    assert headers["content-type"] == "application/json" and headers["connection"] == "close"


def test_socket_is_bound_under_a_temporary_name_and_is_0660(image_modules, tmp_path):
    server, limits = image_modules
    path = tmp_path / "run" / "controller.sock"
    path.parent.mkdir()
    path.write_text("an old socket")  # replaced
    c = Controller(server, limits, path)
    try:
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
        assert not os.path.exists(f"{path}.tmp")
        assert c.post("/echo", b'{"a": [1]}')[::2] == (200, b'{"a": [1]}')
    finally:
        c.close()


def test_answers_json_text_and_bytes_in_slices(controller):
    code, headers, body = controller.post("/echo", b'{"x": "\\u00e9"}', b"Content-Type: application/json\r\n")
    assert (code, json.loads(body), headers["content-type"]) == (200, {"x": "\u00e9"}, "application/json")
    code, headers, body = controller.exchange(b"GET /big HTTP/1.1\r\nHost: d\r\n\r\n")
    assert (code, body) == (200, bytes(controller.big)) and headers["connection"] == "close"
    form = b"file_path=%2Ftmp%2Fx&n=1&n=2"
    assert controller.post("/form", form)[::2] == (200, b'{"file_path": "/tmp/x", "n": "1"}')
    assert controller.limits.budget.held == 0


@pytest.mark.parametrize("headers, status, words", [
    (b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n", 400, ["Transfer-Encoding"]),
    (b"Transfer-Encoding: chunked\r\n", 411, ["Transfer-Encoding"]),
    (b"", 411, ["Content-Length"]),
    (b"Content-Length: -1\r\n", 400, ["non-negative integer"]),
    (b"Content-Length: 0x10\r\n", 400, ["non-negative integer"]),
    (b"Content-Length: 4\r\nContent-Length: 5\r\n", 400, ["conflicting"]),
    (b"Content-Length: %d\r\n" % (2 * MIB), 413, ["ARPO_MAX_BODY_MB"]),
    (b"Content-Length: %d\r\n" % (MIB // 2), 413, ["ARPO_MAX_JSON_MB"]),
], ids=["chunked", "chunked-alone", "missing", "negative", "hex", "conflicting", "over-body", "over-json"])
def test_bad_content_lengths_are_refused_and_close(controller, headers, status, words):
    refused(controller.exchange(b"POST /echo HTTP/1.1\r\nHost: d\r\n" + headers + b"\r\n", end_body=True),
            status, *words)
    assert controller.post("/echo", b"{}")[0] == 200  # the controller goes on


def test_unknown_routes_and_methods_and_failing_views_answer_json(controller):
    refused(controller.post("/nowhere", b"{}"), 404, "no route POST /nowhere")
    refused(controller.exchange(b"GET /echo HTTP/1.1\r\nHost: d\r\n\r\n"), 405, "no route GET /echo", "POST")
    refused(controller.post("/fail", b""), 500, "RuntimeError: boom")
    refused(controller.post("/echo", b"[1]"), 400, "must be a JSON object")
    refused(controller.post("/form", b"--b\r\n", b"Content-Type: multipart/form-data; boundary=b\r\n"),
            400, "multipart/form-data")


def test_a_body_that_ends_early_is_a_400(controller):
    head = b"POST /echo HTTP/1.1\r\nHost: d\r\nContent-Length: 100\r\n\r\n"
    refused(controller.exchange(head + b'{"a": 1', end_body=True), 400, "Content-Length of 100")


def test_a_refused_body_is_drained_so_the_client_reads_the_answer(controller):
    # 0.9 MiB: more than the socket buffers hold, so without the drain sendall would fail with a broken pipe
    body = b"x" * (MIB - MIB // 10)
    refused(controller.post("/nowhere", body, b"Content-Type: multipart/form-data; boundary=b\r\n"), 404, "no route")


def test_budget_refuses_with_503_while_another_request_holds_it(controller):
    controller.limits.budget.wait_s = 0.3
    answers = []
    first = threading.Thread(target=lambda: answers.append(controller.post("/hold", b"")))
    first.start()
    try:
        assert controller.holding.wait(10)  # its own thread: the next request is served meanwhile
        t0 = time.monotonic()
        refused(controller.post("/echo", b"{}"), 503, "controller busy")
        assert 0.25 < time.monotonic() - t0 < 5
    finally:
        controller.let_go.set()
        first.join(10)
    assert answers[0][::2] == (200, b"held")
    until_sync(lambda: controller.limits.budget.held == 0, 5, "the budget given back once the answer was sent",
               every_s=0.01)
    assert controller.post("/echo", b"{}")[0] == 200


def test_idle_and_stalled_connections_are_closed_after_the_io_timeout(controller, image_modules, monkeypatch):
    server, _ = image_modules
    monkeypatch.setattr(server.Handler, "timeout", 0.3)
    monkeypatch.setattr(server.Handler, "body_timeout", 0.3)
    for data in (b"", b"POST /echo HTTP/1.1\r\nHost: d\r\nContent-Length: 10\r\n\r\n{}"):
        t0 = time.monotonic()
        with contextlib.suppress(ConnectionResetError):
            code, _, body = controller.exchange(data)
            assert code in (0, 400), body  # a stalled body may still get its 400
        assert time.monotonic() - t0 < 5
    assert controller.post("/echo", b"{}")[0] == 200


def test_listens_on_tcp_when_asked(image_modules):
    server, _ = image_modules
    app = server.App(server.url_map({}, {"/echo": lambda request: server.json_answer(200, request.json_object())}))
    httpd = server.listen(app, "127.0.0.1:0", "/nonexistent/unused.sock")
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        with socket.create_connection(("127.0.0.1", httpd.port), timeout=10) as s:
            s.sendall(b'POST /echo HTTP/1.1\r\nHost: d\r\nContent-Length: 8\r\n\r\n{"a": 1}')
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'\r\n\r\n{"a": 1}')
    finally:
        httpd.shutdown()
        thread.join(10)


def test_a_body_that_is_not_json_or_nested_too_deeply_is_a_400(controller):
    """Issue 24 item 8: a deeply nested JSON body was a 500 (RecursionError)."""
    refused(controller.post("/echo", b"[" * 100_000 + b"]" * 100_000), 400, "nested too deeply")
    refused(controller.post("/echo", b'{"a": '), 400, "not JSON")


def test_idle_connections_beyond_the_cap_wait_and_never_take_a_thread_each(image_modules, tmp_path, monkeypatch):
    """Issue 24 item 8: 40 connections that never send a request line hold at most max_connections handler
    threads (the rest wait in the backlog) and are closed after the header timeout, so a real request behind them
    is answered; 256 such connections used to exhaust the container's process limit."""
    server, limits = image_modules
    monkeypatch.setattr(server.BoundedServer, "max_connections", 4)
    monkeypatch.setattr(server.Handler, "timeout", 0.5)
    c = Controller(server, limits, tmp_path / "run" / "controller.sock")
    idle = []
    try:
        base = threading.active_count()
        for _ in range(40):
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(c.socket_path))
            idle.append(s)
        until_sync(lambda: threading.active_count() - base >= 4, 5, "4 handler threads", every_s=0.01)
        assert threading.active_count() - base == 4  # the other 36 wait in the backlog, not in threads
        assert c.post("/echo", b'{"ok": 1}', timeout=30)[::2] == (200, b'{"ok": 1}')
    finally:
        for s in idle:
            s.close()
        c.close()
