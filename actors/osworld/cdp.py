"""Chromium's pages over the DevTools protocol (CDP), from inside the desktop: evaluate JavaScript in a tab, print
a page to PDF.

OSWorld's page getters (desktop_env/evaluators/getters/chrome.py: get_active_tab_html_parse, get_pdf_from_url,
get_page_info, get_info_from_website) connect playwright to the browser's ``--remote-debugging-port`` from the
host. Our desktops have no network and the host cannot reach that port, so, as :mod:`actors.osworld.chrome` does
for tabs, :data:`CDP_SCRIPT` runs inside the desktop (Debian's python3, standard library only, through the
controller's /execute): it finds the DevTools endpoint on :data:`~actors.osworld.chrome.DEVTOOLS_PORTS`, picks a
page and talks to it over the page's websocket (a minimal RFC 6455 client: masked text frames out, fragmented
frames in) with ``Runtime.evaluate`` and ``Page.printToPDF``.

Targets: ``{"tab": URL}`` is the open page whose URL equals URL after percent-decoding and without a trailing
slash (OSWorld's ``normalize_url`` in get_active_tab_html_parse); ``{"new": URL}`` opens URL in a new tab
(``PUT /json/new``), waits until ``document.readyState`` is ``complete`` (playwright's ``goto`` ... ``load``),
and closes the tab afterwards. A ``new`` URL on a host the desktop cannot reach fails with kind
``needs_network`` before any tab opens, as ``chrome_open_tabs`` does (:mod:`actors.osworld.chrome`).
"""
from __future__ import annotations

import json
from typing import Any

from actors.desktop.controller_client import ControllerClient
from actors.osworld.chrome import DEVTOOLS_PORTS, UNREACHABLE_FN

CDP_SCRIPT = r'''
import base64, ipaddress, json, os, socket, struct, sys, time, urllib.parse, urllib.request
req = json.loads(sys.argv[1])
deadline = time.monotonic() + req["wait_s"]
def fail(msg, kind="failed"):
    print(json.dumps({"error": msg, "kind": kind})); sys.exit(4)
def call(port, path, method="GET"):
    with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method),
                                timeout=10) as resp:
        return json.loads(resp.read())
port = None
while port is None:
    for p in req["ports"]:
        try:
            call(p, "/json/version"); port = p; break
        except Exception:
            pass
    if port is None:
        if time.monotonic() > deadline:
            fail("no Chrome DevTools endpoint on ports %s" % req["ports"], "no_browser")
        time.sleep(0.5)
class WS:
    def __init__(self, url):
        u = urllib.parse.urlsplit(url)
        self.s = socket.create_connection((u.hostname, u.port), timeout=max(1.0, deadline - time.monotonic()))
        key = base64.b64encode(os.urandom(16)).decode()
        self.s.sendall(("GET %s HTTP/1.1\r\nHost: %s\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                        "Sec-WebSocket-Key: %s\r\nSec-WebSocket-Version: 13\r\n\r\n"
                        % (u.path, u.netloc, key)).encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.s.recv(4096)
            if not chunk:
                fail("websocket handshake: connection closed")
            head += chunk
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            fail("websocket handshake refused: %r" % head[:200])
        self.buf, self.next_id = head.split(b"\r\n\r\n", 1)[1], 0
    def _read(self, n):
        while len(self.buf) < n:
            chunk = self.s.recv(1 << 20)
            if not chunk:
                fail("websocket closed by the browser")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out
    def _frame(self):
        b0, b1 = self._read(2)
        n = b1 & 0x7F
        if n == 126:
            n = struct.unpack(">H", self._read(2))[0]
        elif n == 127:
            n = struct.unpack(">Q", self._read(8))[0]
        mask = self._read(4) if b1 & 0x80 else None
        data = self._read(n)
        if mask:
            data = bytes(c ^ mask[i % 4] for i, c in enumerate(data))
        return b0 & 0x80, b0 & 0x0F, data
    def send(self, method, params=None):
        self.next_id += 1
        data = json.dumps({"id": self.next_id, "method": method, "params": params or {}}).encode()
        n = len(data)
        head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n)
                                 if n < 65536 else bytes([0x80 | 127]) + struct.pack(">Q", n))
        mask = os.urandom(4)
        self.s.sendall(head + mask + bytes(c ^ mask[i % 4] for i, c in enumerate(data)))
        while True:
            self.s.settimeout(max(0.1, deadline - time.monotonic()))
            msg, fin = b"", 0
            while not fin:
                fin, op, data = self._frame()
                if op == 8:
                    fail("websocket closed by the browser")
                msg += data
            answer = json.loads(msg)
            if answer.get("id") == self.next_id:
                if "error" in answer:
                    fail("%s: %s" % (method, answer["error"].get("message", answer["error"])))
                return answer.get("result", {})
def norm(u):
    return urllib.parse.unquote(u).rstrip("/")
''' + UNREACHABLE_FN + r'''def evaluate(ws, expression):
    r = ws.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
    if "exceptionDetails" in r:
        fail("javascript: %s" % r["exceptionDetails"].get("exception", {}).get("description", r["exceptionDetails"]))
    return r.get("result", {}).get("value")
created = None
try:
    if "tab" in req:
        pages = [t for t in call(port, "/json/list") if t.get("type") == "page"]
        match = [t for t in pages if norm(t.get("url", "")) == norm(req["tab"])]
        if not match:
            fail("no open tab at %s (open: %s)" % (req["tab"], [t.get("url") for t in pages]), "no_tab")
        target = match[0]
    else:
        bad = unreachable(req["new"])
        if bad:
            fail(bad[1].replace(": ", " cannot be reached from the desktop: ", 1),
                 "failed" if bad[0] == "setup_failed" else bad[0])
        target = created = call(port, "/json/new?" + urllib.parse.quote(req["new"], safe=""), "PUT")
    ws = WS(target["webSocketDebuggerUrl"])
    if created is not None:
        while evaluate(ws, "document.readyState") != "complete" or (
                req["new"] != "about:blank" and evaluate(ws, "location.href") == "about:blank"):
            if time.monotonic() > deadline:
                fail("%s did not finish loading within %s s" % (req["new"], req["wait_s"]))
            time.sleep(0.2)
    out = {"url": evaluate(ws, "location.href"), "title": evaluate(ws, "document.title")}
    if req.get("expression"):
        out["value"] = evaluate(ws, req["expression"])
    if req.get("pdf"):
        with open(req["pdf"], "wb") as f:
            f.write(base64.b64decode(ws.send("Page.printToPDF", {})["data"]))
        out["pdf"] = req["pdf"]
    print(json.dumps(out))
finally:
    if created is not None:
        try:
            call(port, "/json/close/" + created["id"])
        except Exception:
            pass
'''


class CdpError(Exception):
    """The page could not be read: ``kind`` is ``no_browser`` (no DevTools endpoint answered), ``no_tab`` (no
    open tab at the URL), ``needs_network`` (a website the desktop cannot reach) or ``failed`` (anything else,
    the message says what)."""

    def __init__(self, message: str, kind: str = "failed") -> None:
        super().__init__(message)
        self.kind = kind


async def cdp_page(c: ControllerClient, *, tab: str | None = None, new: str | None = None, expression: str = "",
                   pdf: str = "", wait_s: float = 60.0) -> dict[str, Any]:
    """Run :data:`CDP_SCRIPT` in the desktop on one page: the open ``tab`` at that URL, or a ``new`` tab loading
    that URL (closed afterwards). Exactly one of ``tab``/``new``.

    Args:
        expression: JavaScript evaluated in the page (its JSON-able value is returned as ``value``).
        pdf: a path in the desktop to print the page to (``Page.printToPDF``, Chromium's defaults: Letter,
            portrait, no background graphics, as playwright's ``page.pdf()``).
        wait_s: seconds for the endpoint to answer, the page to load and each reply.
    Returns: ``{"url", "title"}`` of the page, plus ``value`` and ``pdf`` when asked for.
    Raises: CdpError (see its kinds); DesktopError when the desktop is gone.
    """
    if (tab is None) == (new is None):
        raise ValueError("cdp_page: give exactly one of tab, new")
    req = {"ports": list(DEVTOOLS_PORTS), "wait_s": wait_s, "expression": expression, "pdf": pdf,
           **({"tab": tab} if tab is not None else {"new": new})}
    r = await c.execute(["python3", "-c", CDP_SCRIPT, json.dumps(req)], timeout=wait_s + 60)
    lines = (r.get("output") or "").strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
    except ValueError:
        answer = None
    if r["status"] != "success" or r.get("returncode") != 0 or not isinstance(answer, dict) or "error" in answer:
        if isinstance(answer, dict) and "error" in answer:
            raise CdpError(f"chrome page: {answer['error']}", answer.get("kind", "failed"))
        why = (r.get("error") or r.get("message") or "").strip()[-500:]
        raise CdpError(f"chrome page: the in-desktop script failed: {why or lines[-1:] or 'no output'}")
    return answer
