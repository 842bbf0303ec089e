#!/usr/bin/env python3
"""In-container desktop controller: OSWorld's controller HTTP API over a Unix socket; this module wires it.

Runs INSIDE the desktop container with Debian's python3, the standard library, PIL, python3-xlib,
python3-werkzeug (the HTTP server, requests, routing and multipart forms) and python3-pyatspi (run in a child
process, for the accessibility routes).
It owns the X display ``$DISPLAY`` (started by entrypoint.sh) and serves, on the Unix socket
``$ARPO_CONTROLLER_SOCKET`` (default /run/arpo/controller.sock, mode 0660, in a folder bind-mounted from the
host), OSWorld's ``desktop_env/server/main.py`` API as OSWorld's own PythonController and SetupController call
it. Set ARPO_CONTROLLER_TCP=host:port to listen on TCP instead (a container with a network).

Modules, one per role:

    routes.py          every route's path, method, status codes and body shapes (the API, listed there with
                       where ours departs from OSWorld's), the URL map, and the core routes' views
    osworld_routes.py  the routes OSWorld's clients call beyond the actors' core set (marked [o] in routes.py)
    server.py          HTTP on werkzeug: the threaded server and its listeners, the WSGI app's Content-Length
                       checks, body limits and budget, JSON answers and refusals
    forms.py           multipart/form-data bodies split into fields (werkzeug's decoder)
    limits.py          the size limits (ARPO_MAX_*_MB), the shared memory budget, HTTPError, bounded file reads
    reset.py           the in-place reset: the desktop's boot state and POST /reset
    screen.py          screenshots, the pointer, the screen size, whether X is up
    processes.py       running commands (/execute, /setup/launch)
    x11windows.py      windows, wmctrl's matching rules
    accessibility.py   the AT-SPI tree (run in a child process)
    recording.py       screen recording (ffmpeg)

Invariants: the boot state is taken before the first request is served (then only the base processes and the
boot files exist); every request is handled on its own thread; commands run with DISPLAY set, in their own
session (a timeout kills the whole process group) and with oom_score_adj 1000, so when they exhaust the
container's memory the kernel kills them, not the controller, Xvfb or openbox; PID 1 is docker's init (tini),
which reaps orphans. SIGTERM shuts the server down.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import osworld_routes
from limits import DISPLAY, SOCKET_PATH
from reset import BootState
from routes import url_map
from server import App, listen


def serve() -> None:
    """Record the boot state, listen, and serve until SIGTERM."""
    boot = BootState(before_reset=osworld_routes.on_reset)  # before the first request
    tcp = os.environ.get("ARPO_CONTROLLER_TCP", "")
    server = listen(App(url_map(boot)), tcp, SOCKET_PATH)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    sys.stderr.write(f"controller: serving on {tcp or SOCKET_PATH} for display {DISPLAY} "
                     f"(pid {os.getpid()}, {time.strftime('%H:%M:%S')})\n")
    server.serve_forever(poll_interval=0.5)


if __name__ == "__main__":
    serve()
