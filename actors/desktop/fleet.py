"""The desktop fleet: starts and removes desktop containers through the Docker API (aiodocker only).

A desktop is one container of the ``arpo-desktop`` image: Xvfb + openbox + the apps under test + the
OSWorld-API controller, listening on a Unix socket in a per-desktop host folder bind-mounted at /run/arpo.
Containers run with no network, memory and PID limits, docker's init as PID 1 (reaps orphans), and labels
``arpo.run=<run id>`` and ``arpo.role=desktop`` so one run's desktops can always be found and removed,
even after a crash (:func:`remove_run_containers`).

Invariants: :meth:`DesktopFleet.start` returns only a desktop whose controller answered /health; on any
failure it removes what it created and raises DesktopError with the container's last log lines.
Socket paths stay short (< 100 bytes; the Unix limit is 108).
"""
from __future__ import annotations

import asyncio
import json
import re
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiodocker
from aiodocker.exceptions import DockerError

from actors.desktop.controller_client import ControllerClient, DesktopError

SOCKET_NAME = "controller.sock"
DEFAULT_SOCKET_ROOT = Path("/tmp/arpo-desktops")
ROLE_LABEL = "arpo.role"
RUN_LABEL = "arpo.run"
ROLE = "desktop"
MAX_SOCKET_PATH = 100
REMOVAL_WAIT_S = 30.0  # how long to wait for a removal another request started


@dataclass
class Desktop:
    """One running desktop: its container, the host folder holding its socket, and its controller."""

    name: str
    container_id: str
    socket_dir: Path
    controller: ControllerClient
    started_at: float = field(default_factory=time.monotonic)
    ready_s: float = 0.0  # seconds from create to the first healthy answer
    episodes: int = 0  # episodes handed out on this desktop (DesktopPool resets it in place between them)


def _safe(text: str, limit: int) -> str:
    s = re.sub(r"[^a-zA-Z0-9_.-]", "-", text).strip("-.") or "run"
    return s[:limit]


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
        ready_timeout: seconds :meth:`start` waits for the controller's /health before failing.
    """

    def __init__(self, image: str, run_id: str, *, socket_root: Path = DEFAULT_SOCKET_ROOT,
                 screen: tuple[int, int] = (1280, 720), memory_mb: int = 512, pids_limit: int = 256,
                 docker: aiodocker.Docker | None = None, ready_timeout: float = 60.0) -> None:
        self.image = image
        self.run_id = run_id
        self.socket_root = Path(socket_root)
        self.screen = screen
        self.memory_mb = memory_mb
        self.pids_limit = pids_limit
        self.ready_timeout = ready_timeout
        self._docker = docker
        self._own_docker = docker is None
        self._desktops: dict[str, Desktop] = {}
        self._run_dir = self.socket_root / _safe(run_id, 24)

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
        return {
            "Image": self.image,
            "Env": [f"ARPO_SCREEN={w}x{h}x24"],
            "Labels": {RUN_LABEL: self.run_id, ROLE_LABEL: ROLE},
            "HostConfig": {
                "NetworkMode": "none",
                "Memory": self.memory_mb * 1024 * 1024,
                "PidsLimit": self.pids_limit,
                "Init": True,
                "Binds": [f"{socket_dir}:/run/arpo"],
                "ShmSize": 64 * 1024 * 1024,
            },
        }

    async def start(self) -> Desktop:
        """Create and start one desktop; return it once its controller reports X up.

        Raises DesktopError when the image is missing, the container fails to start or exits, or /health
        does not answer within ``ready_timeout`` seconds (the message has the container's last log lines).
        """
        token = secrets.token_hex(4)
        name = f"arpo-{_safe(self.run_id, 24)}-{token}"
        socket_dir = self._run_dir / token
        if len(str(socket_dir / SOCKET_NAME)) > MAX_SOCKET_PATH:
            raise DesktopError(f"socket path {socket_dir / SOCKET_NAME} is longer than {MAX_SOCKET_PATH} "
                               "bytes; use a shorter socket_root")
        socket_dir.mkdir(parents=True, exist_ok=True)
        socket_dir.chmod(0o777)
        t0 = time.monotonic()
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
            await self._wait_ready(desktop, container)
        except BaseException:
            if container is not None:
                await self._delete(container.id)
            shutil.rmtree(socket_dir, ignore_errors=True)
            raise
        desktop.ready_s = time.monotonic() - t0
        self._desktops[desktop.container_id] = desktop
        return desktop

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

    async def _wait_ready(self, desktop: Desktop, container) -> None:
        """Poll /health (every 50 ms) until it answers, the container exits, or the deadline passes."""
        sock = desktop.socket_dir / SOCKET_NAME
        deadline = time.monotonic() + self.ready_timeout
        checks = 0
        while True:
            if sock.exists() and await desktop.controller.health(timeout=2.0):
                return
            checks += 1
            if checks % 10 == 0:  # every ~0.5 s, see whether the container died
                info = await container.show()
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
        shutil.rmtree(desktop.socket_dir, ignore_errors=True)

    async def remove_all(self) -> int:
        """Remove every container labelled with this run (not only those this object started).

        Returns the number of containers removed.
        """
        for d in list(self._desktops.values()):
            await d.controller.close()
        self._desktops.clear()
        n = await _remove_labelled(self.docker, self.run_id)
        shutil.rmtree(self._run_dir, ignore_errors=True)
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
    shutil.rmtree(target, ignore_errors=True)
    return n
