"""Learning benchmark: success rate against wall-clock time on the button-grid families, real desktops.

Arms (each a real `arpo run`: arpo-serve + arpo-learner + arpo-actors with 8 docker desktops):
  a  async, decoupled-PPO off-policy correction, prioritized success replay
  b  async, decoupled-PPO correction, no replay
  c  lockstep with ARPO's recipe (synchronous batches, no correction, ARPO's FIFO replay)

The task is posed as ARPO poses it, scaled to a tiny random policy on a 2-core machine: the family's tasks
(`grid4-*`: 4 large buttons, the label to click differs per task; `grid8-*`: 8 buttons), one click per episode,
the action grammar restricted to `click`. A run's success rate at a step is the fraction of SUCCESS among the
trainable trajectories the learner received since the previous step (behaviour policy, temperature 1).

`--family` names the tasks: a family of the built-in suite (`grid4`, `grid8`: all its tasks), one task id
(`grid4-green`: that task alone), or a folder of OSWorld task files (every task in it, as `learner.tasks`; e.g.
`tests/data/tasks/shapes`, four buttons with other labels, to check the recipe is not tuned to grid4's colours).
Run folders, the plot and the figures file are named after the family, the task id, or the folder's name.

Usage:
  python -m bench.bench_learning --quick                    # one short seed per arm (about 15 minutes)
  python -m bench.bench_learning --seeds 3 --minutes 15     # the full run (about 2.5 hours)
  python -m bench.bench_learning --family grid8 --arms a,b  # does replay help the 8-button family?
  python -m bench.bench_learning --quick --family tests/data/tasks/shapes  # another 4-button family (a folder)
  python -m bench.bench_learning --quick --model runs/tiny-std002 --init-std 0.02  # transformers' weight spread

Prints a table, saves a PNG plot, and as its last line key=value figures: per arm the median time to the
target success (s; `inf` if never reached) and the median final success (mean of the last 3 steps), and the
ratio of arm c's time to arm a's.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from arpo_async.metrics import read_metrics, training_records
from bench._arpo_run import ROOT, ensure_model, run_arpo
from tests.learning_arms import ARMS, TASK_SETUP, check_tasks, task_selection

def run_arm(arm: str, family: str, seed: int, minutes: float, out: Path, model: Path, target: float,
            extra: tuple[str, ...] = (), selection: list[str] | None = None) -> list[dict]:
    """Run one arm for ``minutes`` (or until it holds ``target`` + 0.1 success for 3 steps); returns its trained
    batches' metrics records.
    ``family``: the name from :func:`task_selection` (run folder ``<family>-<arm>-seed<seed>``); ``selection``: its
    task overrides (default: the family's own, from ``task_selection(family)``).
    ``extra``: more `--set` overrides for every arm (after the task setup, so they win)."""
    if selection is None:
        family, selection = task_selection(family)
    run_dir = out / f"{family}-{arm}-seed{seed}"
    if (run_dir / "metrics.jsonl").exists():
        print(f"reusing finished run {run_dir}", flush=True)
        return training_records(read_metrics(run_dir / "metrics.jsonl"))

    def solved(run_dir: Path) -> bool:
        records = training_records(read_metrics(run_dir / "metrics.jsonl"))
        return len(records) >= 3 and all(r["success_rate"] >= min(target + 0.1, 0.98) for r in records[-3:])

    overrides = TASK_SETUP + ARMS[arm][1] + [*selection, f"learner.seed={seed}", *extra]
    run_arpo(run_dir, model, overrides, minutes, solved)
    return training_records(read_metrics(run_dir / "metrics.jsonl"))  # a solved run's evaluation record aside


def smoothed(records: list[dict], window: int = 3) -> list[tuple[float, float]]:
    """(wall_s, trailing mean of success_rate over ``window`` steps) per step."""
    out = []
    for i, r in enumerate(records):
        recent = [x["success_rate"] for x in records[max(0, i - window + 1): i + 1]]
        out.append((r["wall_s"], sum(recent) / len(recent)))
    return out


def time_to(records: list[dict], target: float) -> float:
    """First wall-clock second at which the smoothed success reaches ``target``; inf if never."""
    return next((t for t, s in smoothed(records) if s >= target), math.inf)


def final_success(records: list[dict]) -> float:
    return statistics.fmean(r["success_rate"] for r in records[-3:]) if records else 0.0


def plot(results: dict[str, list[list[dict]]], family: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (arm, runs), color in zip(results.items(), ("tab:blue", "tab:orange", "tab:green")):
        for i, records in enumerate(runs):
            points = smoothed(records)
            ax.plot([t / 60 for t, _ in points], [s for _, s in points], color=color, alpha=0.9 if i == 0 else 0.4,
                    label=f"{arm}: {ARMS[arm][0]}" if i == 0 else None)
    ax.set_xlabel("wall-clock minutes")
    ax.set_ylabel("success rate (trailing 3 steps)")
    ax.set_ylim(0, 1)
    ax.set_title(f"{family}: success vs time, 8 desktops, 2 CPU cores")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one short seed per arm")
    parser.add_argument("--family", default="grid4",
                        help="the tasks: a built-in family (grid4: 4 buttons, grid8: 8 buttons), one task id such as "
                             "grid4-green, or a folder of OSWorld task files (all its tasks, e.g. "
                             "tests/data/tasks/shapes)")
    parser.add_argument("--arms", default="a,b,c", help="comma-separated subset of a,b,c")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--minutes", type=float, default=15.0, help="wall-clock budget per run")
    parser.add_argument("--target", type=float,
                        help="success to time (default 0.5 for grid8 and its tasks, else 0.8)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-learning")
    parser.add_argument("--model", type=Path, default=ROOT / "runs" / "tiny-model",
                        help="policy folder; created when missing (tiny random policy)")
    parser.add_argument("--init-std", type=float, help="when --model is created: spread of its random weights")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="extra config override for every arm, e.g. --set learner.lr=3e-3 (repeatable; use a "
                             "fresh --out, finished runs in --out are reused)")
    args = parser.parse_args()
    try:
        import matplotlib  # noqa: F401  (checked now, not after an hour of runs)
    except ImportError:
        parser.error("the plot needs matplotlib: pip install -e '.[bench]'")
    seeds = 1 if args.quick else args.seeds
    minutes = min(args.minutes, 6.0) if args.quick else args.minutes
    family, selection = task_selection(args.family)
    target = args.target if args.target is not None else (0.5 if family.startswith("grid8") else 0.8)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"unknown arms {unknown}; choose from {sorted(ARMS)}")
    try:  # now, not after the model is made and the first arm has run
        tasks = check_tasks(selection)
    except ValueError as e:  # a bad task file or folder, or no task of that family / id
        parser.error(f"--family {args.family}: {e}")
    if args.init_std is not None and not args.init_std > 0:
        parser.error("--init-std must be > 0")
    args.out.mkdir(parents=True, exist_ok=True)
    ensure_model(args.model, init_std=args.init_std)
    print(f"{family}: {len(tasks)} tasks ({', '.join(t.id for t in tasks)})", flush=True)

    results: dict[str, list[list[dict]]] = {}
    for arm in arms:
        for seed in range(seeds):
            print(f"arm {arm} ({ARMS[arm][0]}), {family}, seed {seed}: up to {minutes:g} min", flush=True)
            results.setdefault(arm, []).append(run_arm(arm, family, seed, minutes, args.out, args.model, target,
                                                      tuple(args.overrides), selection))

    figures: dict[str, str] = {}
    tag = f"t{int(target * 100)}"
    print(f"\n{'arm':<4}{'description':<42}{'steps':>6}{tag + ' (s)':>10}{'final':>8}{'traj/min':>10}")
    for arm, runs in results.items():
        times = [time_to(r, target) for r in runs]
        finals = [final_success(r) for r in runs]
        rates = [r[-1]["totals"].get("trajectories", 0) / (r[-1]["wall_s"] / 60) for r in runs if r]
        t_med, f_med = statistics.median(times), statistics.median(finals)
        print(f"{arm:<4}{ARMS[arm][0]:<42}{statistics.median(len(r) for r in runs):>6.0f}{t_med:>10.0f}"
              f"{f_med:>8.2f}{statistics.median(rates) if rates else 0:>10.1f}")
        figures[f"{arm}_{tag}_s"] = f"{t_med:.0f}"
        figures[f"{arm}_final"] = f"{f_med:.2f}"
    if "a" in results and "c" in results:
        ta, tc = statistics.median(time_to(r, target) for r in results["a"]), \
            statistics.median(time_to(r, target) for r in results["c"])
        figures[f"ratio_c_over_a_{tag}"] = f"{tc / ta:.2f}" if math.isfinite(ta) and math.isfinite(tc) else "nan"
    png = args.out / f"learning-{family}.png"
    plot(results, family, png)
    (args.out / f"learning-{family}.json").write_text(json.dumps(figures, indent=2))
    print(f"plot: {png}")
    print(" ".join(f"{k}={v}" for k, v in figures.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
