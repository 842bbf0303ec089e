"""Running commands inside the desktop for the controller: to completion with bounded output, or detached.

Owns: OSWorld's command normalisation (a string without shell is shlex-split, "~/" arguments expanded; OSWorld
desktop_env/server/main.py, route /execute), bounded capture of stdout and stderr, killing a timed-out command's
whole process group, and the OOM priority of every command (oom_score_adj 1000). Standard library only.
"""
from __future__ import annotations

import os
import selectors
import shlex
import signal
import subprocess
import time

from limits import MAX_OUTPUT_BYTES

EXECUTE_DRAIN_S = 5.0  # after killing a timed-out command: how long to wait for its pipes to close


def _normalise_command(command, shell: bool):
    """OSWorld's rules: a string without shell is shlex-split; '~/' arguments are expanded."""
    if command is None:
        command = "" if shell else []
    if isinstance(command, str) and not shell:
        command = shlex.split(command)
    if isinstance(command, list):
        command = [os.path.expanduser(a) if isinstance(a, str) and a.startswith("~/") else a for a in command]
    return command


def deprioritise(pid: int) -> None:
    """oom_score_adj 1000 for a command (its children inherit it): when the container runs out of memory the
    kernel kills commands first, never the controller, Xvfb or openbox (raising needs no capability)."""
    try:
        with open(f"/proc/{pid}/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass  # it already exited


def _capture(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytearray, bytearray, int, int, bool]:
    """Read the command's stdout and stderr until both close or ``deadline`` (monotonic) passes, keeping the
    first ``cap`` bytes of each and dropping the rest (still read, so the command never blocks on a full pipe).
    Returns (out, err, bytes written to stdout, to stderr, whether the deadline passed first)."""
    pipes = [p for p in (proc.stdout, proc.stderr) if p is not None]  # stderr is None when merged into stdout
    kept = {p: bytearray() for p in pipes}
    total = {p: 0 for p in pipes}
    timed_out = False
    with selectors.DefaultSelector() as sel:
        for pipe in pipes:
            sel.register(pipe, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(left):
                chunk = os.read(key.fileobj.fileno(), 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                total[key.fileobj] += len(chunk)
                room = cap - len(kept[key.fileobj])
                if room > 0:
                    kept[key.fileobj] += chunk[:room]
    return (kept[proc.stdout], kept.get(proc.stderr, bytearray()), total[proc.stdout], total.get(proc.stderr, 0),
            timed_out)


def run_command(command, shell: bool, timeout: float, cap: int | None = None, *, cwd: str | None = None,
                merge_stderr: bool = False) -> tuple[int, dict]:
    """Run to completion in its own session; on timeout kill the whole process group.

    Returns (HTTP status, OSWorld's /execute answer): 200 {"status": "success", "output", "error", "returncode"},
    or 500 {"status": "error", "message", ...} when the command cannot start (returncode -1) or timed out
    (returncode -9). Keeps at most ``cap`` bytes (default MAX_OUTPUT_BYTES) of stdout and of stderr; a response
    that lost bytes says so with "truncated": true and the full sizes in "output_bytes" and "error_bytes".
    ``cwd``: the working folder; ``merge_stderr``: stderr goes into "output" (as /run_bash_script's) and "error"
    is empty.
    """
    cap = MAX_OUTPUT_BYTES if cap is None else cap
    command = _normalise_command(command, shell)
    try:
        proc = subprocess.Popen(command, shell=shell, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=cwd)
    except Exception as exc:  # noqa: BLE001 - reported to the caller in OSWorld's error shape
        return 500, {"status": "error", "message": str(exc), "output": "", "error": str(exc), "returncode": -1}
    deprioritise(proc.pid)
    try:
        deadline = time.monotonic() + timeout
        out, err, n_out, n_err, timed_out = _capture(proc, deadline, cap)
        if not timed_out:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # the pipes closed but the command runs on
                timed_out = True
        if timed_out:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            # what the group wrote before it died; a process that left the group may hold the pipes: stop then
            o2, e2, m_out, m_err, _ = _capture(proc, time.monotonic() + EXECUTE_DRAIN_S, cap)
            out, err = (out + o2)[:cap], (err + e2)[:cap]
            n_out, n_err = n_out + m_out, n_err + m_err
            try:
                proc.wait(timeout=EXECUTE_DRAIN_S)
            except subprocess.TimeoutExpired:
                pass
    finally:
        proc.stdout.close()
        if proc.stderr is not None:
            proc.stderr.close()
    extra = {}
    if n_out > len(out) or n_err > len(err):
        extra = {"truncated": True, "output_bytes": n_out, "error_bytes": n_err}
    if timed_out:
        msg = f"command timed out after {timeout:g} s"
        return 500, {"status": "error", "message": msg, "output": out.decode("utf-8", "replace"),
                     "error": err.decode("utf-8", "replace") + msg, "returncode": -9, **extra}
    return 200, {"status": "success", "output": out.decode("utf-8", "replace"),
                 "error": err.decode("utf-8", "replace"), "returncode": proc.returncode, **extra}


def launch(command, shell: bool) -> subprocess.Popen:
    """Start ``command`` detached (own session, no pipes) and return it without waiting; OSError when it cannot
    start (e.g. no such program)."""
    command = _normalise_command(command, shell)
    proc = subprocess.Popen(command, shell=shell, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deprioritise(proc.pid)
    return proc
