"""End-to-end throughput: async vs lockstep schedule, and desktop reuse vs a fresh container per episode.

Both arms are real `arpo run`s (arpo-serve + arpo-learner + arpo-actors, 8 docker desktops) over the whole
built-in suite with a 5-step budget, so episode lengths are mixed (the agent may say `finished` at any step;
tasks differ in setup cost). Each arm runs for the same wall-clock budget. Figures per arm:
  trajectories/min    trajectories the learner received per minute, in the steady state (from the first
                      trajectory on; start-up and the first desktop boots are left out: each arm's budget of minutes
                      starts at its first trajectory, after at most STARTUP_MINUTES of start-up)
  desktop utilisation sum of episode seconds / (desktops x seconds) over the same span; an episode runs from
                      the task's setup to its evaluation, so desktop resets are outside it
Arms: async and lockstep with the default desktop reuse (actors.desktop_max_episodes = 16: a desktop is reset in
place between episodes), and async-fresh: async with a fresh container per episode (desktop_max_episodes = 1,
the behaviour before reuse). Ratios: async / lockstep of both figures (target from issue 4: >= 3x
trajectories/min) and async / async-fresh trajectories/min (what reuse buys).

Usage: python -m bench.bench_e2e [--minutes 5] [--actors 8] [--quick] [--arms async,lockstep,async-fresh]
Last line: key=value figures.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from bench._arpo_run import ROOT, ensure_model, run_arpo

STARTUP_MINUTES = 10.0
"""The most minutes an arm may take to its first trajectory (model load, the first desktop boots) before its
measured budget starts; a busy machine takes longer, so the budget never depends on how busy it is."""
ASYNC = ['learner.schedule="async"', "learner.max_staleness=2"]
ARMS = {
    "async": ASYNC,
    "lockstep": ['learner.schedule="lockstep"'],
    "async-fresh": ASYNC + ["actors.desktop_max_episodes=1"],
}


def read_status(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def measure(arm: str, args: argparse.Namespace) -> dict[str, float]:
    """One arm: sample the learner's status.json every 2 s; the figures cover the steady state, from the first
    sample with a trajectory to the last sample (start-up, model load and first desktop boots left out)."""
    run_dir = args.out / arm
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = ARMS[arm] + [f"actors.actors={args.actors}", "actors.max_steps=5", "learner.steps=100000",
                                       "learner.group_size=4", "learner.groups_per_step=2"]
    samples: list[dict] = []

    def sample(run_dir: Path) -> bool:
        """Keep the status once trajectories arrive; stop once ``args.minutes`` of them have been sampled."""
        status = read_status(run_dir)
        if status and status.get("totals", {}).get("trajectories", 0) > 0:
            samples.append(status)
        return len(samples) >= 2 and samples[-1]["wall_s"] - samples[0]["wall_s"] >= args.minutes * 60

    run_arpo(run_dir, args.model, overrides, STARTUP_MINUTES + args.minutes, sample)
    if len(samples) < 2:
        raise SystemExit(f"{arm}: fewer than 2 status samples with trajectories; see {run_dir}.out")
    first, last = samples[0], samples[-1]
    span_s = last["wall_s"] - first["wall_s"]
    done = last["totals"]["trajectories"] - first["totals"]["trajectories"]
    busy = last["totals"].get("desktop_busy_s", 0.0) - first["totals"].get("desktop_busy_s", 0.0)
    return {"traj_per_min": done / (span_s / 60), "utilisation": busy / (args.actors * span_s),
            "steps": last.get("step", 0), "span_s": span_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5.0,
                        help="measured minutes per arm, from its first trajectory")
    parser.add_argument("--actors", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="2 minutes per arm")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-e2e")
    parser.add_argument("--model", type=Path, default=ROOT / "runs" / "tiny-model")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {', '.join(ARMS)}")
    args = parser.parse_args()
    if args.quick:
        args.minutes = min(args.minutes, 2.0)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown or not arms:
        parser.error(f"--arms: unknown arm(s) {unknown or arms}; choose from {', '.join(ARMS)}")
    ensure_model(args.model)
    results = {arm: measure(arm, args) for arm in arms}
    print(f"{'arm':<12}{'traj/min':>10}{'utilisation':>13}{'steps':>7}{'span s':>8}")
    for arm, r in results.items():
        print(f"{arm:<12}{r['traj_per_min']:>10.1f}{r['utilisation']:>13.2f}{r['steps']:>7}{r['span_s']:>8.0f}")
    figures = [f"{arm.replace('-', '_')}_traj_per_min={r['traj_per_min']:.1f} "
               f"{arm.replace('-', '_')}_utilisation={r['utilisation']:.2f}" for arm, r in results.items()]
    for name, (num, den), key in (("ratio_traj", ("async", "lockstep"), "traj_per_min"),
                                  ("ratio_utilisation", ("async", "lockstep"), "utilisation"),
                                  ("ratio_reuse_traj", ("async", "async-fresh"), "traj_per_min")):
        if num in results and den in results:
            d = results[den][key]
            figures.append(f"{name}={results[num][key] / d if d else float('nan'):.2f}")
    print(" ".join(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
