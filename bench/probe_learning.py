"""Learning probe: how many rollout batches the learner's recipe needs on a task family (sample efficiency).

bench_learning.py measures success against wall-clock time with the whole system (8 desktops, arpo-serve, the
learner, all on the same 2 cores), so its figures mix two things: how fast the machine makes trajectories and
how much the recipe learns from each. This probe isolates the second. It runs, in one process, the real
arpo-serve `Engine` (grammar-constrained sampling with behaviour log-probs) and the training loop's own stages
(learner.train.loop: the real `Batcher`'s score, replay injection, zero-variance filter and GRPO advantages, the
samples, the optimizer steps per batch, the `Trainer`), for every arm of bench_learning.py
(tests/learning_arms.py). The desktop is consulted once per task instead of once per episode: real desktops
capture the task's click tree and each episode is played on it (tests/learning_probe.py, which the learnability
tests use too; this is its command line). Asynchrony is emulated by sampling with the weights of ``--lag``
optimizer steps earlier (AReaL's bounded staleness; arm c, lockstep, always samples with the current weights).

Usage:
  python -m bench.probe_learning                               # arms a,b,c on grid4, 100 steps each
  python -m bench.probe_learning --arms a,b --steps 200 --lag 2 --set learner.lr=3e-3
  python -m bench.probe_learning --model runs/my-model         # another policy checkpoint
  python -m bench.probe_learning --family grid4-green --arms a  # one task alone (no instruction to read)
  python -m bench.probe_learning --family tests/data/tasks/shapes --arms a  # another 4-button family (a folder)
  python -m bench.probe_learning --config configs/multistep.toml --arms a   # settings-sound-mute: 2 clicks in order
  python -m bench.probe_learning --config configs/multistep.toml --family settings --set actors.max_steps=3
  python -m bench.probe_learning --config configs/multistep3.toml --arms a --chance --steps 200  # chance rates

Prints one line per step and arm, and as its last line key=value figures: per arm the rollout batches to the
target success (trailing mean of 5 steps; ``inf`` if never), the final success (mean of the last 10 steps) and
the share of groups that were dropped for zero variance (no gradient), and the optimizer steps per trained batch.
A "step" of the probe is one rollout batch
of ``groups_per_step`` groups, trained with the arm's ``updates_per_batch`` optimizer steps (arm c: 2, as ARPO).
"""

from __future__ import annotations

import argparse
import asyncio
import math
from pathlib import Path

from arpo_async.config import load_config
from bench._arpo_run import ROOT, ensure_model
from bench._common import fmt, result_line
from tests.learning_arms import ARMS, TASK_SETUP, task_selection
from tests.learning_probe import capture_scenes, run_arm


def steps_to(records: list[dict], target: float, window: int = 5) -> float:
    """First step at which the trailing mean success over ``window`` steps reaches ``target``; inf if never."""
    for i in range(len(records)):
        recent = [r["success"] for r in records[max(0, i - window + 1): i + 1]]
        if len(recent) == window and sum(recent) / window >= target:
            return float(i)
    return math.inf


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default=None,
                   help="grid4 (4 buttons), grid8 (8 buttons) or settings (2 and 3 clicks in order: give --config), "
                        "one task id such as grid4-green, or a folder of task files (all its tasks, e.g. "
                        "tests/data/tasks/shapes); default: grid4, or the --config file's own tasks")
    p.add_argument("--config", type=Path, default=None,
                   help="a run config (e.g. configs/multistep.toml) as the task setup instead of bench_learning's "
                        "one-click TASK_SETUP; each arm's overrides, --family and --set apply on top")
    p.add_argument("--arms", default="a,b,c", help="comma-separated arms of bench_learning.py")
    p.add_argument("--steps", type=int, default=100,
                   help="rollout batches per arm (each takes the arm's learner.updates_per_batch optimizer steps)")
    p.add_argument("--lag", type=int, default=1, help="policy versions behind for the async arms a and b")
    p.add_argument("--target", type=float, default=0.8, help="success rate for the steps-to-target figure")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chance", action="store_true",
                   help="take no optimizer step: --steps batches of the untrained policy give each task's chance "
                        "success rate (printed per task; one arm is enough)")
    p.add_argument("--model", type=Path, default=ROOT / "runs" / "tiny-model", help="policy checkpoint folder")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every arm, after the task setup (repeatable)")
    args = p.parse_args(argv)
    unknown = [a for a in args.arms.split(",") if a not in ARMS]
    if unknown:
        p.error(f"unknown arms {unknown}; choose from {sorted(ARMS)}")
    if args.steps < 1 or args.lag < 0 or not 0 < args.target <= 1:
        p.error("--steps must be >= 1, --lag >= 0 and --target in (0, 1]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = ensure_model(args.model)
    family = args.family or (None if args.config else "grid4")
    selection = task_selection(family)[1] if family else []  # a family, one task id, or a folder of task files
    setup = [] if args.config else TASK_SETUP
    rest = [*selection, f"learner.seed={args.seed}", *args.overrides]
    try:
        scenes = asyncio.run(capture_scenes(load_config(args.config, setup + rest)))
    except ValueError as e:  # no task of the family, or a bad --set or --config
        raise SystemExit(f"probe_learning: {e}") from None
    figures = {}
    for arm in args.arms.split(","):
        config = load_config(args.config, setup + ARMS[arm][1] + rest)
        lag = 0 if config.learner.schedule == "lockstep" else args.lag
        records = run_arm(arm, scenes, config, model, args.steps, lag, train=not args.chance)
        if args.chance:
            for task_id in sorted({t for r in records for t in r["task_success"]}):
                rates = [r["task_success"][task_id] for r in records if task_id in r["task_success"]]
                figures[f"chance_{task_id}"] = sum(rates) / len(rates)
                print(f"chance {task_id}: {sum(rates) / len(rates):.4f} over {len(rates) * config.learner.group_size}"
                      " episodes of the untrained policy", flush=True)
        last = records[-10:]
        figures[f"{arm}_steps_to_{int(args.target * 100)}"] = steps_to(records, args.target)
        figures[f"{arm}_final"] = sum(r["success"] for r in last) / len(last)
        figures[f"{arm}_zero_variance_share"] = (sum(r["dropped_groups"] for r in records)
                                                 / sum(r["groups"] for r in records))
        trained = sum(r["trained"] for r in records)
        if trained:  # left out when no batch had reward variance
            figures[f"{arm}_steps_per_batch"] = sum(r["optimizer_steps"] for r in records) / trained
    print(result_line({k: fmt(v) if math.isfinite(v) else "inf" for k, v in figures.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
