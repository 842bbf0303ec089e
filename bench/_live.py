"""The live-desktop probe of bench_desktops.py (``--live N``): how many idle desktops one host holds, and what each
costs.

For each step N (ascending) it grows one DesktopPool (the product's path: DesktopFleet's bounded, fair start slots,
the pool's start retries) to N desktops in use, then measures all of them:

- start rate: desktops added in the step / seconds from asking for them all at once to the last one healthy;
  every start is queued at the same moment, so the last one waits for all the others (``queued_max_s``) and
  still must not time out: DesktopFleet's ``ready_timeout`` counts from its own start slot;
- /health and a PNG screenshot from every live desktop (``healthy`` = both answered);
- RAM per idle desktop: mean Docker stats ``memory_stats.usage`` (the container's cgroup memory) after the idle
  window; host MiB per desktop: the fall of the host's MemAvailable since before the first start, over the
  desktops (adds what no container cgroup holds: containerd-shim, kernel, the socket tmpfs);
- CPU per idle desktop: the rise of Docker stats ``cpu_stats.cpu_usage.total_usage`` (the cgroup's CPU
  nanoseconds) over an idle window of ``window_s`` seconds, in percent of one core;
- host limits (:class:`HostUse`): threads against kernel.pid_max and threads-max, root's inotify instances against
  fs.inotify.max_user_instances, open files of dockerd and containerd against their RLIMIT_NOFILE, root's keys
  against kernel.keys.root_maxkeys, and this process's open files; each gives the number of desktops at which it
  would run out (``max_desktops_by``), from what the desktops added so far.

It stops at the first step whose starts fail (the error is kept), when the next step would leave less than
``min_free_gb`` of MemAvailable (at the host MiB per desktop measured so far), or, during a step, as soon as
MemAvailable falls below ``min_free_gb`` (the machine's other users come first; that step is not reported).
"""
from __future__ import annotations

import asyncio
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench._common import median

from actors.desktop.fleet import Desktop, DesktopFleet
from actors.desktop.pool import DesktopPool

DOCKER_CALLS_AT_ONCE = 32
"""Docker stats requests in flight at once (each waits ~1 s in the engine for its second CPU sample)."""
DESKTOP_CALLS_AT_ONCE = 8
"""/health and /screenshot calls in flight at once: each call's deadline counts from its own start, not from
behind 250 others on 2 cores."""


def mem_available_gb() -> float:
    """Host MemAvailable from /proc/meminfo, GiB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def _read_int(path: str) -> int:
    return int(Path(path).read_text().split()[0])


def _nofile_limit(pid: int) -> int:
    """The soft RLIMIT_NOFILE of process ``pid`` (from /proc/PID/limits; unlimited = 2**62)."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft = line.split()[3]
            return 2**62 if soft == "unlimited" else int(soft)
    return 2**62


def _pid_of(name: str) -> int | None:
    """The lowest pid whose comm is ``name`` (dockerd, containerd), or None."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if Path(entry.path, "comm").read_text().strip() == name:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return min(pids) if pids else None


def _open_files(pid: int | None) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd")) if pid else 0
    except OSError:
        return 0


def _root_inotify_instances() -> int:
    """inotify instances held by uid 0's processes, host-wide (fs.inotify.max_user_instances counts per user,
    and every desktop's root is the host's root: no user namespace)."""
    count = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if os.stat(entry.path).st_uid != 0:
                continue
            for fd in os.scandir(f"{entry.path}/fd"):
                try:
                    count += os.readlink(fd.path) == "anon_inode:inotify"
                except OSError:
                    continue
        except OSError:
            continue
    return count


def _root_keys() -> tuple[int, int]:
    """(keys held, kernel.keys.root_maxkeys) for uid 0 from /proc/key-users (runc gives each container a session
    keyring)."""
    try:
        for line in Path("/proc/key-users").read_text().splitlines():
            if line.split(":")[0].strip() == "0":
                used, limit = line.split()[3].split("/")
                return int(used), int(limit)
    except (OSError, IndexError, ValueError):
        pass
    return 0, 2**62


@dataclass
class HostUse:
    """A snapshot of the host resources that live desktops consume, each as (used, limit)."""

    mem_available_gb: float
    resources: dict[str, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def now(cls) -> "HostUse":
        """Read /proc and /proc/sys now (about 0.1-0.5 s with hundreds of containers)."""
        threads = int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])  # scheduling entities = threads
        dockerd, containerd = _pid_of("dockerd"), _pid_of("containerd")
        keys = _root_keys()
        return cls(mem_available_gb(), {
            "threads_vs_pid_max": (threads, _read_int("/proc/sys/kernel/pid_max")),
            "threads_vs_threads_max": (threads, _read_int("/proc/sys/kernel/threads-max")),
            "inotify_instances": (_root_inotify_instances(), _read_int("/proc/sys/fs/inotify/max_user_instances")),
            "dockerd_files": (_open_files(dockerd), _nofile_limit(dockerd) if dockerd else 2**62),
            "containerd_files": (_open_files(containerd), _nofile_limit(containerd) if containerd else 2**62),
            "bench_files": (_open_files(os.getpid()), resource.getrlimit(resource.RLIMIT_NOFILE)[0]),
            "root_keys": keys,
        })

    def max_desktops_by(self, base: "HostUse", live: int, min_free_gb: float) -> dict[str, int]:
        """For each resource, the number of desktops at which it would run out, extrapolated linearly from what
        ``live`` desktops added since ``base`` (resources they did not raise are left out); memory stops at
        ``min_free_gb`` of MemAvailable."""
        out: dict[str, int] = {}
        if live <= 0:
            return out
        per_mem = (base.mem_available_gb - self.mem_available_gb) / live
        if per_mem > 0:
            out["memory"] = live + int((self.mem_available_gb - min_free_gb) / per_mem)
        for name, (used, limit) in self.resources.items():
            per = (used - base.resources[name][0]) / live
            if per > 0 and limit < 2**62:
                out[name] = live + int((limit - used) / per)
        return out


async def _bounded(limit: int, calls) -> list:
    """Await the coroutines of ``calls`` with at most ``limit`` in flight; results in order (exceptions as values)."""
    slots = asyncio.Semaphore(limit)

    async def one(coro):
        async with slots:
            return await coro

    return await asyncio.gather(*(one(c) for c in calls), return_exceptions=True)


async def _answers(d: Desktop) -> bool:
    """/health then a PNG screenshot from ``d``; True when both came back."""
    if not await d.controller.health(timeout=30):
        return False
    return (await d.controller.screenshot()).startswith(b"\x89PNG")  # DesktopError counts as not answering


async def _stats(fleet: DesktopFleet, desktops: list[Desktop]) -> list[tuple[float, float, int] | BaseException]:
    """Per desktop: (monotonic seconds at the answer, cgroup memory MiB, cgroup CPU ns) from Docker stats."""
    async def one(d: Desktop):
        raw = await fleet.docker.containers.container(d.container_id).stats(stream=False)
        raw = raw[0] if isinstance(raw, list) else raw
        return (time.monotonic(), raw.get("memory_stats", {}).get("usage", 0) / 2**20,
                int(raw.get("cpu_stats", {}).get("cpu_usage", {}).get("total_usage", 0)))

    return await _bounded(DOCKER_CALLS_AT_ONCE, [one(d) for d in desktops])


@dataclass
class Step:
    """The figures of one step (N live desktops)."""

    live: int
    added: int
    start_s: float
    healthy: int
    ram_mb: float
    host_mb: float
    cpu_pct: float
    queued_max_s: float
    ready_p50_s: float
    ready_max_s: float
    failed: int
    retried: int  # single start tries that failed and were tried again (DesktopPool.stats["start_failures"])
    host: HostUse

    @property
    def start_per_s(self) -> float:
        return self.added / self.start_s if self.start_s > 0 else float("nan")


async def idle_figures(fleet: DesktopFleet, desktops: list[Desktop], window_s: float) -> tuple[float, float]:
    """(mean cgroup memory MiB, mean cgroup CPU % of one core) of ``desktops`` over an idle window of
    ``window_s`` seconds (Docker stats before and after; desktops whose stats failed are left out)."""
    before = await _stats(fleet, desktops)
    await asyncio.sleep(window_s)  # the measurement window itself, not a synchronisation
    after = await _stats(fleet, desktops)
    mem, cpu = [], []
    for a, b in zip(before, after):
        if isinstance(a, BaseException) or isinstance(b, BaseException) or b[0] <= a[0]:
            continue
        mem.append(b[1])
        cpu.append(100.0 * (b[2] - a[2]) / 1e9 / (b[0] - a[0]))
    return (sum(mem) / len(mem) if mem else float("nan"), sum(cpu) / len(cpu) if cpu else float("nan"))


class LowMemory(Exception):
    """The host's MemAvailable fell below the floor while a step was starting desktops."""


async def _watch_memory(min_free_gb: float) -> None:
    """Raise LowMemory once MemAvailable is below ``min_free_gb`` (checked every second)."""
    while (free := mem_available_gb()) >= min_free_gb:
        await asyncio.sleep(1.0)
    raise LowMemory(f"MemAvailable fell to {free:.1f} GiB (< {min_free_gb:g}) while starting desktops")


async def grow(pool: DesktopPool, live: list[Desktop], target: int,
               min_free_gb: float) -> tuple[float, list[BaseException]]:
    """Acquire ``target - len(live)`` more desktops from ``pool`` all at once; append them to ``live``.
    Returns (seconds until the last answered, the errors of the acquires that failed).

    Raises LowMemory (the acquires cancelled) when MemAvailable falls below ``min_free_gb`` meanwhile: other
    users of the machine come first; close the pool then, as starts already under way still finish."""
    t0 = time.perf_counter()
    acquires = asyncio.gather(*(pool.acquire() for _ in range(target - len(live))), return_exceptions=True)
    watch = asyncio.ensure_future(_watch_memory(min_free_gb))
    try:
        await asyncio.wait([acquires, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not acquires.done():
        acquires.cancel()
        await asyncio.wait([acquires])
        if not acquires.cancelled():
            acquires.exception()  # retrieved: the cancelled acquires' CancelledError is expected
        raise watch.exception() or LowMemory("MemAvailable fell below the floor")
    elapsed = time.perf_counter() - t0
    got = acquires.result()
    live.extend(d for d in got if isinstance(d, Desktop))
    return elapsed, [e for e in got if isinstance(e, BaseException)]


async def probe(fleet: DesktopFleet, steps: list[int], *, window_s: float, min_free_gb: float,
                log=print) -> tuple[list[Step], str]:
    """Grow a pool over ``fleet`` through ``steps`` (ascending desktop counts); returns the steps measured and why
    it stopped ("done", a start error, or memory). Removes every desktop it started before returning."""
    base = HostUse.now()
    live: list[Desktop] = []
    done: list[Step] = []
    reason = "done"
    pool = DesktopPool(fleet, warm_spares=0, max_episodes=1)
    pool.start()
    try:
        for n in sorted(set(steps)):
            if done and done[-1].host_mb > 0:
                need_gb = (n - len(live)) * done[-1].host_mb / 1024
                if mem_available_gb() - need_gb < min_free_gb:
                    reason = (f"memory: {n} desktops would leave < {min_free_gb:g} GiB MemAvailable "
                              f"({done[-1].host_mb:.0f} MiB each)")
                    break
            before = len(live)
            try:
                elapsed, errors = await grow(pool, live, n, min_free_gb)
            except LowMemory as exc:
                reason = f"memory, on the way to {n}: {exc}"
                break
            added = live[before:]
            healthy = sum(r is True for r in await _bounded(DESKTOP_CALLS_AT_ONCE, [_answers(d) for d in live]))
            ram, cpu = await idle_figures(fleet, live, window_s)
            host = HostUse.now()
            step = Step(live=len(live), added=len(added), start_s=elapsed, healthy=healthy, ram_mb=ram,
                        host_mb=(base.mem_available_gb - host.mem_available_gb) * 1024 / max(1, len(live)),
                        cpu_pct=cpu, queued_max_s=max((d.queued_s for d in added), default=0.0),
                        ready_p50_s=median(d.ready_s for d in added),
                        ready_max_s=max((d.ready_s for d in added), default=0.0), failed=len(errors),
                        retried=pool.stats["start_failures"], host=host)
            done.append(step)
            log(f"live {step.live}: +{step.added} in {step.start_s:.0f} s ({step.start_per_s:.2f}/s; boot p50 "
                f"{step.ready_p50_s:.2f} s, max {step.ready_max_s:.1f} s; longest wait for a start slot "
                f"{step.queued_max_s:.0f} s), {step.failed} failed, {step.retried} tries retried; "
                f"healthy+screenshot {step.healthy}/{step.live}; "
                f"idle: {step.ram_mb:.1f} MiB cgroup, {step.host_mb:.1f} MiB host, {step.cpu_pct:.3f}% of a core "
                f"per desktop; MemAvailable {host.mem_available_gb:.1f} GiB; load {os.getloadavg()[0]:.1f}")
            log("  host use (used / limit): " + ", ".join(f"{k} {u}/{lim}" for k, (u, lim) in host.resources.items()))
            log("  would run out at (desktops): " + ", ".join(
                f"{k} {v}" for k, v in sorted(host.max_desktops_by(base, step.live, min_free_gb).items(),
                                              key=lambda kv: kv[1])))
            if errors:
                reason = f"start failed at {n}: {type(errors[0]).__name__}: {str(errors[0])[:300]}"
                break
    finally:
        t0 = time.perf_counter()
        count = len(pool.in_use)
        await pool.close()
        log(f"removed {count} desktops in {time.perf_counter() - t0:.0f} s")
    return done, reason
