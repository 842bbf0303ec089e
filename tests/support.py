"""Helpers shared by the integration tests: free ports, the real arpo-serve as a child process, the containers
a run left, and polling with a deadline."""

from __future__ import annotations

import asyncio
import contextlib
import html.parser
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiodocker
import msgpack
import numpy as np
import pytest

from arpo_async import codec
from arpo_async.messages import Step, Trajectory

_HANDED_OUT: set[int] = set()


def osworld_examples() -> Path | None:
    """OSWorld's task files, ``evaluation_examples/examples`` of a clone of github.com/xlang-ai/OSWorld, named by
    $OSWORLD_EXAMPLES; None when unset or not a folder (the tests that read them skip)."""
    folder = os.environ.get("OSWORLD_EXAMPLES")
    return Path(folder) if folder and Path(folder).is_dir() else None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago and that this test process has not handed out before
    (the kernel may give a just-released port again, and two servers of one test would then collide)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


class ServeProcess:
    """The real arpo-serve (`python -m arpo_serve.main`) as a child process on a fixed port.

    ``start`` returns once it printed its ready line and raises RuntimeError (naming the log folder) when it exits
    or is not ready within ``start_timeout_s``; ``stop`` sends SIGTERM (SIGKILL after 30 s). ``starts`` counts
    starts; each writes its stderr to ``<log_dir>/serve-<port>-<n>.log`` (`log_path`). ``args``: more flags.
    """

    def __init__(self, model: Path, port: int, log_dir: Path, *, start_timeout_s: float = 180.0,
                 args: tuple[str, ...] = ()) -> None:
        self.model, self.port, self.log_dir, self.args = model, port, log_dir, args
        self.start_timeout_s = start_timeout_s
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "arpo_serve.main", "--model", str(self.model), "--port", str(self.port),
                 *self.args],
                stdout=subprocess.PIPE, stderr=log, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        ready, seen = read_until(self.proc, b"arpo-serve ready", self.start_timeout_s)
        if not ready:
            self.stop()
            raise RuntimeError(f"arpo-serve did not become ready (logs in {self.log_dir}); stdout: {seen!r}")

    @property
    def log_path(self) -> Path:
        """The stderr log of the latest start."""
        return self.log_dir / f"serve-{self.port}-{self.starts}.log"

    def stop(self) -> None:
        if self.proc is None:
            return
        stop_process(self.proc, 30.0)
        self.proc = None


def read_until(proc: subprocess.Popen, marker: bytes, timeout_s: float) -> tuple[bool, bytes]:
    """Read ``proc``'s stdout pipe until ``marker`` appears; returns (found, what was read). Not found when the
    process exits or ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    seen = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while marker not in seen:
            left = deadline - time.monotonic()
            if left <= 0 or proc.poll() is not None:
                return False, seen
            if sel.select(timeout=left):
                seen += os.read(proc.stdout.fileno(), 4096)
    return True, seen


def stop_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM ``proc``, SIGKILL it after ``timeout_s``, wait for it and close its stdout pipe."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)
    if proc.stdout is not None:
        proc.stdout.close()


async def labelled(run_id: str) -> list[str]:
    """Ids of every container (running or not) labelled with ``run_id``."""
    async with aiodocker.Docker() as docker:
        found = await docker.containers.list(all="true", filters=json.dumps({"label": [f"arpo.run={run_id}"]}))
    return [c.id for c in found]


async def until(predicate, timeout: float = 5.0, what: str = "the condition", *, ok=bool, every_s: float = 0.05):
    """Call ``predicate`` (sync or async) every ``every_s`` seconds until ``ok(value)`` holds for its value; returns
    that value. Fails naming ``what`` (and the last value, when not a bool) at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if ok(value):
            return value
        if time.monotonic() > deadline:
            _timed_out(timeout, what, value)
        await asyncio.sleep(every_s)


async def cancelled(tasks) -> None:
    """Cancel ``tasks`` and wait until every one has ended (their exceptions, the cancellation included, are
    swallowed: a test's cleanup)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def until_sync(predicate, timeout: float, what: str, *, check=lambda: None, every_s: float = 0.2):
    """:func:`until` for tests that are not async: call ``predicate`` every ``every_s`` seconds until its value is
    truthy and return it; ``check()`` runs after each miss (it raises to fail early, e.g. when a child died)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        check()
        if time.monotonic() > deadline:
            _timed_out(timeout, what, value)
        time.sleep(every_s)


def _timed_out(timeout: float, what: str, value: object) -> None:
    last = "" if isinstance(value, bool) else f"; last value {value!r:.500}"
    pytest.fail(f"timed out after {timeout:g} s waiting for {what}{last}")


@contextlib.asynccontextmanager
async def local_http_server(routes: dict):
    """Serve ``{path: async handler}`` (aiohttp GET routes) on 127.0.0.1 at a free port; yields the port and
    stops the server on exit."""
    from aiohttp import web

    app = web.Application()
    for path, handler in routes.items():
        app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def catch_all_http_server(handler, *, max_body: int = 1 << 28):
    """Serve every method and path with ``handler`` (an aiohttp handler) on 127.0.0.1 at a free port; yields the
    base URL and stops the server on exit. For peers that record or misbehave on purpose."""
    from aiohttp import web

    app = web.Application(client_max_size=max_body)
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


class Elements(html.parser.HTMLParser):
    """Counts start tags and classes; collects img sources and the text."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: dict[str, int] = {}
        self.classes: dict[str, int] = {}
        self.images: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags[tag] = self.tags.get(tag, 0) + 1
        attrs = dict(attrs)
        for name in (attrs.get("class") or "").split():
            self.classes[name] = self.classes.get(name, 0) + 1
        if tag == "img":
            self.images.append(attrs["src"])

    def handle_data(self, data):
        self.text.append(data)


def parse_html(page: str) -> Elements:
    """Parse an HTML page into an :class:`Elements` count."""
    parser = Elements()
    parser.feed(page)
    return parser


def healthy(url: str) -> bool:
    """Whether the HTTP server at ``url`` (arpo-serve, SGLang) answers ``GET /health`` with 200 within 2 s."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


async def trained(service, step: int, version: int) -> None:
    """What the training loop's last stage does after a batch (learner.train.loop.TrainingLoop.train): the run
    state now holds ``step`` optimizer steps and policy ``version``; the service is told
    (learner.rollouts.rounds.RoundControl.on_trained: evaluation rounds, the version announced, more work admitted)."""
    service.state.step, service.state.published_version = step, version
    await service.control.on_trained()


def loop_counters(service, replay=None) -> dict:
    """The counters the training loop hands learner.train.records.step_record: the service's, plus the replay
    buffer's statistics (``replay``; an empty ARPO buffer's when None)."""
    from learner.algo.replay import SuccessReplay

    return {**service.report.counters(), "replay": (replay if replay is not None else SuccessReplay()).stats()}


ADVANTAGE_LOG_ENV = "ARPO_TEST_ADVANTAGE_LOG"
"""The file :func:`recording_advantages` appends its calls to (an environment variable, so a learner process that
imports it by ``learner.advantage_function`` finds it)."""


def recording_advantages(rewards, task_id: str):
    """A custom advantage function (learner.advantage_function = "tests.support:recording_advantages"): Dr. GRPO's
    mean-centred rewards, each call appended as a JSON line ``{"task_id", "rewards"}`` to the file named by
    ``$ARPO_TEST_ADVANTAGE_LOG`` (when set)."""
    path = os.environ.get(ADVANTAGE_LOG_ENV)
    if path:
        with open(path, "a") as log:
            log.write(json.dumps({"task_id": task_id, "rewards": [float(r) for r in rewards]}) + "\n")
    return rewards - rewards.mean()


def huge_table(rows: int) -> list[bytes]:
    """A trajectory whose steps table claims ``rows`` rows, each column filled to match: the shape of the 88 MB,
    4-million-row message that held a learner's event loop for 43 s (issue 39 item 7)."""
    step = Step([1], [], [2], [-0.1], [0], "t", "a")
    frames = codec.encode(Trajectory("t", "a", "k", "g", 0, "FAILURE", 0.0, True, [step], []))
    header = msgpack.unpackb(frames[0], raw=False, ext_hook=msgpack.ExtType)
    _, columns = header["body"]["steps"]
    for name, column in columns.items():
        if isinstance(column, list) and len(column) == 2 and isinstance(column[1], msgpack.ExtType):
            columns[name] = [msgpack.ExtType(column[0].code, b""),
                             msgpack.ExtType(column[1].code, np.zeros(rows, "<i4").tobytes())]
        else:
            columns[name] = [column[0]] * rows
    header["body"]["steps"] = [rows, columns]
    return [msgpack.packb(header, use_bin_type=True)]


async def start_http(app) -> tuple:
    """Serve the aiohttp ``app`` on 127.0.0.1 at a free port; returns (its AppRunner, to ``cleanup()``, and the
    base URL ``http://127.0.0.1:PORT``)."""
    from aiohttp import web

    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"



async def hello(service, peer: str, slots: int, key: str = "") -> str:
    """Say Hello to an in-process LearnerService as routing id ``peer`` (CURVE key ``key``), opening a new session
    (learner.rollouts.sessions); returns it. The learner's answer stays in the outbox."""
    import secrets

    from arpo_async.messages import Hello
    from arpo_async.transport import Envelope

    session = secrets.token_urlsafe(16)
    await service.handle(Envelope(Hello(peer, slots, session=session), peer, key))
    assert service.peers.sessions.latest(peer) == session, f"the learner did not open {peer}'s session"
    return session


async def hello_over(sock, actor_id: str, slots: int, run_id: str = "", timeout_s: float = 5.0) -> str:
    """Say Hello over a raw DEALER ``sock`` with a new session, wait for the learner's answer (messages that arrive
    first are read and dropped) and return the session."""
    import secrets

    from arpo_async.messages import Hello, LearnerStatus

    session = secrets.token_urlsafe(16)
    await sock.send_multipart(codec.encode(Hello(actor_id, slots, run_id=run_id, session=session)))
    async with asyncio.timeout(timeout_s):
        while not isinstance(codec.decode(await sock.recv_multipart(), max_bytes=1 << 24), LearnerStatus):
            pass
    return session


def processes_mentioning(*texts: str) -> list[int]:
    """PIDs of live processes (this one excepted) whose command line contains every one of ``texts``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if all(text in cmdline for text in texts):
                pids.append(int(entry.name))
    return pids
