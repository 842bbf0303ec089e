"""bench_desktops.py: the desktop fleet's latencies and capacity on this machine, with real containers.

Measures, each with the real arpo-desktop image through DesktopFleet / DesktopPool / ControllerClient:

- start: create + boot a container until its first screenshot arrives (p50, p95 over ``--starts`` desktops,
  one at a time);
- reset cold: remove the used desktop, start a new one and wait for /health (what an episode waits for with
  no spares); reset warm: ``DesktopPool.acquire()`` with warm spares (release of the previous one runs in the
  background, and the pool is given time to refill between episodes, as real episodes last seconds); reset in
  place: POST /reset + /health on a desktop after a grid task's setup and a click (what DesktopPool does
  between the episodes of one container, ``actors.desktop_max_episodes``);
- screenshot: GET /screenshot p50 at 1280x720 and 1920x1080, PNG and JPEG (quality 85);
- action: one xdotool click through POST /execute (p50);
- capacity: the live probe (below) with one step of ``--max-desktops``.

``--live N[,N...]`` measures only the live probe (bench/_live.py): a DesktopPool grown to each N in turn (all of a
step's starts asked for at once, ``--concurrency`` booting at a time through DesktopFleet's start slots), then
/health and a screenshot from every desktop, RAM (cgroup, and host MemAvailable) and CPU (cgroup, over an idle
window of ``--window-s``) per idle desktop, the start rate, and the host limits each step brings closer. It stops
at a failed start or when the next step would leave less than ``--min-free-gb`` of MemAvailable. Its last line
begins ``live=N ram_mb_per_desktop=... start_per_s=... healthy=...`` (the largest step reached).

``--profile osworld`` measures the osworld image instead (arpo-desktop-osworld, built when missing; desktops
of ``--memory-mb``, default 2048): image size; start to first screenshot; RAM of an idle desktop and with
LibreOffice Calc open (its window mapped, then ``--settle-s`` seconds); reset in place (POST /reset + /health)
after each of ``--resets`` episodes that opened LibreOffice Calc. ``--app vscode`` opens VS Code instead
(``code /root``: code-server starts, its Chromium app window shows "root - Visual Studio Code").

Every container carries this run's label and is removed in ``finally`` (also on Ctrl-C). Prints medians,
then as its LAST line ``key=value`` figures. ``--quick`` runs a small smoke version (capacity cap 16).
"""
from __future__ import annotations

import argparse
import asyncio
import secrets
import sys
import time

from bench._common import median, p95, result_line
from bench._live import probe

from actors.desktop.build import build_image, image_size_mb
from actors.desktop.fleet import Desktop, DesktopFleet
from actors.desktop.pool import DesktopPool
from actors.evaluation import run_setup
from arpo_async.tasks import load_tasks


async def timed(coro) -> tuple[float, object]:
    t0 = time.perf_counter()
    result = await coro
    return time.perf_counter() - t0, result


async def bench_start(fleet: DesktopFleet, n: int) -> list[float]:
    """Seconds from create to the first screenshot, one desktop at a time."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        d = await fleet.start()
        await d.controller.screenshot()
        out.append(time.perf_counter() - t0)
        await fleet.remove(d)
    return out


async def bench_reset_cold(fleet: DesktopFleet, n: int) -> list[float]:
    """Seconds to remove the used desktop and have a new healthy one (no spares)."""
    out = []
    d = await fleet.start()
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            await fleet.remove(d)
            d = await fleet.start()
            out.append(time.perf_counter() - t0)
    finally:
        await fleet.remove(d)
    return out


async def bench_reset_pool(fleet: DesktopFleet, n: int, spares: int) -> list[float]:
    """Seconds for release + acquire from a pool with ``spares`` warm spares (refilled between episodes; with
    0 spares the acquire waits for a boot while the used desktop is removed in the background)."""
    out = []
    async with DesktopPool(fleet, warm_spares=spares, max_episodes=1) as pool:  # a fresh container per episode
        await pool.wait_spares()
        d = await pool.acquire()
        for _ in range(n):
            await pool.wait_spares()  # the previous episode lasted long enough for the refill
            while pool.stats["removed"] < len(out):  # and for the removal of the one before
                await asyncio.sleep(0.05)
            t0 = time.perf_counter()
            await pool.release(d)
            d = await pool.acquire()
            out.append(time.perf_counter() - t0)
        await pool.release(d)
    return out


async def bench_reset_inplace(fleet: DesktopFleet, n: int) -> list[float]:
    """Seconds for POST /reset + /health after each of ``n`` episodes (grid4-red's setup and one click, not
    timed) on one desktop."""
    task = next(t for t in load_tasks() if t.id == "grid4-red")
    out = []
    d = await fleet.start()
    try:
        for _ in range(n):
            await run_setup(d.controller, task.config)
            await d.controller.execute(["xdotool", "mousemove", "300", "200", "click", "1"], timeout=20)
            t0 = time.perf_counter()
            await d.controller.reset()
            if not await d.controller.health():
                raise RuntimeError(f"desktop {d.name} is not healthy after /reset")
            out.append(time.perf_counter() - t0)
    finally:
        await fleet.remove(d)
    return out


async def bench_screenshots(d: Desktop, n: int) -> dict[str, list[float]]:
    """Seconds per GET /screenshot, PNG and JPEG q85 (after one warm-up call each)."""
    out: dict[str, list[float]] = {}
    for fmt in ("png", "jpeg"):
        await d.controller.screenshot(fmt)
        times = []
        for _ in range(n):
            dt, _ = await timed(d.controller.screenshot(fmt))
            times.append(dt)
        out[fmt] = times
    return out


async def bench_actions(d: Desktop, n: int, command: list[str] | None = None) -> list[float]:
    """Seconds per xdotool click (or per ``command``) through POST /execute."""
    times = []
    for i in range(n):
        cmd = command or ["xdotool", "mousemove", str(100 + 5 * i), "600", "click", "1"]
        dt, r = await timed(d.controller.execute(cmd, timeout=20))
        if r["returncode"] != 0:
            raise RuntimeError(f"{cmd} failed: {r}")
        times.append(dt)
    return times


async def desktop_memory_mb(fleet: DesktopFleet, d: Desktop) -> float:
    """The container's cgroup memory usage (Docker stats memory_stats.usage), MiB."""
    stats = await fleet.docker.containers.container(d.container_id).stats(stream=False)
    stats = stats[0] if isinstance(stats, list) else stats
    return stats.get("memory_stats", {}).get("usage", 0) / 2**20


CALC_CLASS = "libreoffice-calc"  # WM_CLASS of LibreOffice Calc's document window (GTK3 UI)
APPS = {"calc": ("LibreOffice Calc", "libreoffice --calc", f"--class {CALC_CLASS}"),
        "vscode": ("VS Code", "code /root", '--name "root - Visual Studio Code"')}
"""--app: (name, launch command, xdotool search arguments that find its window)."""


async def open_app(d: Desktop, app: str = "calc", deadline_s: float = 180.0) -> float:
    """Launch ``app`` (:data:`APPS`) and poll (xdotool search, every 0.1 s) for its window; returns seconds.
    Not ``xdotool search --sync``: it can die of BadWindow while Chromium maps and drops windows."""
    name, command, search = APPS[app]
    t0 = time.perf_counter()
    await d.controller.launch(command, shell=True)
    r = await d.controller.execute(f"timeout {deadline_s:g} sh -c 'until xdotool search --onlyvisible {search} "
                                   f">/dev/null 2>&1; do sleep 0.1; done'", shell=True, timeout=deadline_s + 10)
    if r["returncode"] != 0:
        raise RuntimeError(f"{name} showed no window within {deadline_s:g} s: {r}")
    return time.perf_counter() - t0


async def bench_osworld(image: str, args: argparse.Namespace) -> dict:
    """The osworld image's figures (see the module doc)."""
    fleet = DesktopFleet(image, f"bench-osworld-{secrets.token_hex(3)}", memory_mb=args.memory_mb)
    try:
        start = await bench_start(fleet, args.starts)
        print(f"start to first screenshot: p50 {median(start):.2f} s, p95 {p95(start):.2f} s (n={len(start)})",
              flush=True)
        d = await fleet.start()
        await d.controller.screenshot()
        await asyncio.sleep(args.settle_s)  # let the idle desktop's memory settle; not a synchronisation
        idle = await desktop_memory_mb(fleet, d)
        app = APPS[args.app][0]
        calc_s = await open_app(d, args.app)
        await asyncio.sleep(args.settle_s)
        calc = await desktop_memory_mb(fleet, d)
        print(f"RAM: idle {idle:.0f} MiB, {app} open {calc:.0f} MiB (window after {calc_s:.1f} s)", flush=True)
        inplace = []
        for i in range(args.resets):
            if i:
                await open_app(d, args.app)
            t0 = time.perf_counter()
            await d.controller.reset()
            if not await d.controller.health():
                raise RuntimeError(f"desktop {d.name} is not healthy after /reset")
            inplace.append(time.perf_counter() - t0)
        print(f"reset in place after {app} (/reset + /health) p50 {median(inplace) * 1e3:.0f} ms "
              f"(n={len(inplace)})", flush=True)
        return {"image_mb": image_size_mb(image), "start_p50_s": median(start), "start_p95_s": p95(start),
                "ram_idle_mb": idle, "ram_calc_mb": calc, "calc_window_s": calc_s,
                "reset_inplace_p50_s": median(inplace), "app": args.app}
    finally:
        removed = await fleet.remove_all()
        print(f"removed {removed} leftover containers of {fleet.run_id}", flush=True)
        await fleet.close()


async def bench_live(image: str, args: argparse.Namespace) -> dict:
    """``--live``: the live probe's figures at the largest step reached (see the module doc)."""
    run_id = f"bench-live-{secrets.token_hex(3)}"
    fleet = DesktopFleet(image, run_id, max_concurrent_starts=args.concurrency)
    try:
        steps, reason = await probe(fleet, args.live, window_s=args.window_s, min_free_gb=args.min_free_gb,
                                    log=lambda line: print(line, flush=True))
    finally:
        removed = await fleet.remove_all()
        print(f"removed {removed} leftover containers of {run_id}", flush=True)
        await fleet.close()
    print(f"stopped: {reason}", flush=True)
    if not steps:
        raise RuntimeError(f"no live desktop: {reason}")
    last = steps[-1]
    fig = {"live": last.live, "ram_mb_per_desktop": last.ram_mb, "start_per_s": last.start_per_s,
           "healthy": last.healthy, "host_mb_per_desktop": last.host_mb, "cpu_pct_per_desktop": last.cpu_pct,
           "queued_max_s": last.queued_max_s, "boot_p50_s": last.ready_p50_s, "boot_max_s": last.ready_max_s,
           "start_failures": last.failed, "start_retries": last.retried, "concurrency": args.concurrency, "asked": max(args.live)}
    fig.update({f"live_{s.live}_start_per_s": s.start_per_s for s in steps[:-1]})
    return fig


async def main_async(args: argparse.Namespace) -> dict:
    image = args.image or build_image(log=lambda line: print(f"[build] {line}", flush=True),
                                      profile=args.profile)
    if args.profile == "osworld":
        return await bench_osworld(image, args)
    if args.live:
        return await bench_live(image, args)
    run_id = f"bench-desktops-{secrets.token_hex(3)}"
    fleet = DesktopFleet(image, run_id)
    big = DesktopFleet(image, run_id, screen=(1920, 1080))
    capacity = DesktopFleet(image, run_id, max_concurrent_starts=args.concurrency)
    fig: dict = {}
    try:
        start = await bench_start(fleet, args.starts)
        print(f"start to first screenshot: p50 {median(start):.2f} s, p95 {p95(start):.2f} s (n={len(start)})", flush=True)
        cold = await bench_reset_cold(fleet, args.resets)
        cold_pool = await bench_reset_pool(fleet, args.resets, 0)
        warm = await bench_reset_pool(fleet, args.resets, args.spares)
        inplace = await bench_reset_inplace(fleet, args.resets)
        print(f"reset: cold (remove + start) p50 {median(cold):.3f} s, pool with 0 spares (removal in the "
              f"background) p50 {median(cold_pool):.3f} s, warm ({args.spares} spares) p50 "
              f"{median(warm) * 1e3:.1f} ms, in place (/reset + /health) p50 {median(inplace) * 1e3:.1f} ms "
              f"(n={args.resets})", flush=True)
        shots = {}
        for name, f in (("720p", fleet), ("1080p", big)):
            d = await f.start()
            try:
                for fmt, times in (await bench_screenshots(d, args.shots)).items():
                    shots[f"{name}_{fmt}"] = median(times)
                if name == "720p":
                    action = await bench_actions(d, args.actions)
                    noop = await bench_actions(d, args.actions, ["true"])
            finally:
                await f.remove(d)
        print("screenshot p50: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in shots.items()), flush=True)
        print(f"action (xdotool click via /execute) p50 {median(action) * 1e3:.1f} ms; /execute of `true` "
              f"p50 {median(noop) * 1e3:.1f} ms", flush=True)
        steps, reason = await probe(capacity, [args.max_desktops], window_s=args.window_s,
                                    min_free_gb=args.min_free_gb, log=lambda line: print(line, flush=True))
        live, ram = (steps[-1].healthy, steps[-1].ram_mb) if steps else (0, float("nan"))
        print(f"live desktops: {live} healthy (stopped at: {reason}), RAM {ram:.0f} MiB per desktop", flush=True)
        fig = {"start_p50_s": median(start), "start_p95_s": p95(start), "reset_cold_p50_s": median(cold),
               "reset_cold_pool_p50_s": median(cold_pool), "reset_warm_p50_s": median(warm), "ratio_cold_over_warm": median(cold) / median(warm),
               "reset_inplace_p50_s": median(inplace), "ratio_cold_over_inplace": median(cold) / median(inplace)}
        fig.update({f"shot_{k}_p50_ms": v * 1e3 for k, v in shots.items()})
        fig.update({"action_p50_ms": median(action) * 1e3, "exec_noop_p50_ms": median(noop) * 1e3, "live_desktops": live, "live_cap": args.max_desktops,
                    "ram_per_desktop_mb": ram})
    finally:
        removed = await fleet.remove_all()
        print(f"removed {removed} leftover containers of {run_id}", flush=True)
        await fleet.close()
        await big.close()
        await capacity.close()
    return fig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke run: at most 3 starts, 4 resets, 10 shots and actions; capacity cap 16")
    p.add_argument("--image", default="", help="desktop image (default: build / reuse the profile's image)")
    p.add_argument("--profile", choices=("default", "osworld"), default="default",
                   help="which image to measure (osworld: image size, start, RAM with LibreOffice, reset)")
    p.add_argument("--app", choices=sorted(APPS), default="calc",
                   help="--profile osworld: the app opened for RAM and before each reset (calc or vscode)")
    p.add_argument("--memory-mb", type=int, default=2048, help="desktop memory limit for --profile osworld")
    p.add_argument("--settle-s", type=float, default=5.0,
                   help="seconds before a RAM sample in --profile osworld (idle, and after Calc's window)")
    p.add_argument("--starts", type=int, default=10, help="desktops started one by one for start p50/p95")
    p.add_argument("--resets", type=int, default=10, help="resets measured, cold and warm")
    p.add_argument("--spares", type=int, default=2, help="warm spares for the warm reset")
    p.add_argument("--shots", type=int, default=30, help="screenshots per resolution and format")
    p.add_argument("--actions", type=int, default=30, help="xdotool clicks measured")
    p.add_argument("--max-desktops", type=int, default=64, help="cap for the live-desktop capacity probe")
    p.add_argument("--live", type=_counts, default=[], metavar="N[,N...]",
                   help="only the live probe: grow to each N desktops in turn (e.g. 32,64,128,256)")
    p.add_argument("--concurrency", type=int, default=4,
                   help="desktops booting at once in the capacity and live probes (actors.max_concurrent_starts)")
    p.add_argument("--window-s", type=float, default=20.0, help="idle window for CPU per desktop, seconds")
    p.add_argument("--min-free-gb", type=float, default=2.0, help="stop the capacity probe below this MemAvailable")
    args = p.parse_args(argv)
    if args.quick:  # smaller values given with --quick are kept (the CI smoke test gives 2s)
        args.starts, args.resets = min(args.starts, 3), min(args.resets, 4)
        args.shots, args.actions = min(args.shots, 10), min(args.actions, 10)
        args.max_desktops = min(args.max_desktops, 16)
        args.window_s = min(args.window_s, 5.0)
    return args


def _counts(text: str) -> list[int]:
    """``--live``'s value: positive desktop counts separated by commas."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected desktop counts such as 32,64,128, got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    fig = asyncio.run(main_async(args))
    print(result_line(fig))
    return 0


if __name__ == "__main__":
    sys.exit(main())
