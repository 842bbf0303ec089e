"""In-place reset (ours; OSWorld reverts a VM snapshot instead): the desktop's boot state and POST /reset.

At start the controller records (:class:`BootState`) the desktop's base processes (every process alive then:
PID 1, itself, Xvfb, openbox, the session D-Bus and the AT-SPI bus) and every path under /root and /tmp, with
the bytes of /root's files. :meth:`BootState.reset` kills every other process (apps, terminals and their
children), deletes the paths that did not exist at start, rewrites /root's files that changed, releases
modifier keys and mouse buttons and puts the pointer back where it was; a screen recording is stopped (the
``before_reset`` hook) and its file deleted. It kills every process outside the base set, commands of other
requests still running included, so call it only on a desktop no episode is using (DesktopPool resets released
desktops). State outside /root and /tmp (a file an agent wrote to /etc, say) is not restored: the pool bounds
how many episodes a container serves (actors.desktop_max_episodes).

Owns: the boot snapshot (pids, paths, file bytes and permission bits). Invariants: the snapshot is taken before
the first request is served; the desktop runs with no capability but CAP_SETGID (actors/desktop/fleet.py), so
root in here cannot override file modes: reset restores boot modes and opens up folders before deleting or
rewriting in them. PID 1 is docker's init (tini), which reaps orphans; reset reaps the controller's own zombies.
"""
from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Callable

from screen import pointer

RESET_ROOTS = ("/root", "/tmp")
"""Folders put back to their state at controller start by /reset."""
RESTORED_FILE_MAX_BYTES = 1024 * 1024
"""Files under /root up to this size have their bytes recorded at start and rewritten by /reset."""
RESET_KILL_DEADLINE_S = 5.0
_MODIFIERS = ["Shift_L", "Shift_R", "Control_L", "Control_R", "Alt_L", "Alt_R", "Super_L", "Super_R"]


def _pids() -> set[int]:
    return {int(name) for name in os.listdir("/proc") if name.isdigit()}


def _parent_and_state(pid: int) -> tuple[int, str] | None:
    """(parent pid, state letter) of a process from /proc/<pid>/stat; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
    return int(fields[1]), fields[0]


class BootState:
    """The desktop as the controller found it at start: base processes, paths, and /root's file bytes.

    Must be created before the first request is served: then the only processes are the base ones entrypoint.sh
    started (PID 1, the controller, Xvfb, openbox, and where installed the session D-Bus and the AT-SPI bus),
    and no task has touched /root or /tmp. Every process alive then is a base process.
    """

    def __init__(self, before_reset: Callable[[], None]) -> None:
        self.before_reset = before_reset  # what reset() must undo besides processes and files (a recording)
        self.pids = _pids() | {1, os.getpid()}
        self.paths: set[str] = set()
        self.home_dirs: list[str] = []  # folders under /root, parents first: recreated when an episode deleted them
        self.files: dict[str, bytes] = {}
        self.modes: dict[str, int] = {}  # permission bits of every boot folder and of the files in self.files
        for root in RESET_ROOTS:
            for folder, dirs, files in os.walk(root):
                self.paths.add(folder)
                self.modes[folder] = stat.S_IMODE(os.lstat(folder).st_mode)
                if folder.startswith("/root"):
                    self.home_dirs.append(folder)
                for name in dirs + files:
                    self.paths.add(os.path.join(folder, name))
                for name in files:
                    path = os.path.join(folder, name)
                    if folder.startswith("/root") and os.path.isfile(path) and not os.path.islink(path) \
                            and os.path.getsize(path) <= RESTORED_FILE_MAX_BYTES:
                        with open(path, "rb") as f:
                            self.files[path] = f.read()
                        self.modes[path] = stat.S_IMODE(os.lstat(path).st_mode)
        self.pointer = pointer().position()

    def reset(self) -> dict:
        """Put the desktop back to this state; returns counts and seconds. RuntimeError when a process survives."""
        t0 = time.monotonic()
        self.before_reset()  # a running screen recording stops (its file is deleted below)
        killed = self._kill_others()
        removed, restored = self._restore_files()
        x, y = self.pointer
        subprocess.run(["xdotool", "keyup", *_MODIFIERS, "mouseup", "1", "mouseup", "2", "mouseup", "3",
                        "mousemove", str(x), str(y)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=10, check=False)
        return {"status": "ok", "killed": killed, "removed": removed, "restored": restored,
                "seconds": round(time.monotonic() - t0, 4)}

    def _kill_others(self) -> int:
        """SIGKILL every process outside the base set, in rounds (a dying shell may have forked), and reap
        our own children; RuntimeError when some are still alive after RESET_KILL_DEADLINE_S."""
        killed: set[int] = set()
        deadline = time.monotonic() + RESET_KILL_DEADLINE_S
        while True:
            alive = []
            for pid in _pids() - self.pids:
                info = _parent_and_state(pid)
                if info is None:
                    continue
                if info[1] == "Z":  # a zombie: reap it if it is ours (PID 1 reaps the rest)
                    if info[0] == os.getpid():
                        try:
                            os.waitpid(pid, os.WNOHANG)
                        except ChildProcessError:
                            pass
                    continue
                alive.append(pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except ProcessLookupError:
                    pass
            if not alive:
                return len(killed)
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {sorted(alive)} survived SIGKILL for {RESET_KILL_DEADLINE_S:g} s")
            time.sleep(0.01)

    def _restore_modes(self) -> None:
        """Give boot folders and restored files their boot permission bits back (an episode may have made a
        folder unwritable: without CAP_DAC_OVERRIDE root could then not delete in it)."""
        for path, mode in self.modes.items():
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if not stat.S_ISLNK(st.st_mode) and stat.S_IMODE(st.st_mode) != mode:
                os.chmod(path, mode)

    def _restore_files(self) -> tuple[int, int]:
        """Delete paths under RESET_ROOTS that did not exist at start; rewrite /root files that changed."""
        removed = restored = 0
        self._restore_modes()
        for root in RESET_ROOTS:
            for folder, dirs, files in os.walk(root, topdown=True):
                for name in list(dirs):
                    path = os.path.join(folder, name)
                    if path not in self.paths:
                        dirs.remove(name)
                        if os.path.islink(path):
                            os.unlink(path)
                        else:
                            _rmtree(path)
                        removed += 1
                for name in files:
                    path = os.path.join(folder, name)
                    if path not in self.paths:
                        os.unlink(path)
                        removed += 1
        for folder in self.home_dirs:
            os.makedirs(folder, exist_ok=True)
        for path, data in self.files.items():
            try:
                with open(path, "rb") as f:
                    same = f.read() == data
            except OSError:
                same = False
            if not same:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                if os.path.lexists(path) and not os.path.islink(path):
                    os.chmod(path, 0o600)  # it may have been made read-only
                with open(path, "wb") as f:
                    f.write(data)
                restored += 1
        self._restore_modes()
        return removed, restored


def _rmtree(path: str) -> None:
    """Delete a folder tree. Root here has no CAP_DAC_OVERRIDE, so a folder an episode made unreadable or
    unwritable (chmod 000) would stop shutil.rmtree: on failure give every folder below its owner's rwx and
    try again; a tree that still survives makes the caller's next check (or the next reset) see it."""
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.lexists(path):
        return
    stack = [path]
    while stack:
        folder = stack.pop()
        try:
            st = os.lstat(folder)
            if not stat.S_ISDIR(st.st_mode):
                continue
            if st.st_mode & 0o700 != 0o700:
                os.chmod(folder, stat.S_IMODE(st.st_mode) | 0o700)
            with os.scandir(folder) as entries:
                stack.extend(e.path for e in entries if e.is_dir(follow_symlinks=False))
        except OSError:
            continue
    shutil.rmtree(path, ignore_errors=True)
