"""End-to-end throughput: async vs lockstep schedule on the same desktops and the same arpo-serve.

Both arms are real `arpo run`s (arpo-serve + arpo-learner + arpo-actors, 8 docker desktops) over the whole
built-in suite with a 5-step budget, so episode lengths are mixed (the agent may say `finished` at any step;
tasks differ in setup cost). Each arm runs for the same wall-clock budget. Figures per arm:
  trajectories/min    trajectories the learner received per minute, in the steady state (from the first
                      trajectory on; start-up and the first desktop boots are left out)
  desktop utilisation sum of episode seconds / (desktops x seconds) over the same span; an episode runs from
                      the task's setup to its evaluation, so desktop resets are outside it
and the ratio async / lockstep of both (target from issue 4: >= 3x trajectories/min).

Usage: python bench/bench_e2e.py [--minutes 5] [--actors 8] [--quick]
Last line: key=value figures.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._arpo_run import ROOT, ensure_model, run_arpo  # noqa: E402

SCHEDULES = {
    "async": ['learner.schedule="async"', "learner.max_staleness=2"],
    "lockstep": ['learner.schedule="lockstep"'],
}


def read_status(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def measure(schedule: str, args: argparse.Namespace) -> dict[str, float]:
    """One arm: sample the learner's status.json every 2 s; the figures cover the steady state, from the first
    sample with a trajectory to the last sample (start-up, model load and first desktop boots left out)."""
    run_dir = args.out / schedule
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = SCHEDULES[schedule] + [f"actors.actors={args.actors}", "actors.max_steps=5", "learner.steps=100000",
                                       "learner.group_size=4", "learner.groups_per_step=2"]
    samples: list[dict] = []

    def sample(run_dir: Path) -> bool:
        status = read_status(run_dir)
        if status and status.get("totals", {}).get("trajectories", 0) > 0:
            samples.append(status)
        return False

    run_arpo(run_dir, args.model, overrides, args.minutes, sample)
    if len(samples) < 2:
        raise SystemExit(f"{schedule}: fewer than 2 status samples with trajectories; see {run_dir}.out")
    first, last = samples[0], samples[-1]
    span_s = last["wall_s"] - first["wall_s"]
    done = last["totals"]["trajectories"] - first["totals"]["trajectories"]
    busy = last["totals"].get("desktop_busy_s", 0.0) - first["totals"].get("desktop_busy_s", 0.0)
    return {"traj_per_min": done / (span_s / 60), "utilisation": busy / (args.actors * span_s),
            "steps": last.get("step", 0), "span_s": span_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="wall-clock budget per arm")
    parser.add_argument("--actors", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="2 minutes per arm")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-e2e")
    parser.add_argument("--model", type=Path, default=ROOT / "runs" / "tiny-model")
    args = parser.parse_args()
    if args.quick:
        args.minutes = min(args.minutes, 2.0)
    ensure_model(args.model)
    results = {s: measure(s, args) for s in SCHEDULES}
    print(f"{'schedule':<10}{'traj/min':>10}{'utilisation':>13}{'steps':>7}{'span s':>8}")
    for s, r in results.items():
        print(f"{s:<10}{r['traj_per_min']:>10.1f}{r['utilisation']:>13.2f}{r['steps']:>7}{r['span_s']:>8.0f}")
    a, l = results["async"], results["lockstep"]
    ratio = a["traj_per_min"] / l["traj_per_min"] if l["traj_per_min"] else float("nan")
    util_ratio = a["utilisation"] / l["utilisation"] if l["utilisation"] else float("nan")
    print(f"async_traj_per_min={a['traj_per_min']:.1f} lockstep_traj_per_min={l['traj_per_min']:.1f} "
          f"async_utilisation={a['utilisation']:.2f} lockstep_utilisation={l['utilisation']:.2f} "
          f"ratio_traj={ratio:.2f} ratio_utilisation={util_ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
