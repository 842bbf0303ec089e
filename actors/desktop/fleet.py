"""The desktop fleet: starts and removes desktop containers through the Docker API (aiodocker only).

A desktop is one container of the ``arpo-desktop`` image: Xvfb + openbox + the apps under test + the
OSWorld-API controller, listening on a Unix socket in a per-desktop host folder bind-mounted at /run/arpo.
Containers run with no network, memory (no swap beyond it) and PID limits, docker's init as PID 1 (reaps
orphans), no Linux capability but CAP_SETGID (:data:`DESKTOP_CAPABILITIES`), no-new-privileges, and labels
``arpo.run=<run id>`` and ``arpo.role=desktop`` so one run's desktops can always be found and removed,
even after a crash (:func:`remove_run_containers`).

Socket folders: ``<socket_root>/<run>/<token>/``, every level a real folder owned by us with mode 0700 (a
path someone else created first, or a symlink, is refused). Each desktop's folder is a small tmpfs mounted on
the host with nosuid,nodev,noexec (:data:`SOCKET_TMPFS_OPTIONS`); the container's bind mount of it inherits
those flags, so nothing the container's root writes there (a setuid file, a device node) means anything on
the host, and it cannot fill the host's disk through it. Mounting needs root on the host (the actors run as
root: the socket is 0660 root); without it the folder stays a plain 0700 folder and a warning is logged. The
run's folder is removed with its last desktop.

The controller's request limits are set from the memory limit (:func:`controller_env`).

Start-ups are bounded and fair: at most ``max_concurrent_starts`` desktops (``actors.max_concurrent_starts``)
are between POST /containers/create and their first healthy /health at once, in every caller of
:meth:`DesktopFleet.start` together (the pool, the benches, `arpo tasks check`); the others wait for a slot in
arrival order (asyncio.Semaphore is FIFO). A desktop's deadline (``ready_timeout``) counts from when it got its
slot, never from when it was queued, so 250 queued starts do not make the 251st time out (tested in
tests/integration/test_pool.py; `bench/bench_desktops.py --live` asks for hundreds at once).

Invariants: :meth:`DesktopFleet.start` returns only a desktop whose controller answered /health; on any
failure it removes what it created and raises DesktopError with the container's last log lines.
Socket paths stay short (< 100 bytes; the Unix limit is 108).
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import errno
import json
import logging
import os
import re
import secrets
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiodocker
from aiodocker.exceptions import DockerError

from actors.desktop.controller_client import ControllerClient, DesktopError
from arpo_async.config import ActorConfig

SOCKET_NAME = "controller.sock"
DEFAULT_SOCKET_ROOT = Path("/tmp/arpo-desktops")
ROLE_LABEL = "arpo.role"
RUN_LABEL = "arpo.run"
ROLE = "desktop"
MAX_SOCKET_PATH = 100
REMOVAL_WAIT_S = 30.0  # how long to wait for a removal another request started
DESKTOP_CAPABILITIES: tuple[str, ...] = ("SETGID",)
"""Linux capabilities the desktop keeps (HostConfig.CapAdd after CapDrop ALL), found by starting from none and
running tests/integration/test_desktop.py (every built-in task, the controller API, /reset):

* SETGID: xterm, run as root, calls initgroups() (setgroups(2)) in its child before it starts the shell; without
  the capability that fails with EPERM and the terminal closes at once ("Reason: spawn: initgroups() failed",
  seen with strace), so the terminal tasks cannot start. It lets root in the container change its own group
  ids, nothing more: every file there is root's, and no-new-privileges stops setgid programs from adding any.

Nothing else is needed: Xvfb, openbox, the Tk apps, xdotool and the controller (screenshots, commands,
uploads, /reset killing processes and restoring /root and /tmp) all run as root, so signals and files need no
capability (owner = uid 0). What dropping the rest costs: root cannot read, write or delete past a file's mode
(/reset restores boot modes first), chown, mknod, bind ports below 1024, use raw sockets (there is no network
anyway) or setuid to another user. Add one here only with a test that needs it, and say why in this comment
and in docs/operations.md ("What the desktops isolate")."""
SOCKET_TMPFS_OPTIONS = "mode=0700,size=1m,nr_inodes=64"
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MNT_DETACH = 0x2, 0x4, 0x8, 0x2
MIB = 1024 * 1024

log = logging.getLogger("arpo.desktop.fleet")


@dataclass
class Desktop:
    """One running desktop: its container, the host folder holding its socket, and its controller."""

    name: str
    container_id: str
    socket_dir: Path
    controller: ControllerClient
    started_at: float = field(default_factory=time.monotonic)
    ready_s: float = 0.0  # seconds from create (its start slot taken) to the first healthy answer
    queued_s: float = 0.0  # seconds it waited for a start slot before that (not counted in any deadline)
    episodes: int = 0  # episodes handed out on this desktop (DesktopPool resets it in place between them)


def _safe(text: str, limit: int) -> str:
    s = re.sub(r"[^a-zA-Z0-9_.-]", "-", text).strip("-.") or "run"
    return s[:limit]


def controller_env(memory_mb: int, pids_limit: int = 256) -> list[str]:
    """The controller's request limits for a container of ``memory_mb`` MiB and ``pids_limit`` processes: the
    largest request body and the largest file /file sends are each an eighth of the memory, at most 64 MiB (its
    own default), at least 1; the controller's memory budget for all requests together is twice that, a quarter
    of the container. It serves at most a quarter of the process limit in connections at once (at least 4, at
    most 64), so connections alone never exhaust it (each is a thread)."""
    limit = max(1, min(64, memory_mb // 8))
    connections = max(4, min(64, pids_limit // 4))
    return [f"ARPO_MAX_BODY_MB={limit}", f"ARPO_MAX_FILE_MB={limit}", f"ARPO_MAX_CONNECTIONS={connections}"]


_libc: ctypes.CDLL | None = None


def _c() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc


def _private_dir(path: Path) -> None:
    """Create ``path`` (mode 0700) if missing and check it is a real folder owned by us, made 0700: a folder
    or symlink another user planted under a shared root such as /tmp is refused (DesktopError)."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise DesktopError(f"cannot create socket folder {path}: {exc}") from exc
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise DesktopError(f"socket folder {path} is not a folder owned by uid {os.geteuid()} (a symlink or "
                           "another user's); remove it or use another socket_root")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


def _check_root(path: Path) -> None:
    """Create the socket root (0700, with parents) if missing; refuse one that is a symlink, is not ours, or
    others may write to (they could swap our folders in it). An existing root's mode is left alone."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        raise DesktopError(f"cannot create socket root {path}: {exc}") from exc
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise DesktopError(f"socket root {path} must be a folder owned by uid {os.geteuid()} that no one else "
                           f"may write to (mode {stat.S_IMODE(st.st_mode):o}, owner {st.st_uid}); use another "
                           "socket_root")


def _mount_socket_tmpfs(path: Path) -> bool:
    """Mount a tmpfs with nosuid,nodev,noexec on ``path``; False when we may not mount (not root)."""
    if os.path.ismount(path):
        return True
    rc = _c().mount(b"arpo-desktop", str(path).encode(), b"tmpfs", ctypes.c_ulong(_MS_NOSUID | _MS_NODEV | _MS_NOEXEC),
                    SOCKET_TMPFS_OPTIONS.encode())
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EPERM, errno.EACCES):
        return False
    raise DesktopError(f"cannot mount a tmpfs on socket folder {path}: {os.strerror(err)}")


def _mounts_below(root: Path) -> list[str]:
    """Mount points at or below ``root`` (deepest first), from /proc/self/mountinfo."""
    prefix = str(root).rstrip("/")
    found = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
        if point == prefix or point.startswith(prefix + "/"):
            found.append(point)
    return sorted(found, key=len, reverse=True)


def _remove_socket_dir(path: Path) -> None:
    """Unmount (lazily) anything mounted at or below ``path`` and delete it."""
    for point in _mounts_below(path):
        _c().umount2(point.encode(), _MNT_DETACH)
    shutil.rmtree(path, ignore_errors=True)


class DesktopFleet:
    """Creates and removes desktop containers for one run.

    Args:
        image: image tag, e.g. from ``actors.desktop.build.image_tag()``.
        run_id: run identifier, stored as the ``arpo.run`` label.
        socket_root: host folder under which each desktop gets ``<run>/<name>/controller.sock``.
        screen: (width, height) in pixels of the virtual screen (24-bit colour).
        memory_mb: container memory limit in MiB.
        pids_limit: container process limit.
        docker: an aiodocker client to use (not closed by :meth:`close`); default: one of our own.
        ready_timeout: seconds one desktop may take from its start slot to the controller's first healthy
            /health before :meth:`start` fails (time queued for the slot does not count).
        max_concurrent_starts: desktops booting at once (>= 1; the run config's ``actors.max_concurrent_starts``).
            More = a faster fleet start while the CPUs have room, more contention (and slower boots) beyond.

    Raises:
        ValueError: ``max_concurrent_starts`` < 1 or ``ready_timeout`` <= 0.
    """

    def __init__(self, image: str, run_id: str, *, socket_root: Path = DEFAULT_SOCKET_ROOT,
                 screen: tuple[int, int] = (1280, 720), memory_mb: int = 512, pids_limit: int = 256,
                 docker: aiodocker.Docker | None = None, ready_timeout: float = 60.0,
                 max_concurrent_starts: int = ActorConfig().max_concurrent_starts) -> None:
        if max_concurrent_starts < 1 or ready_timeout <= 0:
            raise ValueError("need max_concurrent_starts >= 1 and ready_timeout > 0")
        self.image = image
        self.run_id = run_id
        self.socket_root = Path(socket_root)
        self.screen = screen
        self.memory_mb = memory_mb
        self.pids_limit = pids_limit
        self.ready_timeout = ready_timeout
        self.max_concurrent_starts = max_concurrent_starts
        self._start_slots = asyncio.Semaphore(max_concurrent_starts)
        self._docker = docker
        self._own_docker = docker is None
        self._desktops: dict[str, Desktop] = {}
        self._run_dir = self.socket_root / _safe(run_id, 24)
        self._warned_no_mount = False

    @property
    def docker(self) -> aiodocker.Docker:
        if self._docker is None:
            self._docker = aiodocker.Docker()
        return self._docker

    @property
    def desktops(self) -> list[Desktop]:
        """Desktops started by this fleet and not yet removed."""
        return list(self._desktops.values())

    def _config(self, socket_dir: Path) -> dict:
        w, h = self.screen
        memory = self.memory_mb * MIB
        return {
            "Image": self.image,
            "Env": [f"ARPO_SCREEN={w}x{h}x24", *controller_env(self.memory_mb, self.pids_limit)],
            "Labels": {RUN_LABEL: self.run_id, ROLE_LABEL: ROLE},
            "HostConfig": {
                "NetworkMode": "none",
                "Memory": memory,
                "MemorySwap": memory,  # equal to Memory: no swap on top of it
                "PidsLimit": self.pids_limit,
                "Init": True,
                "CapDrop": ["ALL"],
                "CapAdd": list(DESKTOP_CAPABILITIES),
                "SecurityOpt": ["no-new-privileges"],
                "Mounts": [{"Type": "bind", "Source": str(socket_dir), "Target": "/run/arpo",
                            "BindOptions": {"Propagation": "rprivate"}}],
                "ShmSize": 64 * MIB,
            },
        }

    async def start(self) -> Desktop:
        """Create and start one desktop under a start slot; return it once its controller reports X up.

        Waits (first come, first served) while ``max_concurrent_starts`` others boot; the desktop's
        ``queued_s`` is that wait and its ``ready_s`` the boot from the slot on.

        Raises DesktopError when the image is missing, the container fails to start or exits, or /health
        does not answer within ``ready_timeout`` seconds of taking the slot (the message has the container's
        last log lines).
        """
        queued_at = time.monotonic()
        async with self._start_slots:
            t0 = time.monotonic()
            desktop = await self._start(t0)
        desktop.queued_s = t0 - queued_at
        return desktop

    async def _start(self, t0: float) -> Desktop:
        """One boot, its deadline ``ready_timeout`` after ``t0`` (monotonic seconds: when the slot was taken)."""
        token = secrets.token_hex(4)
        name = f"arpo-{_safe(self.run_id, 24)}-{token}"
        socket_dir = self._run_dir / token
        if len(str(socket_dir / SOCKET_NAME)) > MAX_SOCKET_PATH:
            raise DesktopError(f"socket path {socket_dir / SOCKET_NAME} is longer than {MAX_SOCKET_PATH} "
                               "bytes; use a shorter socket_root")
        self._make_socket_dir(socket_dir)
        container = None
        try:
            try:
                container = await self._create(socket_dir, name)
                await container.start()
            except DockerError as exc:
                raise DesktopError(f"cannot start desktop {name} from image {self.image}: "
                                   f"{exc.status} {exc.message}") from exc
            desktop = Desktop(name=name, container_id=container.id, socket_dir=socket_dir,
                              controller=ControllerClient(str(socket_dir / SOCKET_NAME)))
            await self._wait_ready(desktop, container, t0 + self.ready_timeout)
        except BaseException:
            if container is not None:
                await self._delete(container.id)
            self._remove_socket_dir(socket_dir)
            raise
        desktop.ready_s = time.monotonic() - t0
        self._desktops[desktop.container_id] = desktop
        return desktop

    def _make_socket_dir(self, socket_dir: Path) -> None:
        """``<root>/<run>/<token>``: private folders (see the module doc), the last one a nosuid,nodev tmpfs."""
        try:
            _check_root(self.socket_root)
            for folder in (self._run_dir, socket_dir):
                _private_dir(folder)
            if not _mount_socket_tmpfs(socket_dir) and not self._warned_no_mount:
                self._warned_no_mount = True
                log.warning("cannot mount a tmpfs on %s (not root?): desktop socket folders are plain 0700 "
                            "folders, without nosuid,nodev", socket_dir)
        except BaseException:
            self._remove_socket_dir(socket_dir)
            raise

    def _remove_socket_dir(self, socket_dir: Path) -> None:
        """Remove one desktop's socket folder, and the run's folder with its last desktop."""
        _remove_socket_dir(socket_dir)
        try:
            self._run_dir.rmdir()
        except OSError:
            pass  # another desktop of this run (perhaps another process's) still has its folder there

    async def _create(self, socket_dir: Path, name: str):
        """POST /containers/create, shielded: cancelled mid-request, it lets the request finish (the engine
        creates the container whether or not we still listen), removes what it made, and re-raises."""
        request = asyncio.ensure_future(self.docker.containers.create(self._config(socket_dir), name=name))
        try:
            return await asyncio.shield(request)
        except asyncio.CancelledError:
            try:
                made = await request
            except DockerError:
                raise asyncio.CancelledError from None  # nothing was made
            await self._delete(made.id)
            raise

    async def _wait_ready(self, desktop: Desktop, container, deadline: float) -> None:
        """Poll /health (every 50 ms) until it answers, the container exits, or ``deadline`` (monotonic) passes."""
        sock = desktop.socket_dir / SOCKET_NAME
        checks = 0
        while True:
            if sock.exists() and await desktop.controller.health(timeout=2.0):
                return
            checks += 1
            if checks % 10 == 0:  # every ~0.5 s, see whether the container died
                try:
                    info = await container.show()
                except DockerError as exc:  # removed from outside (another run's clean-up, `docker rm`)
                    await desktop.controller.close()
                    raise DesktopError(f"desktop {desktop.name} vanished before it was ready: "
                                       f"{exc.status} {exc.message}") from exc
                state = info.get("State", {})
                if not state.get("Running", False):
                    await desktop.controller.close()
                    raise DesktopError(f"desktop {desktop.name} exited (status {state.get('ExitCode')}, "
                                       f"{state.get('Error') or 'no error'}) before it was ready; last log "
                                       f"lines:\n{await self._log_tail(container)}")
            if time.monotonic() > deadline:
                await desktop.controller.close()
                raise DesktopError(f"desktop {desktop.name} did not answer /health within "
                                   f"{self.ready_timeout:g} s; last log lines:\n{await self._log_tail(container)}")
            await asyncio.sleep(0.05)

    async def _log_tail(self, container, lines: int = 20) -> str:
        try:
            out = await container.log(stdout=True, stderr=True, tail=lines)
        except DockerError as exc:
            return f"(no logs: {exc.message})"
        return "".join(out).rstrip() or "(empty log)"

    async def _delete(self, container_id: str) -> bool:
        """Force-remove a container by id or name; see :func:`_delete_container`."""
        return await _delete_container(self.docker, container_id)

    async def remove(self, desktop: Desktop) -> None:
        """Force-remove a desktop's container and its socket folder. Idempotent."""
        self._desktops.pop(desktop.container_id, None)
        await desktop.controller.close()
        await self._delete(desktop.container_id)
        self._remove_socket_dir(desktop.socket_dir)

    async def remove_all(self) -> int:
        """Remove every container labelled with this run (not only those this object started).

        Returns the number of containers removed.
        """
        for d in list(self._desktops.values()):
            await d.controller.close()
        self._desktops.clear()
        n = await _remove_labelled(self.docker, self.run_id)
        _remove_socket_dir(self._run_dir)
        return n

    async def close(self) -> None:
        """Close controller sessions and our Docker client (containers are left running)."""
        for d in list(self._desktops.values()):
            await d.controller.close()
        if self._own_docker and self._docker is not None:
            await self._docker.close()
            self._docker = None


async def _delete_container(docker: aiodocker.Docker, container_id: str) -> bool:
    """Force-remove a container (by id or name) and return once the engine no longer lists it.

    Returns False if it was already gone or another removal of it was already under way (then this waits
    for that one to finish, up to ``REMOVAL_WAIT_S``). Raises DesktopError on any other engine error.
    """
    container = docker.containers.container(container_id)
    try:
        await container.delete(force=True)
        return True
    except DockerError as exc:
        if exc.status == 404:
            return False
        if not (exc.status == 409 and "in progress" in str(exc.message)):
            raise DesktopError(f"cannot remove desktop container {container_id[:12]}: "
                               f"{exc.status} {exc.message}") from exc
    # A cancelled earlier delete left the engine removing it. Poll rather than POST /wait?condition=removed:
    # that answers 404 while the container is still listed (measured: it brought the leak back).
    deadline = time.monotonic() + REMOVAL_WAIT_S
    while time.monotonic() < deadline:
        try:
            await container.show()
        except DockerError as exc:
            if exc.status == 404:
                return False
            raise DesktopError(f"cannot inspect desktop container {container_id[:12]}: "
                               f"{exc.status} {exc.message}") from exc
        await asyncio.sleep(0.1)
    raise DesktopError(f"desktop container {container_id[:12]} was still being removed after "
                       f"{REMOVAL_WAIT_S:g} s")


async def _remove_labelled(docker: aiodocker.Docker, run_id: str | None) -> int:
    labels = [f"{ROLE_LABEL}={ROLE}"] + ([f"{RUN_LABEL}={run_id}"] if run_id is not None else [])
    containers = await docker.containers.list(all="true", filters=json.dumps({"label": labels}))
    removed = 0
    for c in containers:
        removed += await _delete_container(docker, c.id)
    return removed


async def remove_run_containers(run_id: str | None = None, *, socket_root: Path = DEFAULT_SOCKET_ROOT) -> int:
    """Remove all arpo desktop containers (or one run's) on the local engine and their socket folders.

    Returns the number of containers removed. Raises DesktopError when a container cannot be removed.
    """
    async with aiodocker.Docker() as docker:
        n = await _remove_labelled(docker, run_id)
    target = Path(socket_root) / _safe(run_id, 24) if run_id is not None else Path(socket_root)
    _remove_socket_dir(target)
    return n
