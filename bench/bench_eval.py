"""bench_eval.py: `arpo eval` throughput on this machine, with real desktops and the tiny policy on arpo-serve.

For each desktop count in ``--desktops`` (default 1, 8, 32) it runs the real command, ``arpo eval --model
<tiny policy> --tasks <--tasks> --desktops N --repeats R`` (R chosen so there are at least ``--per-desktop``
episodes per desktop), ``--runs`` times, and reads each run's report.json ``throughput`` (measured from the
evaluation's start, so desktop boots are included):

- episodes per minute;
- desktop_busy: achieved over ideal, the desktop-seconds spent in episodes (reset + setup + steps + evaluation)
  over desktops x wall seconds (1.0 = no desktop ever idle);
- scaling: episodes per minute over N x the 1-desktop figure of the same invocation (the baseline, measured
  first).

Prints the medians per N, then as its LAST line ``key=value`` figures. ``--quick`` (the smoke mode CI runs):
grid4 only, 1 and 2 desktops, one run each.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

from bench._common import median, result_line

from arpo_async.model.init_model import create_tiny_model
from arpo_async.task_sets import load_task_set

ROOT = Path(__file__).resolve().parent.parent


def one_run(model: Path, tasks: str, desktops: int, repeats: int, max_steps: int, out: Path) -> dict:
    """One `arpo eval` run; its report's throughput. Raises RuntimeError with the output's tail on failure."""
    cmd = [sys.executable, "-m", "arpo_cli", "eval", "--model", str(model), "--tasks", tasks, "--desktops",
           str(desktops), "--repeats", str(repeats), "--max-steps", str(max_steps), "--temperature", "1",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    report = json.loads((out / "report.json").read_text())
    return {**report["throughput"], "errors": len(report["errors"])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--desktops", default="1,8,32", help="desktop counts, comma-separated; the first is the baseline")
    p.add_argument("--tasks", default="builtin", help="task folder or built-in name (default: every built-in task)")
    p.add_argument("--per-desktop", type=int, default=4, help="at least this many episodes per desktop (default 4)")
    p.add_argument("--max-steps", type=int, default=3, help="policy steps per episode (default 3)")
    p.add_argument("--runs", type=int, default=3, help="runs per desktop count (default 3)")
    p.add_argument("--quick", action="store_true", help="smoke mode: grid4, 1 and 2 desktops, one run")
    args = p.parse_args(argv)
    if args.quick:
        args.desktops, args.tasks, args.runs, args.per_desktop = "1,2", "grid4", 1, 2
    counts = [int(n) for n in args.desktops.split(",")]
    n_tasks = len(load_task_set(args.tasks))
    figures: dict[str, float | int | str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-eval-") as tmp:
        model = create_tiny_model(Path(tmp) / "tiny")
        base = None
        for n in counts:
            repeats = max(1, math.ceil(args.per_desktop * n / n_tasks))
            runs = [one_run(model, args.tasks, n, repeats, args.max_steps, Path(tmp) / f"d{n}-r{i}")
                    for i in range(args.runs)]
            rate = median(r["episodes_per_min"] for r in runs)
            busy = median(r["desktop_busy"] for r in runs)
            base = rate if base is None else base
            scaling = rate / (base * n / counts[0])
            each = ", ".join(f"{r['episodes_per_min']:.1f}" for r in runs)
            print(f"desktops={n}: {n_tasks * repeats} episodes/run, episodes/min median {rate:.1f} "
                  f"(runs: {each}), desktop_busy median "
                  f"{busy:.3f}, scaling over {counts[0]} desktop(s) {scaling:.3f}, errors "
                  f"{sum(r['errors'] for r in runs)}", flush=True)
            figures.update({f"d{n}_episodes_per_min": rate, f"d{n}_desktop_busy": busy, f"d{n}_scaling": scaling})
    print(result_line(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
