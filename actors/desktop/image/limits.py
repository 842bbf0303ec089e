"""Limits of the in-container controller, read from the environment once at start, and what enforces them.

Owns: the size limits (ARPO_MAX_*_MB, see server.py's docstring), the shared memory :class:`Budget` every
request reserves from, :class:`HTTPError` (a refusal answered as JSON), and :func:`read_regular_file` (the
bounded reader behind /file, /wallpaper and /end_recording). Standard library only: runs inside the desktop
with Debian's python3.
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
import time

DISPLAY = os.environ.get("DISPLAY", ":0")
SOCKET_PATH = os.environ.get("ARPO_CONTROLLER_SOCKET", "/run/arpo/controller.sock")
DEFAULT_TIMEOUT_S = 120.0
MIB = 1024 * 1024


def _env_mib(name: str, default: float) -> int:
    """A size limit in bytes from the environment variable ``name`` (MiB, > 0, fractions allowed)."""
    raw = os.environ.get(name, "").strip()
    try:
        mib = float(raw) if raw else default
    except ValueError:
        raise SystemExit(f"controller: {name}={raw!r} is not a number of MiB") from None
    if not mib > 0 or mib != mib or mib == float("inf"):
        raise SystemExit(f"controller: {name}={raw!r} must be a positive number of MiB")
    return max(1, int(mib * MIB))


MAX_BODY_BYTES = _env_mib("ARPO_MAX_BODY_MB", 64)
MAX_JSON_BYTES = min(_env_mib("ARPO_MAX_JSON_MB", 1), MAX_BODY_BYTES)
MAX_FILE_BYTES = _env_mib("ARPO_MAX_FILE_MB", 64)
MAX_OUTPUT_BYTES = _env_mib("ARPO_MAX_OUTPUT_MB", 1)
BUDGET_BYTES = 2 * max(MAX_BODY_BYTES, MAX_FILE_BYTES)
"""Bytes all requests together may hold at once (bodies, files read, /execute answers): see Budget."""
BUDGET_WAIT_S = 30.0
JSON_EXPANSION = 32  # a JSON body of n bytes may parse into ~30 n bytes of Python objects ([{},{},...])
BODY_EXPANSION = 2  # a multipart body is held twice: the body and its fields' bytes (forms.py)
ANSWER_EXPANSION = 16  # /execute: n captured bytes -> str (<= 4 n) + JSON (<= 6 n, \ufffd escapes) + its bytes
IO_TIMEOUT_S = 120.0  # a connection idle (or a body stalled) this long is closed
HEADER_TIMEOUT_S = 10.0  # a connection that has not sent its request line and headers within this is closed
MAX_CONNECTIONS = int(os.environ.get("ARPO_MAX_CONNECTIONS", "64"))
"""Connections served at once (each is a thread, and threads count against the container's process limit,
actors.desktop_pids = 256 by default); more wait in the listen backlog until one ends."""
DRAIN_MAX_BYTES = 256 * MIB  # a refused body up to this size is read and dropped, so the client sees the answer

class Budget:
    """Bytes of memory requests may hold at once. :meth:`hold` reserves a request's worst case (clamped to the
    whole budget, so any single request can run alone) and waits while others hold too much: at most ``wait_s``,
    then HTTPError 503."""

    def __init__(self, capacity: int, wait_s: float = BUDGET_WAIT_S) -> None:
        self.capacity = capacity
        self.wait_s = wait_s
        self.held = 0
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def hold(self, n: int):
        n = max(0, min(int(n), self.capacity))
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            while self.held + n > self.capacity:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise HTTPError(503, f"controller busy: {self.held} of {self.capacity} bytes of its memory "
                                         f"budget are held by other requests; try again")
                self._cond.wait(left)
            self.held += n
        try:
            yield
        finally:
            with self._cond:
                self.held -= n
                self._cond.notify_all()


class HTTPError(Exception):
    """A request refused with ``status`` (4xx/5xx) and a message; answered as JSON, ``extra`` merged in."""

    def __init__(self, status: int, message: str, **extra) -> None:
        super().__init__(message)
        self.status = status
        self.extra = extra


budget = Budget(BUDGET_BYTES)
"""The controller's one budget, shared by all requests."""


def read_regular_file(path: str, cap: int) -> bytearray:
    """The bytes of the regular file at ``path`` (symlinks followed). HTTPError 404 when it does not exist or
    is a folder, 400 when it is anything but a regular file (opened without blocking: a FIFO never stalls us),
    413 when it holds more than ``cap`` bytes (checked before reading and again while reading)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise HTTPError(404, f"no such file: {path}", error="File not found") from None
    except OSError as exc:
        if exc.errno in (errno.ENXIO, errno.EOPNOTSUPP):  # a Unix socket
            raise HTTPError(400, f"not a regular file: {path} (a socket)", error="Not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise HTTPError(404, f"{path} is a folder, not a file", error="File not found")
        if not stat.S_ISREG(st.st_mode):
            kind = ("a character device" if stat.S_ISCHR(st.st_mode) else "a block device"
                    if stat.S_ISBLK(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                    else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
            raise HTTPError(400, f"not a regular file: {path} ({kind}); /file serves regular files only",
                            error="Not a regular file")
    except BaseException:
        os.close(fd)
        raise
    with open(fd, "rb", buffering=0) as f:
        too_big = HTTPError(413, f"{path} is larger than the controller's limit of {cap} bytes (ARPO_MAX_FILE_MB)",
                            error="File too large")
        if st.st_size > cap:
            raise too_big
        # st_size is 0 for /proc files and a file may grow while we read: read in chunks up to the cap
        data = bytearray()
        while True:
            chunk = f.read(min(1024 * 1024, cap + 1 - len(data)))
            if not chunk:
                return data
            data += chunk
            if len(data) > cap:
                raise too_big

