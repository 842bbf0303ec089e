"""One arpo process on a cluster node: the body of the Ray actor `arpo launch` places for it.

Role: start one command (arpo-serve, SGLang, a learner rank, arpo-actors) as a child of the Ray worker on its node,
keep its stdout+stderr in a node-local log the driver reads in pieces (:meth:`ProcessHost.read_log`), report its
exit, and stop it (SIGTERM to its process group, SIGKILL after a grace period).
Invariants: the child dies with the Ray worker (``PR_SET_PDEATHSIG`` = SIGTERM, so arpo-actors still remove their
desktops when Ray kills the worker or its node leaves); with ``restart_on_failure`` a child that exits non-zero
without being asked to stop takes the worker down with it (``os._exit``), so Ray restarts the actor
(``max_restarts``) and the restarted actor starts the command again, appending to the same log.
This module imports no Ray: arpo_cli.cluster wraps the class with ``ray.remote``, so it is tested as plain Python.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

LOG_CHUNK_BYTES = 1 << 20
""":meth:`ProcessHost.read_log` returns at most this many bytes per call."""
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM this process when the thread that started it dies (Linux prctl)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def free_port() -> int:
    """A TCP port free on this node now (the kernel's pick for port 0)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class ProcessHost:
    """Runs ``args`` (with ``env`` added to the worker's environment) as a child process logging to
    ``<log_dir>/<name>.log`` on this node.

    Args:
        name: the process's name in logs and messages, e.g. "actors-node2" (a file name).
        args: the command; in each argument ``{config}`` becomes the path of ``config_text`` written to
            ``<log_dir>/<name>.toml``, ``{python}`` this worker's interpreter and ``{worker_pid}`` this worker's pid
            (new after each restart, so a restarted arpo-actors gets a fresh actor id).
        config_text: the run file the command reads (TOML).
        env: variables added to the child's environment (RANK, MASTER_ADDR, ...).
        log_dir: a node-local folder (created).
        start: start the child now; False waits for :meth:`start` (learner ranks first report their GPUs).
        restart_on_failure: a non-zero exit not asked for by :meth:`stop` ends this worker (``os._exit(1)``) so
            Ray restarts the actor, which starts the command again.
    """

    def __init__(self, name: str, args: list[str], config_text: str, env: dict[str, str], log_dir: str, *,
                 start: bool = True, restart_on_failure: bool = False) -> None:
        self.name = name
        self.folder = Path(log_dir)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.log_path = self.folder / f"{name}.log"
        config_path = self.folder / f"{name}.toml"
        config_path.write_text(config_text)
        values = {"{config}": str(config_path), "{python}": sys.executable, "{worker_pid}": str(os.getpid())}
        self.args = [functools.reduce(lambda text, kv: text.replace(*kv), values.items(), a) for a in args]
        self.env = dict(env)
        self.restart_on_failure = restart_on_failure
        self._proc: subprocess.Popen | None = None
        self._stopping = threading.Event()
        self._started = threading.Event()
        if start:
            self.start()

    def start(self, env: dict[str, str] | None = None) -> int:
        """Start the child (``env`` adds to the environment given at construction); returns its pid.

        Raises:
            RuntimeError: it was started already.
        """
        if self._proc is not None:
            raise RuntimeError(f"{self.name} was started already (pid {self._proc.pid})")
        with self.log_path.open("ab") as log:
            log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {self.name} on {socket.gethostname()}: "
                      f"{' '.join(self.args)}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env={**os.environ, **self.env, **(env or {})}, start_new_session=True,
                                          preexec_fn=_die_with_parent)
        self._started.set()
        threading.Thread(target=self._watch, name=f"watch-{self.name}", daemon=True).start()
        return self._proc.pid

    def _watch(self) -> None:
        code = self._proc.wait()
        if code != 0 and self.restart_on_failure and not self._stopping.is_set():
            with self.log_path.open("ab") as log:
                log.write(f"=== {self.name} exited with {code}; restarting it\n".encode())
            os._exit(1)  # noqa: SLF001 -- the worker's death is what makes Ray restart the actor

    def node(self) -> dict[str, object]:
        """Where this runs: ``{"pid": the child's pid or None, "gpus": the GPU ids Ray gave this actor
        (CUDA_VISIBLE_DEVICES), "hostname"}``."""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        return {"pid": self._proc.pid if self._proc else None, "hostname": socket.gethostname(),
                "gpus": [g for g in visible.split(",") if g]}

    def free_port(self) -> int:
        """A TCP port free on this node (for MASTER_PORT on the rank-0 node)."""
        return free_port()

    def read_log(self, offset: int) -> tuple[bytes, int]:
        """The log's bytes from ``offset`` (at most LOG_CHUNK_BYTES) and the offset after them."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(offset)
                data = log.read(LOG_CHUNK_BYTES)
        except OSError:
            return b"", offset
        return data, offset + len(data)

    def wait(self) -> int:
        """Block until the child exits; its exit code (negative: killed by that signal)."""
        self._started.wait()
        return self._proc.wait()

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM the child's process group, wait up to ``grace_s`` seconds, then SIGKILL it; the exit code (None
        when it never started)."""
        self._stopping.set()
        if self._proc is None:
            return None
        for signum in (signal.SIGTERM, signal.SIGKILL):
            if self._proc.poll() is not None:
                break
            try:
                os.killpg(self._proc.pid, signum)
            except ProcessLookupError:
                break
            try:
                self._proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                continue
        return self._proc.wait()
