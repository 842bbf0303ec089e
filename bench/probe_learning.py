"""Learning probe: how many rollout batches the learner's recipe needs on a button-grid family (sample efficiency).

bench_learning.py measures success against wall-clock time with the whole system (8 desktops, arpo-serve, the
learner, all on the same 2 cores), so its figures mix two things: how fast the machine makes trajectories and
how much the recipe learns from each. This probe isolates the second. It runs, in one process, the real
arpo-serve `Engine` (grammar-constrained sampling with behaviour log-probs), the learner's real `Batcher`
(replay injection, zero-variance filter, GRPO advantages) and its training step (learner.training_step: the
samples, the optimizer steps per batch, the `Trainer`), for every arm of bench_learning.py. The desktop is
consulted once per task instead of once per episode: a real desktop runs the task's setup, the probe keeps its
screenshot and the button boxes the app reports (`/tmp/arpo/layout.json`), and a rollout succeeds when its click
lands inside the target button's box (what the app's click handler and the task's evaluator would report).
Asynchrony is emulated by sampling with the weights of ``--lag`` optimizer steps earlier (AReaL's bounded
staleness; arm c, lockstep, always samples with the current weights).

Usage:
  python bench/probe_learning.py                               # arms a,b,c on grid4, 100 steps each
  python bench/probe_learning.py --arms a,b --steps 200 --lag 2 --set learner.lr=3e-3
  python bench/probe_learning.py --model runs/my-model         # another policy checkpoint
  python bench/probe_learning.py --family grid4-green --arms a  # one task alone (no instruction to read)
  python bench/probe_learning.py --family tests/data/tasks/shapes --arms a  # another 4-button family (a folder)

Prints one line per step and arm, and as its last line key=value figures: per arm the rollout batches to the
target success (trailing mean of 5 steps; ``inf`` if never), the final success (mean of the last 10 steps) and
the share of groups that were dropped for zero variance (no gradient), and the optimizer steps per trained batch.
A "step" of the probe is one rollout batch
of ``groups_per_step`` groups, trained with the arm's ``updates_per_batch`` optimizer steps (arm c: 2, as ARPO).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import copy
import json
import math
import random
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from actors.desktop.build import build_image  # noqa: E402
from actors.desktop.fleet import DesktopFleet  # noqa: E402
from actors.episode import EpisodeRunner  # noqa: E402
from actors.evaluation import run_setup  # noqa: E402
from actors.uitars.actions import ActionParseError, parse_reply  # noqa: E402
from actors.uitars.prompt import build_messages  # noqa: E402
from arpo_async.config import RunConfig, load_config  # noqa: E402
from arpo_async.messages import Outcome, Step, Trajectory  # noqa: E402
from arpo_async.model.inputs import PromptEncoder  # noqa: E402
from arpo_async.tasks import Task  # noqa: E402
from arpo_serve.engine import Engine, SamplingParams  # noqa: E402
from bench._arpo_run import ROOT, ensure_model  # noqa: E402
from bench._common import fmt, result_line  # noqa: E402
from bench.bench_learning import ARMS, TASK_SETUP, task_selection  # noqa: E402
from learner.batcher import Batcher  # noqa: E402
from learner.forced_tokens import ForcedTokens  # noqa: E402
from learner.main import replay_buffer, select_tasks  # noqa: E402
from learner.scheduler import Group  # noqa: E402
from learner.trainer import Trainer, TrainerInputError  # noqa: E402
from learner.training_step import train_on_batch  # noqa: E402

LAYOUT_FILE = "/tmp/arpo/layout.json"


@dataclass(frozen=True)
class Scene:
    """One task as the policy sees it at its first step: the screenshot after setup and the target's box."""

    task: Task
    screenshot: bytes
    box: dict  # {"x", "y", "w", "h"} in screen pixels (the app's widget_box)

    def hit(self, x: float, y: float) -> bool:
        b = self.box
        return b["x"] <= x < b["x"] + b["w"] and b["y"] <= y < b["y"] + b["h"]


def expected_label(task: Task) -> str | None:
    """The string ``task``'s single-metric evaluator expects by rule (``expected.rules.expected``: the label a
    button-grid task must click); None when the evaluator has no such rule (a list of metrics, a getter, ...)."""
    expected = task.evaluator.get("expected")
    rules = expected.get("rules") if isinstance(expected, dict) else None
    value = rules.get("expected") if isinstance(rules, dict) else None
    return value if isinstance(value, str) else None


async def capture_scenes(config: RunConfig) -> list[Scene]:
    """Run each task's setup on a fresh real desktop; keep its screenshot and the expected button's box.

    Raises:
        SystemExit: a task is not a button-grid task (its evaluator names no expected label, or the app's
            layout has no button of that label).
    """
    ac = config.actors
    image = ac.image or build_image(log=lambda line: print(f"[build] {line}", flush=True))
    fleet = DesktopFleet(image, f"probe-learning-{secrets.token_hex(3)}", screen=ac.screen_size)
    scenes = []
    try:
        for task in select_tasks(config.learner):
            desktop = await fleet.start()
            try:
                await run_setup(desktop.controller, task.config)
                shot = await desktop.controller.screenshot(ac.screenshot_format, ac.screenshot_quality)
                answer = await desktop.controller.execute(["cat", LAYOUT_FILE])
                layout = json.loads(answer["output"]) if answer.get("returncode") == 0 else {}
            finally:
                await fleet.remove(desktop)
            label = expected_label(task)
            if label not in layout:
                raise SystemExit(f"task {task.id} is not a button-grid task: its expected label {label!r} is "
                                 f"not a button of {LAYOUT_FILE} ({sorted(layout)})")
            scenes.append(Scene(task, shot, layout[label]))
            print(f"scene {task.id}: target {label!r} at {layout[label]}", flush=True)
    finally:
        await fleet.remove_all()
        await fleet.close()
    return scenes


def run_arm(arm: str, scenes: list[Scene], config: RunConfig, model: Path, steps: int, lag: int, *,
            inverted_reward: bool = False, log: Callable[[str], None] = print) -> list[dict]:
    """Train a fresh copy of ``model`` for ``steps`` rollout batches under ``arm``'s settings; one record per batch.

    The recipe is the product's, from ``config``: the prompt style, the action grammar (coordinate format, forced
    text emitted as canonical tokens when ``serve.jump_forward``), the Batcher (replay, zero-variance drop,
    stratified batches) and the learner's training step (learner.training_step.train_on_batch: the forced-token
    loss mask, ``learner.updates_per_batch`` optimizer steps per batch, the Trainer). Each step samples
    ``groups_per_step`` groups whose tasks come in turn from a seeded shuffled order of the scenes (the learner's
    round-robin task choice), so a step covers distinct tasks.

    Args:
        inverted_reward: the environment rewards a click anywhere but the target (:func:`score_reply`), so the
            recipe trains away from the target: a negative control whose success (target clicked) must not rise.
        log: receives one progress line per step.
    Returns:
        one ``{"step", "success", "task_success", "dropped_groups", "groups", "injected", "trained",
        "optimizer_steps"}`` per batch (``success``: the share of rollouts whose click landed in the target's box,
        whatever the reward; ``trained``: whether it took an optimizer step; ``optimizer_steps``: how many).
    """
    lc, ac = config.learner, config.actors
    rng = random.Random(lc.seed)
    encoder = PromptEncoder(model)
    runner = EpisodeRunner(encoder, None, ac)  # only its sampling parameters (regex included) are used
    engine = Engine(model, seed=lc.seed, jump_forward=config.serve.jump_forward)
    trainer = Trainer(model, lc)
    forced = ForcedTokens(model, engine.vocab_size) if lc.mask_forced_tokens else None
    batcher = Batcher(replay_buffer(lc), max_staleness=max(lag, lc.max_staleness),
                      groups_per_step=lc.groups_per_step, format_reward_weight=lc.format_reward_weight,
                      stratified=lc.stratified)
    weights = collections.deque([copy.deepcopy(trainer.model.state_dict())], maxlen=lag + 1)
    records, serial, order, version = [], 0, [], 0  # version: published weights, +1 per trained batch
    optimizer_steps = 0  # in all, as the learner counts them (learner.steps)
    by_id = {s.task.id: s for s in scenes}
    params = SamplingParams.from_json(dict(runner.sampling_params))
    while len(records) < steps:
        engine.model.load_state_dict(weights[0])  # the oldest kept: `lag` versions behind once warmed up
        sampled_version = version - (len(weights) - 1)
        groups = []
        for _ in range(lc.groups_per_step):
            if not order:
                order = rng.sample(scenes, len(scenes))
            groups.append(Group(f"g{serial}", order.pop().task, lc.group_size))
            serial += 1
        requests = []
        for g in groups:
            scene = by_id[g.task.id]
            prompt = build_messages(g.task.instruction, [], history_images=ac.history_images, style=ac.prompt_style)
            ids = encoder.encode(prompt.messages, [ac.screen_size])
            for k in range(g.size):
                requests.append((g, k, ids, engine.prepare(f"{g.group_id}-{k}", ids, [scene.screenshot], params,
                                                           return_logprob=True)))
        results = engine.generate_batch([r for *_, r in requests])
        by_task: dict[str, list[float]] = collections.defaultdict(list)
        for (g, k, ids, _), res in zip(requests, results):
            traj, hit = score_reply(g, k, ids, res, by_id[g.task.id], runner, sampled_version, inverted_reward)
            by_task[g.task.id].append(float(hit))
            g.results[k] = traj
        dropped = sum(batcher.add_group(g, version) is None for g in groups)
        batch = batcher.take_batch() or []
        stats, updates = {}, 0
        if batch:  # else every group was dropped: no step, as the learner's lockstep loop skips an empty batch
            try:
                stats, updates = train_on_batch(trainer, batch, lc, forced, optimizer_steps)
            except TrainerInputError:  # no usable sample: no step, as the learner's training loop skips it
                pass
        optimizer_steps += updates
        version += bool(updates)
        weights.append(copy.deepcopy(trainer.model.state_dict()))
        scores = [x for xs in by_task.values() for x in xs]
        success = sum(scores) / len(scores)
        records.append({"step": len(records), "success": success, "dropped_groups": dropped, "groups": len(groups),
                        "task_success": {t: sum(xs) / len(xs) for t, xs in by_task.items()},
                        "injected": sum(g.injected for g in batch), "trained": bool(updates),
                        "optimizer_steps": updates})
        recent = [r["success"] for r in records[-5:]]
        log(f"[{arm}] step {len(records) - 1:4d} success {success:.2f} trailing5 {sum(recent) / len(recent):.2f} "
            f"groups dropped {dropped}/{len(groups)} injected {records[-1]['injected']} "
            f"loss {stats.get('loss', float('nan')):.3f} tokens {stats.get('tokens', 0):.0f} | "
            + " ".join(f"{t}={v:.2f}" for t, v in sorted(records[-1]["task_success"].items())))
    return records


def score_reply(group: Group, k: int, prompt_ids: list[int], result, scene: Scene, runner: EpisodeRunner,
                version: int, inverted: bool = False) -> tuple[Trajectory, bool]:
    """The one-step trajectory of rollout ``k`` and whether its click landed in the target's box.

    The trajectory is SUCCESS (score 1) when the reply's click lands in the target's box, FAILURE (score 0) when
    it lands elsewhere, POLICY_ERROR (score 0) when the reply does not parse. ``inverted``: the other way round
    for a reply that parses (a click in the target's box fails, anything else succeeds).
    """
    ac = runner.config
    traj = Trajectory(trajectory_id=f"{group.group_id}-{k}", actor_id="probe", task_id=group.task.id,
                      group_id=group.group_id, rollout_index=k, outcome=Outcome.FAILURE.value, score=0.0,
                      format_ok=True, steps=[], screenshots=[scene.screenshot], assigned_version=version,
                      grammar=runner.sampling_params.get("regex", ""))
    traj.steps.append(Step(prompt_ids=prompt_ids, image_indices=[0], output_ids=result.output_ids,
                           logprobs=result.output_logprobs, versions=[version] * len(result.output_ids),
                           text=result.text, action=""))
    try:
        point = parse_reply(result.text, resized_size=runner.resized_size, screen_size=ac.screen_size,
                            coordinate_mode=ac.coordinate_mode).action.point
    except ActionParseError:
        traj.format_ok, traj.outcome = False, Outcome.POLICY_ERROR
        return traj, False
    hit = point is not None and scene.hit(*point)
    if hit != inverted:
        traj.score, traj.outcome = 1.0, Outcome.SUCCESS
    return traj, hit


def steps_to(records: list[dict], target: float, window: int = 5) -> float:
    """First step at which the trailing mean success over ``window`` steps reaches ``target``; inf if never."""
    for i in range(len(records)):
        recent = [r["success"] for r in records[max(0, i - window + 1): i + 1]]
        if len(recent) == window and sum(recent) / window >= target:
            return float(i)
    return math.inf


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="grid4",
                   help="grid4 (4 buttons) or grid8 (8 buttons), one task id such as grid4-green, or a folder of "
                        "task files (all its tasks, e.g. tests/data/tasks/shapes)")
    p.add_argument("--arms", default="a,b,c", help="comma-separated arms of bench_learning.py")
    p.add_argument("--steps", type=int, default=100,
                   help="rollout batches per arm (each takes the arm's learner.updates_per_batch optimizer steps)")
    p.add_argument("--lag", type=int, default=1, help="policy versions behind for the async arms a and b")
    p.add_argument("--target", type=float, default=0.8, help="success rate for the steps-to-target figure")
    p.add_argument("--seed", type=int, default=0)
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
    _, selection = task_selection(args.family)  # a family, one task id, or a folder of task files
    base = TASK_SETUP + [*selection, f"learner.seed={args.seed}", *args.overrides]
    try:
        scenes = asyncio.run(capture_scenes(load_config(None, base)))
    except ValueError as e:  # no task of the family, or a bad --set
        raise SystemExit(f"probe_learning: {e}") from None
    figures = {}
    for arm in args.arms.split(","):
        config = load_config(None, TASK_SETUP + ARMS[arm][1] + base[len(TASK_SETUP):])
        lag = 0 if config.learner.schedule == "lockstep" else args.lag
        records = run_arm(arm, scenes, config, model, args.steps, lag)
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
