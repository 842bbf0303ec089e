"""Chromium's tabs through its DevTools HTTP endpoint, from inside the desktop.

OSWorld drives Chrome over CDP with playwright from the host (desktop_env/controllers/setup.py
``_chrome_open_tabs_setup`` / ``_chrome_close_tabs_setup``, getters/chrome.py ``get_open_tabs_info``), reaching the
browser's ``--remote-debugging-port`` (tasks launch ``google-chrome --remote-debugging-port=1337`` and forward
9222 to it with socat). Our desktops have no network and the host cannot reach the port, so
:data:`TABS_SCRIPT` runs inside the desktop (Debian's python3, standard library only; through the controller's
/execute) and uses the endpoint's plain HTTP routes: ``GET /json/list``, ``PUT /json/new?URL``,
``GET /json/close/ID``. No websocket is needed for opening, closing and listing tabs.

Semantics: ``open`` first checks that every http(s) URL's host accepts a TCP connection from inside the desktop
(OSWorld's playwright ``goto`` would load the page; a container has no network, so a website cannot load and the
task cannot be what its author set up): an unreachable non-loopback host fails with kind ``needs_network``, an
unreachable loopback one (nothing listens) with ``setup_failed``. It then opens each URL in a new tab and, after
the first, closes the tabs that were open before
(OSWorld closes the context's first page, the browser's start tab); ``close`` closes, for each URL, the first
tab whose URL matches (scheme, ``www.`` and a trailing slash ignored, as OSWorld's compare_urls does);
``list`` returns ``[{"title", "url"}]`` of the open tabs, most recently active first. The script waits up to
``wait_s`` (default 60) for the endpoint to answer, as OSWorld retries its connection 15 times.
"""
from __future__ import annotations

import json
from typing import Any

from actors.desktop.controller_client import ControllerClient

CHROME_DIRS = ("~/.config/google-chrome", "~/.config/chromium")
"""The browser's user-data folders: OSWorld's (Google Chrome), then Debian Chromium's (the osworld image's
google-chrome runs Chromium)."""
DEVTOOLS_PORTS = (9222, 1337)
"""Ports tried in order: OSWorld's forwarded port, then the port its tasks launch Chrome with."""

UNREACHABLE_FN = r'''
def unreachable(u):
    p = urllib.parse.urlsplit(u)
    if p.scheme not in ("http", "https") or not p.hostname:
        return None
    try:
        socket.create_connection((p.hostname, p.port or (443 if p.scheme == "https" else 80)), timeout=5).close()
        return None
    except (OSError, ValueError) as exc:
        try:
            local = ipaddress.ip_address(p.hostname).is_loopback
        except ValueError:
            local = p.hostname == "localhost"
        return ("setup_failed" if local else "needs_network", "%s: %s" % (u, exc))
'''
"""In-desktop Python (standard library only): ``unreachable(url)`` is None when a TCP connection to the URL's host
opens within 5 s, else (kind, "url: reason"), kind ``needs_network`` for another host and ``setup_failed`` for
the desktop's own (nothing listens there). Part of :data:`TABS_SCRIPT` and ``actors.osworld.cdp.CDP_SCRIPT``."""

TABS_SCRIPT = r'''
import ipaddress, json, socket, sys, time, urllib.parse, urllib.request
req = json.loads(sys.argv[1])
''' + UNREACHABLE_FN + r'''def call(port, path, method="GET"):
    r = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    with urllib.request.urlopen(r, timeout=10) as resp:
        body = resp.read()
    return json.loads(body) if body.strip().startswith((b"[", b"{")) else body.decode()
def norm(u):
    p = urllib.parse.urlsplit(u)
    host = p.netloc.lower()
    host = host[4:] if host.startswith("www.") else host
    return host + p.path.rstrip("/") + ("?" + p.query if p.query else "")
deadline = time.monotonic() + req.get("wait_s", 60)
port = None
while port is None:
    for p in req["ports"]:
        try:
            call(p, "/json/version")
            port = p
            break
        except Exception:
            pass
    if port is None:
        if time.monotonic() > deadline:
            print(json.dumps({"error": "no Chrome DevTools endpoint on ports %s" % req["ports"]}))
            sys.exit(3)
        time.sleep(0.5)
pages = lambda: [t for t in call(port, "/json/list") if t.get("type") == "page"]
if req["op"] == "list":
    print(json.dumps([{"title": t.get("title", ""), "url": t.get("url", "")} for t in pages()]))
elif req["op"] == "open":
    bad = [b for b in map(unreachable, req["urls"]) if b]
    if bad:
        kind = "needs_network" if any(k == "needs_network" for k, _ in bad) else "setup_failed"
        print(json.dumps({"error": "cannot be reached from the desktop: " + "; ".join(m for _, m in bad),
                          "kind": kind}))
        sys.exit(4)
    before = [t["id"] for t in pages()]
    for i, url in enumerate(req["urls"]):
        call(port, "/json/new?" + urllib.parse.quote(url, safe=""), "PUT")
        if i == 0:
            for tid in before:
                call(port, "/json/close/" + tid)
    print(json.dumps({"opened": len(req["urls"])}))
elif req["op"] == "close":
    closed = 0
    for url in req["urls"]:
        for t in pages():
            if norm(t.get("url", "")) == norm(url):
                call(port, "/json/close/" + t["id"])
                closed += 1
                break
    print(json.dumps({"closed": closed}))
'''


class ChromeTabsError(Exception):
    """The DevTools endpoint did not answer in time, a URL to open cannot be reached, or the script failed; the
    message has the reason and ``kind`` is ``needs_network`` (a website, unreachable without network) or
    ``setup_failed``."""

    def __init__(self, message: str, kind: str = "setup_failed") -> None:
        super().__init__(message)
        self.kind = kind


async def chrome_tabs(c: ControllerClient, op: str, urls: list[str] | None = None, *, wait_s: float = 60.0) -> Any:
    """Run :data:`TABS_SCRIPT` in the desktop: ``op`` is ``open``/``close`` (with ``urls``) or ``list``.

    Returns the script's JSON answer (for ``list``: ``[{"title", "url"}, ...]``). Raises ChromeTabsError when no
    DevTools endpoint answers within ``wait_s`` seconds, a URL to open cannot be reached (kind needs_network for a
    website) or the script fails; DesktopError when the desktop is gone.
    """
    arg = json.dumps({"op": op, "urls": urls or [], "ports": list(DEVTOOLS_PORTS), "wait_s": wait_s})
    r = await c.execute(["python3", "-c", TABS_SCRIPT, arg], timeout=wait_s + 60)
    out = (r.get("output") or "").strip().splitlines()
    if r["status"] != "success" or r["returncode"] != 0 or not out:
        detail, kind = out[-1] if out else (r.get("error") or r.get("message") or "")[-500:], "setup_failed"
        try:
            answer = json.loads(detail)
            detail, kind = answer["error"], answer.get("kind", kind)
        except (ValueError, KeyError, TypeError):
            pass
        raise ChromeTabsError(f"chrome {op}: {detail}", kind)
    return json.loads(out[-1])
