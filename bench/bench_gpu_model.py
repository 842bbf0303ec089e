"""Async against lockstep where the GPUs are: trajectories per minute and GPU busy fractions under a GPU timing model.

What runs, in one process: N real `EnvActor`s (real `EpisodeRunner`, UI-TARS prompt, `PromptEncoder`, reply
parser, evaluator) with the real `LearnerLink` over a real DEALER socket, and the real learner: ROUTER socket,
`LearnerService` (admission by `LockstepAdmission` or `StalenessManager`), `GroupScheduler`, `Batcher` with the
success replay, the groups queue and `TrainingLoop` (both schedules, `updates_per_batch` optimizer steps per batch).
Where the GPUs and desktops would be, bench/gpu_stand_ins.py and bench/desktop_stand_ins.py put modelled ones (wired
with the real stack, one schedule at a time, by bench/modelled_schedule.py), timed by bench/gpu_timing.toml
(bench/gpu_model.py): SGLang servers on H100s (continuous batching, prefill per token, decode per iteration as a
function of the running batch, a KV cache bound, the radix cache holding each episode's prefix), FSDP training on
8 H100s (seconds per optimizer step from the tokens), the NCCL weight sync, and in-process desktops with
OSWorld-like episodes (1-15 steps, heavy-tailed; app actions 0.3-3 s). Modelled time runs ``time_scale`` times
faster than real time; every figure below is in modelled time.

Schedules (learner.schedule / learner.max_staleness, ARPO's shape: G = 8, 16 groups = 128 trajectories per batch,
2 optimizer steps per batch): lockstep (our learner.schedule = "lockstep": one rollout batch out, all back, train,
publish; within the round each episode runs at its own pace), arpo (the same rounds with ARPO's own rollout loop
inside them: every step of the round's episodes is one generation batch and then one action on every desktop, each
waiting for its slowest, gpu_stand_ins.StepBarrier; it needs a desktop per trajectory of the batch, as ARPO has,
and a round stuck for 300 s stops the run with the barrier's message),
one-step-off (async, eta 1) and async (eta 2 and 4; AReaL's admission rule). Per schedule, over a window after a
warm-up:
  traj/min         trajectories the learner received per modelled minute
  inference busy   modelled GPU seconds the servers iterated / (servers x window)
  training busy    modelled seconds of training batches (and weight syncs) in the window / window
  ideal            min(rollout capacity, training capacity) from this run's own per-trajectory costs:
                   rollout = min(desktops / desktop seconds per trajectory without inference waits,
                                 servers / inference GPU seconds per trajectory at a full KV cache);
                   training = 1 / training seconds (batches + syncs) per trajectory trained
CPU check: the real stack's CPU must stay small against the scaled GPU time; the run prints this process's CPU
use (cores), its event-loop lag p50/p99 in modelled milliseconds (against a decode iteration of >= 5 ms) and how
much longer than modelled the app actions took ("act x": late wake-ups, e.g. other processes holding the cores).

Real desktops (``--real-desktops N``, issue 26 item 3's "64 real desktops"): the in-process desktops give way to N
real docker desktops, the product's DesktopPool over its DesktopFleet built from the run config as arpo-actors
builds it (actors.main.desktop_pool: the run's image, 1280x720), booted once and shared by every schedule; the GPU
side stays modelled. Modelled time is real time (run.time_scale = 1; another scale is refused). Each app action's
xdotool click and the screenshot that observes it run for real, then sleep up to the action's modelled length
(desktop_stand_ins.PaddedController); an action whose real part took longer is not padded and is counted ("late", the
share of actions). Episode lengths and the evaluator's answer stay drawn from the model (the evaluator's getter is
answered in the bench); the reset between episodes is the real in-place reset (POST /reset, its median printed;
desktops are never retired, so no container boots during a measurement). Extra columns: late, the real click +
screenshot's p50 ("work"), each part's p50, the reset's p50. Every container is removed at the end, on an error,
Ctrl-C or SIGTERM.

Last line: ``async_over_lockstep=... achieved_over_ideal=...`` (the best async schedule against lockstep, and its
achieved / ideal), ``best``, ``async_over_arpo`` (the same schedule against arpo, when arpo ran), then the
per-schedule figures (with real desktops: ``desktop_label`` and each schedule's
``act_x``, ``late_share``, ``work_p50_ms``, ``click_p50_ms``, ``shot_p50_ms``, ``reset_p50_ms``).

    python -m bench.bench_gpu_model                  # 1,024 desktops, 5 schedules (about 15 minutes)
    python -m bench.bench_gpu_model --quick          # smoke: 32 desktops, batches of 2 groups, short windows
    python -m bench.bench_gpu_model --schedules lockstep,eta2 --warmup 300 --window 900 --sensitivity
                                                     # + each parameter halved and doubled (about an hour)
    python -m bench.bench_gpu_model ... --sensitivity --sensitivity-params training.gpus,episode.action_s
    python -m bench.bench_gpu_model --set inference.servers=2 --set run.time_scale=10
    python -m bench.bench_gpu_model --real-desktops 64 --schedules lockstep,eta2,eta4 --warmup 120 --window 360
                                                     # 64 docker desktops (about 30 minutes)
    python -m bench.bench_gpu_model --real-desktops 2 --quick --schedules lockstep,eta2   # smoke (CI, ~100 s)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import multiprocessing as mp
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

from arpo_async.process import run_until_signal
from bench._common import desktop_png, result_line
from bench.bench_actor_loop import _make_model
from bench.desktop_stand_ins import PaddedPool
from bench.gpu_model import DEFAULT_PATH, GpuTimingModel, load_model
from bench.gpu_stand_ins import BarrierStalled
from bench.modelled_schedule import SCHEDULES, SYNCHRONOUS, Result, run_config, run_schedule

NEVER_RETIRED = 1_000_000
"""actors.desktop_max_episodes with real desktops: every episode reuses its desktop (an in-place reset), so no
container boots during a measurement."""
REAL_STARTS_AT_ONCE = 4
"""actors.max_concurrent_starts for the real desktops' boot (bench_desktops --live: 64 in ~96 s at 4)."""
FILL_TIMEOUT_S = 120.0
"""Seconds to have every real desktop back as a reset spare between schedules (the boot adds 10 s a desktop)."""
SENSITIVITY = [("inference", "prefill_s_per_token"), ("inference", "image_token_factor"),
               ("inference", "decode_base_s"), ("inference", "decode_s_per_context_token"),
               ("inference", "kv_cache_tokens"), ("inference", "servers"), ("training", "tokens_per_s_per_gpu"),
               ("training", "logprob_forward_fraction"), ("training", "step_overhead_s"),
               ("training", "weight_sync_s"), ("episode", "action_s"), ("episode", "budget_share"),
               ("episode", "length_alpha")]
"""(section, parameter) rows of the ``--sensitivity`` table: each is run halved and doubled."""


def print_results(results: list[Result], real: bool = False) -> None:
    """One table row per schedule (a header first), flushed at once so a long run shows its progress. ``real``
    adds the real desktops' columns: late actions (share), an action's real click + screenshot p50, and of each
    part, /reset p50."""
    print(f"{'schedule':<10}{'traj/min':>9}{'ideal':>8}{'ach/ideal':>10}{'rollout cap':>12}{'train cap':>10}"
          f"{'infer busy':>11}{'train busy':>11}{'lag':>6}{'cores':>7}{'loop lag p50/p99':>17}{'act x':>7}{'load':>6}"
          + (f"{'late':>6}{'work p50':>10}{'click/shot p50':>16}{'reset p50':>10}" if real else ""))
    for r in results:
        print(f"{r.name:<10}{r.traj_per_min:>9.1f}{r.ideal_per_min:>8.1f}{r.achieved_over_ideal:>10.3f}"
              f"{r.rollout_per_min:>12.1f}{r.training_per_min:>10.1f}{r.inference_busy:>11.3f}"
              f"{r.training_busy:>11.3f}{r.staleness_mean:>6.2f}{r.cpu_cores:>7.2f}"
              f"{r.lag_p50_modelled_ms:>8.0f}/{r.lag_p99_modelled_ms:<6.0f}ms{r.action_inflation:>7.2f}"
              f"{r.load:>6.1f}"
              + (f"{r.late_share:>6.2f}{1e3 * r.work_p50_s:>8.0f}ms{1e3 * r.click_p50_s:>9.0f}/"
                 f"{1e3 * r.shot_p50_s:<4.0f}ms{1e3 * r.reset_p50_s:>8.0f}ms" if real else ""),
              flush=True)


async def fill(pool, n: int, timeout_s: float) -> float:
    """Bring the started DesktopPool ``pool`` (warm_spares = 0) to ``n`` booted, reset spares: take ``n``
    desktops (booting the missing ones), give them back (each is reset in place) and wait for the resets.
    Returns the seconds it took. Raises TimeoutError after ``timeout_s``, DesktopError when starts fail."""
    started = time.monotonic()
    async with asyncio.timeout(timeout_s):
        taken = await asyncio.gather(*(pool.acquire() for _ in range(n)))
        for desktop in taken:
            await pool.release(desktop)
        await pool.wait_spares(n)
    return time.monotonic() - started


async def real_desktop_run(names: list[str], model: GpuTimingModel, encoder, *, desktops: int, run_id: str,
                           warmup_s: float, window_s: float, groups_per_step: int, out: dict[str, Result]) -> None:
    """Each schedule in ``names`` on the same ``desktops`` real docker desktops (the product's DesktopPool, as
    arpo-actors builds it from the run config: the run's image, 1280x720; no warm spares, episodes reset in
    place, never retired; Docker label ``arpo.run=<run_id>``), filled into ``out`` as they finish. Every container
    it started is removed in ``finally`` (also when cancelled: Ctrl-C, SIGTERM), then any left with the label."""
    from actors.main import desktop_pool

    config = run_config("lockstep", 0, desktops, "tcp://127.0.0.1:1", groups_per_step, model.episode.max_steps, (
        f'run_id="{run_id}"', "actors.warm_spares=0", f"actors.desktop_max_episodes={NEVER_RETIRED}",
        f"actors.max_concurrent_starts={REAL_STARTS_AT_ONCE}"))
    pool = desktop_pool(config)
    try:
        async with pool:
            boot_s = await fill(pool, desktops, FILL_TIMEOUT_S + desktops * 10.0)
            print(f"{desktops} desktops of {pool.fleet.image} (label arpo.run={run_id}) booted in {boot_s:.0f} s; "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
            padded = PaddedPool(pool, model.episode)
            for name in names:
                gc.collect()
                out[name] = await run_schedule(name, model, encoder, [], actors=desktops, warmup_s=warmup_s,
                                               window_s=window_s, groups_per_step=groups_per_step,
                                               desktops=padded)
                print_results([out[name]], real=True)
                await fill(pool, desktops, FILL_TIMEOUT_S)
    finally:
        try:
            left = await pool.fleet.remove_all()
        finally:
            await pool.fleet.close()
        print(f"desktop pool: {dict(pool.stats)}; {left} left over and removed", flush=True)


def headline(results: dict[str, Result]) -> tuple[str, float, float]:
    """(best async schedule, its traj/min over lockstep's, its achieved / ideal)."""
    best = max((n for n in results if n not in SYNCHRONOUS), key=lambda n: results[n].traj_per_min)
    return best, results[best].traj_per_min / results["lockstep"].traj_per_min, results[best].achieved_over_ideal


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke mode: 32 desktops, short windows")
    parser.add_argument("--actors", type=int, default=None, help="desktops (default 1024; 32 with --quick)")
    parser.add_argument("--real-desktops", type=int, default=0, metavar="N",
                        help="N real docker desktops instead of the in-process ones (time scale 1; warm-up 120 s "
                        "and window 300 s by default, 10 s and 30 s with --quick)")
    parser.add_argument("--model-file", type=Path, default=DEFAULT_PATH, help="the timing model (TOML)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one model parameter (repeatable)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated subset of "
                        + ", ".join(SCHEDULES))
    parser.add_argument("--groups-per-step", type=int, default=None,
                        help="groups of 8 per training batch (default 16, ARPO's; 2 with --quick)")
    parser.add_argument("--warmup", type=float, default=None, help="modelled warm-up seconds per schedule")
    parser.add_argument("--window", type=float, default=None, help="modelled seconds measured per schedule")
    parser.add_argument("--sensitivity", action="store_true",
                        help="also run the schedules with each parameter halved and doubled (the best async one "
                        "against each synchronous one)")
    parser.add_argument("--sensitivity-params", default=None, metavar="SECTION.KEY,...",
                        help="only these rows of the sensitivity table (default: all)")
    parser.add_argument("--sensitivity-window", type=float, nargs=2, default=(300.0, 900.0),
                        metavar=("WARMUP", "WINDOW"), help="modelled seconds per sensitivity run (default 300 900)")
    args = parser.parse_args(argv)
    # Lockstep keeps most actors waiting for work longer than transport.resend_after_s (30 real seconds): the link
    # re-sends those requests, the learner answers a repeat with the same assignment, and an answer that crosses
    # the first one is logged as "assignment for unknown request" (harmless: the slot is already running).
    logging.getLogger("actors.link").setLevel(logging.ERROR)
    real = args.real_desktops
    model = load_model(args.model_file, (["run.time_scale=1"] if real else []) + args.overrides)
    if real and model.time_scale != 1:
        parser.error(f"--real-desktops runs at run.time_scale = 1 (the desktops' actions take real time), not "
                     f"{model.time_scale:g}: drop the --set run.time_scale override")
    if real and (args.sensitivity or args.actors):
        parser.error("--real-desktops: no --sensitivity, and N replaces --actors")
    actors = real or args.actors or (32 if args.quick else 1024)
    warmup_s = args.warmup if args.warmup is not None else (
        (10.0 if args.quick else 120.0) if real else (60.0 if args.quick else 900.0))
    window_s = args.window if args.window is not None else (
        (30.0 if args.quick else 300.0) if real else (120.0 if args.quick else 2400.0))
    groups = args.groups_per_step or (2 if args.quick else 16)
    names = [n.strip() for n in args.schedules.split(",") if n.strip()]
    if not names or set(names) - set(SCHEDULES) or "lockstep" not in names or not set(names) - set(SYNCHRONOUS):
        asynchronous = ", ".join(n for n in SCHEDULES if n not in SYNCHRONOUS)
        parser.error(f"--schedules: lockstep and at least one of {asynchronous} (arpo may be added)")
    if "arpo" in names and actors < groups * 8:
        parser.error(f"--schedules arpo: ARPO's step-synchronous rounds run one desktop per trajectory of the batch: "
                     f"{groups * 8} desktops for {groups} groups of 8, not {actors}")

    with tempfile.TemporaryDirectory(prefix="bench-gpu-model-") as tmp:
        maker = mp.get_context("spawn").Process(target=_make_model, args=(str(Path(tmp) / "tiny"),))
        maker.start()  # the tokenizer's model folder, made in a child (bench_actor_loop does the same)
        maker.join()
        if maker.exitcode != 0:
            raise RuntimeError(f"creating the tiny model failed (exit code {maker.exitcode})")
        from arpo_async.model.inputs import PromptEncoder

        encoder = PromptEncoder(Path(tmp) / "tiny")
    pngs = [desktop_png(i) for i in range(16)]
    print(f"{actors} {'real docker' if real else 'in-process'} desktops, time scale {model.time_scale:g}x, warm-up "
          f"{warmup_s:g} s + window {window_s:g} s modelled per schedule; batches of {groups} groups of 8; "
          f"{model.inference.servers} inference server(s), {model.training.gpus} training GPUs; {os.cpu_count()} CPUs "
          "(load: 1-minute load average)", flush=True)

    def measure(m: GpuTimingModel, which: list[str], warmup: float, window: float) -> dict[str, Result]:
        out = {}
        for name in which:
            gc.collect()
            out[name] = asyncio.run(run_schedule(name, m, encoder, pngs, actors=actors, warmup_s=warmup,
                                                 window_s=window, groups_per_step=groups))
            print_results([out[name]])
        return out

    label = f"bench-gpu-{uuid.uuid4().hex[:6]}"  # the real desktops' arpo.run label
    if real:
        results: dict[str, Result] = {}
        run = real_desktop_run(names, model, encoder, desktops=real, run_id=label, warmup_s=warmup_s,
                               window_s=window_s, groups_per_step=groups, out=results)
        rc = run_until_signal(run, "bench_gpu_model")
        if rc or set(results) != set(names):
            print(f"stopped after {len(results)} of {len(names)} schedules (exit code {rc})", file=sys.stderr)
            return 1
    else:
        results = measure(model, names, warmup_s, window_s)
    best, ratio, achieved = headline(results)
    print(f"best async schedule: {best}: {ratio:.2f}x lockstep's trajectories/min, achieved / ideal "
          f"{achieved:.3f}; radix cache hits {results[best].cached_share:.0%} of prompt tokens")
    if args.sensitivity:
        synchronous = [n for n in names if n in SYNCHRONOUS]
        print(f"sensitivity: {best} / {' and '.join(synchronous)} trajectories per minute with one parameter scaled "
              f"(each run: {', '.join(names)})")
        print(f"{'parameter':<38}" + "".join(f"{n + ' x0.5':>14}{'x2':>6}" for n in synchronous))
        rows = ([tuple(p.strip().split(".", 1)) for p in args.sensitivity_params.split(",")]
                if args.sensitivity_params else SENSITIVITY)
        for section, key in rows:
            ratios: dict[str, list[float]] = {n: [] for n in synchronous}
            for factor in (0.5, 2.0):
                m = (model.scaled("episode", "action_s_min", factor).scaled("episode", "action_s_max", factor)
                     if key == "action_s" else model.scaled(section, key, factor))
                r = measure(m, names, *args.sensitivity_window)
                for n in synchronous:
                    ratios[n].append(r[best].traj_per_min / r[n].traj_per_min)
            print(f"{section + '.' + key:<38}" + "".join(f"{lo:>14.2f}{hi:>6.2f}" for lo, hi in ratios.values()),
                  flush=True)
    figures: dict[str, float | str] = {"async_over_lockstep": ratio, "achieved_over_ideal": achieved, "best": best}
    if "arpo" in results:
        figures["async_over_arpo"] = results[best].traj_per_min / results["arpo"].traj_per_min
        print(f"{best} against ARPO's step-synchronous loop (arpo): {figures['async_over_arpo']:.2f}x")
    if real:
        figures["desktop_label"] = label
    for name, r in results.items():
        figures[f"{name}_traj_per_min"] = r.traj_per_min
        figures[f"{name}_infer_busy"] = r.inference_busy
        figures[f"{name}_train_busy"] = r.training_busy
        figures[f"{name}_over_ideal"] = r.achieved_over_ideal
        if real:
            figures[f"{name}_act_x"] = r.action_inflation
            figures[f"{name}_late_share"] = r.late_share
            figures[f"{name}_work_p50_ms"] = 1e3 * r.work_p50_s
            figures[f"{name}_click_p50_ms"] = 1e3 * r.click_p50_s
            figures[f"{name}_shot_p50_ms"] = 1e3 * r.shot_p50_s
            figures[f"{name}_reset_p50_ms"] = 1e3 * r.reset_p50_s
    print(result_line(figures))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BarrierStalled as stalled:  # an arpo round that never passed a step: no figure to report
        sys.exit(f"bench_gpu_model: {stalled}")
