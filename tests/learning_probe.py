"""The learning probe: the learner's recipe trained in one process on captured click trees (sample efficiency).

In one process it runs the real arpo-serve `Engine` (grammar-constrained sampling with behaviour log-probs), the
training loop's own stages (learner.train.loop): the real `Batcher` (score, replay injection, zero-variance
filter, GRPO advantages), the samples, the optimizer steps per batch (``optimizer_steps``), the `Trainer`. The desktop
is consulted once per task instead of once per episode: real desktops capture the task's click tree
(tests/click_tree.py: from the task's setup, every state ``actors.max_steps`` clicks on the app's widgets reach, each
with its screenshot, the widget boxes the app reports in `/tmp/arpo/layout.json` and the task's evaluator score). An
episode is played on that tree (:class:`EmulatedEpisode`): each step's prompt is built as the actors build it (earlier
replies, the last ``history_images`` screenshots), a click moves to the state of the widget it lands in (none: the state
stays), and the episode scores what the task's evaluator said of the state it ends in. Asynchrony is emulated by
sampling with the weights of ``lag`` optimizer steps earlier (AReaL's bounded staleness; lockstep samples with the
current weights).

Test infrastructure, not product: the learnability tests (tests/integration/test_learnability*.py) train with it,
and bench/probe_learning.py is its command line (batches to a target success per arm of tests/learning_arms.py).
"""

from __future__ import annotations

import asyncio
import collections
import copy
import random
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from actors.desktop.build import build_image
from actors.desktop.fleet import DesktopFleet
from actors.episode import EpisodeRunner, add_screenshot, describe, episode_outcome
from actors.evaluation import PARSE_ERROR_ACTION
from actors.uitars.actions import ActionParseError, parse_reply
from arpo_async.prompt import build_messages
from arpo_async.config import ActorConfig, RunConfig
from arpo_async.messages import Outcome, Step, Trajectory, float_array, int_array
from arpo_async.model.inputs import PromptEncoder
from arpo_async.success import DEFAULT_SUCCESS_THRESHOLD, is_success
from arpo_async.tasks import Task
from arpo_serve.engine import Engine, SamplingParams
from learner.algo.batcher import Batcher
from learner.algo.samples import train_samples
from learner.algo.forced_tokens import ForcedTokens
from learner.main import replay_buffer, seed_demonstrations, select_tasks
from learner.rollouts.scheduler import Group
from learner.train.loop import optimizer_steps
from learner.train.trainer import Trainer, TrainerInputError
from tests.click_tree import CaptureError, Node, capture_trees

CAPTURE_DESKTOPS = 3
"""Desktops that capture the click trees together (tests/click_tree.py: each tree level's replays are shared out)."""


@dataclass(frozen=True)
class Scene:
    """One task as the policy meets it: its click tree (the states ``actors.max_steps`` clicks reach from its setup,
    each with the task's evaluator score), captured once on a real desktop."""

    task: Task
    root: Node

    def score(self, node: Node) -> float:
        """The task's evaluator score of an episode that ends in ``node`` (the step budget ran out)."""
        return node.scores[self.task.id]

    def solutions(self, node: Node | None = None, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
        """The click paths (widget keys) from ``node`` (default the root) that end in a state that is a success."""
        node = node or self.root
        found = [path] if is_success(self.score(node), DEFAULT_SUCCESS_THRESHOLD) else []
        for key, child in node.children.items():
            found += self.solutions(child, (*path, key))
        return found


async def capture_scenes(config: RunConfig, desktops: int = CAPTURE_DESKTOPS) -> list[Scene]:
    """Capture the click tree of each task (``actors.max_steps`` clicks deep) on ``desktops`` fresh real desktops.

    Raises:
        SystemExit: a task's app reports no widget (no ``/tmp/arpo/layout.json``), or a task is infeasible.
    """
    ac = config.actors
    tasks = select_tasks(config.learner)
    image = ac.image or build_image(log=lambda line: print(f"[build] {line}", flush=True))
    fleet = DesktopFleet(image, f"probe-learning-{secrets.token_hex(3)}", screen=ac.screen_size)
    try:
        async with asyncio.TaskGroup() as tg:
            started = [tg.create_task(fleet.start()) for _ in range(desktops)]
        roots = await capture_trees([d.result().controller for d in started], tasks, ac, ac.max_steps,
                                    log=lambda line: print(line, flush=True))
    except (CaptureError, ValueError) as e:
        raise SystemExit(f"learning probe: {e}") from None
    finally:
        await fleet.remove_all()
        await fleet.close()
    scenes = [Scene(task, roots[task.id]) for task in tasks]
    for scene in scenes:
        solved = scene.solutions()
        print(f"scene {scene.task.id}: solved by " + (" | ".join(" > ".join(p) for p in solved[:4]) if solved else
                                                     f"no path of up to {ac.max_steps} clicks"), flush=True)
    return scenes


@dataclass
class EmulatedEpisode:
    """One rollout played on a scene's click tree, recorded as EpisodeRunner records a real episode.

    Each policy step builds the prompt as the actors do (arpo_async.prompt.build_messages with the earlier
    replies and the last ``history_images`` screenshots, PromptEncoder.encode with one screen-sized image per
    screenshot shown) and appends one Step (prompt ids, image indices into the trajectory's screenshots, sampled
    ids, behaviour log-probs, the sampling version). A click moves to the state :meth:`Node.after_click` gives;
    any other action leaves the state as it is (the trees hold clicks only: use ``actors.grammar_actions =
    ["click"]``). The episode ends as the actors' step loop does: a reply that does not parse (FAIL), finished
    (DONE), call_user (FAIL) or the step budget.
    """

    scene: Scene
    trajectory: Trajectory
    node: Node
    replies: list[str] = field(default_factory=list)
    shot_of_step: list[int] = field(default_factory=list)
    last_action: str | None = None
    done: bool = False

    def request(self, encoder: PromptEncoder, engine: Engine, params: SamplingParams, ac: ActorConfig):
        """The engine request of the next step (its Step is appended by :meth:`take`)."""
        traj = self.trajectory
        self.shot_of_step.append(add_screenshot(traj.screenshots, self.node.screenshot))
        prompt = build_messages(self.scene.task.instruction, self.replies, history_images=ac.history_images,
                                style=ac.prompt_style)
        image_indices = [self.shot_of_step[i] for i in prompt.image_indices]
        prompt_ids = encoder.encode(prompt.messages, [ac.screen_size] * len(image_indices))
        traj.steps.append(Step(prompt_ids=prompt_ids, image_indices=image_indices, output_ids=[], logprobs=[],
                               versions=[], text="", action=""))
        return engine.prepare(f"{traj.trajectory_id}-{len(traj.steps) - 1}", encoder.collapse_image_pads(prompt_ids),
                              [traj.screenshots[i] for i in image_indices], params, return_logprob=True)

    def take(self, result, runner: EpisodeRunner, version: int) -> None:
        """Record the engine's reply to the last request and act on it."""
        ac, step = runner.config, self.trajectory.steps[-1]
        step.output_ids, step.logprobs = int_array(result.output_ids), float_array(result.output_logprobs)
        step.text, step.versions = result.text, np.full(len(step.output_ids), version, np.int32)
        try:
            parsed = parse_reply(result.text, resized_size=runner.resized_size, screen_size=ac.screen_size,
                                 coordinate_mode=ac.coordinate_mode)
        except ActionParseError as e:
            self.trajectory.format_ok, self.trajectory.error = False, f"ActionParseError: {e}"
            self.last_action, self.done = PARSE_ERROR_ACTION, True  # as EpisodeRunner with no re-ask (training)
            return
        step.action = "; ".join(describe(a) for a in parsed.actions)
        self.replies.append(result.text)
        if parsed.action.kind in ("finished", "fail"):
            self.last_action, self.done = ("DONE" if parsed.action.kind == "finished" else "FAIL"), True
            return
        for action in parsed.actions:
            if action.kind == "click" and action.point is not None:
                self.node = self.node.after_click(*action.point)
        self.done = len(self.trajectory.steps) >= ac.max_steps

    def finish(self, inverted: bool) -> bool:
        """Score the ended episode as the evaluator would (a FAIL scores 0) and set its outcome; whether it
        succeeded by the task's own score. ``inverted``: an episode whose replies all parsed is rewarded
        1 - that score (the negative control); one with a reply that did not parse still scores 0."""
        traj = self.trajectory
        true_score = 0.0 if self.last_action in ("FAIL", PARSE_ERROR_ACTION) else self.scene.score(self.node)
        traj.score = 1.0 - true_score if inverted and traj.format_ok else true_score
        traj.outcome = episode_outcome(traj.score, traj.format_ok, self.last_action)
        return is_success(true_score, DEFAULT_SUCCESS_THRESHOLD)


def run_arm(arm: str, scenes: list[Scene], config: RunConfig, model: Path, steps: int, lag: int, *,
            inverted_reward: bool = False, train: bool = True, log: Callable[[str], None] = print) -> list[dict]:
    """Train a fresh copy of ``model`` for ``steps`` rollout batches under ``arm``'s settings; one record per batch.

    The recipe is the product's, from ``config``: the demonstrations put in the replay (``learner.replay_demos``),
    the prompt style and history window, the action grammar
    (coordinate format, forced text emitted as canonical tokens when ``serve.jump_forward``), the step budget
    (``actors.max_steps``), the training loop's stages (learner.train.loop): score, replay and advantages per
    group (learner.algo.batcher.Batcher: replay, zero-variance drop, stratified batches), then samples (the
    forced-token loss mask), ``learner.updates_per_batch`` optimizer steps per batch (``optimizer_steps``) and the
    Trainer. Each step samples ``groups_per_step`` groups whose tasks come in turn
    from a seeded shuffled order of the scenes (the learner's round-robin task choice), so a step covers distinct
    tasks; their episodes (:class:`EmulatedEpisode`) advance together, one ``Engine.generate_batch`` per policy
    step for every episode still running.

    Args:
        inverted_reward: episodes are rewarded 1 - the evaluator's score (:meth:`EmulatedEpisode.finish`), so the
            recipe trains away from solving the task: a negative control whose success must not rise.
        train: False takes no optimizer step, so every batch samples the untrained policy: its success is the
            tasks' chance success rate.
        log: receives one progress line per step.
    Returns:
        one ``{"step", "success", "task_success", "group_success", "dropped_groups", "groups", "injected",
        "trained", "optimizer_steps"}`` per batch (``success``: the share of episodes whose score is a success,
        whatever the reward; ``group_success``: (task id, each rollout's success as 1.0 or 0.0) per group, as the
        learner's task selector counts them, by the task's own score; ``trained``: whether it took an optimizer step; ``optimizer_steps``: how many).
    """
    lc, ac = config.learner, config.actors
    rng = random.Random(lc.seed)
    encoder = PromptEncoder(model)
    runner = EpisodeRunner(encoder, None, ac)  # only its sampling parameters (regex included) are used
    engine = Engine(model, seed=lc.seed, jump_forward=config.serve.jump_forward)
    trainer = Trainer(model, lc)
    tokens = ForcedTokens(model, engine.vocab_size) if lc.mask_forced_tokens or lc.replay_demos else None
    forced = tokens if lc.mask_forced_tokens else None
    replay = replay_buffer(lc)
    seed_demonstrations(config, replay, [s.task.id for s in scenes])  # learner.replay_demos, as the learner does
    batcher = Batcher(replay, max_staleness=max(lag, lc.max_staleness),
                      groups_per_step=lc.groups_per_step, format_reward_weight=lc.format_reward_weight,
                      stratified=lc.stratified, sampled_as=tokens.as_sampled if tokens else None)
    weights = collections.deque([copy.deepcopy(trainer.model.state_dict())], maxlen=lag + 1)
    records, serial, order, version = [], 0, [], 0  # version: published weights, +1 per trained batch
    steps_done = 0  # optimizer steps in all, as the learner counts them (learner.steps)
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
        episodes = [(g, k, EmulatedEpisode(by_id[g.task.id], _trajectory(g, k, runner, sampled_version),
                                           by_id[g.task.id].root)) for g in groups for k in range(g.size)]
        while running := [e for _, _, e in episodes if not e.done]:
            results = engine.generate_batch([e.request(encoder, engine, params, ac) for e in running])
            for e, res in zip(running, results):
                e.take(res, runner, sampled_version)
        by_task: dict[str, list[float]] = collections.defaultdict(list)
        by_group: dict[str, list[float]] = collections.defaultdict(list)
        for g, k, e in episodes:
            succeeded = float(e.finish(inverted_reward))
            by_task[g.task.id].append(succeeded)
            by_group[g.group_id].append(succeeded)
            g.results[k] = e.trajectory
        dropped = sum(batcher.add_group(g, version) is None for g in groups)
        batch = batcher.take_batch() or []
        stats, updates = {}, 0
        spent = bool(lc.steps) and steps_done >= lc.steps  # learner.steps reached: sampled, not trained
        if spent and records and not records[-1].get("spent"):
            log(f"[{arm}] learner.steps ({lc.steps}) reached: later batches are sampled without an optimizer step")
        if batch and train and not spent:  # else every group was dropped: no step (the lockstep loop skips it)
            try:
                samples = train_samples(batch, forced)  # the loop's stages 4-5 (TrainingLoop.train)
                updates = optimizer_steps(lc, len(samples), steps_done)
                stats = trainer.train_batch(samples, minibatches=updates)
            except TrainerInputError as error:  # no usable sample: no step, as the learner's training loop skips it
                log(f"[{arm}] step {len(records)}: no optimizer step: {error}")
        steps_done += updates
        version += bool(updates)
        weights.append(copy.deepcopy(trainer.model.state_dict()))
        scores = [x for xs in by_task.values() for x in xs]
        success = sum(scores) / len(scores)
        records.append({"step": len(records), "success": success, "dropped_groups": dropped, "groups": len(groups),
                        "group_success": [(g.task.id, by_group[g.group_id]) for g in groups],
                        "task_success": {t: sum(xs) / len(xs) for t, xs in by_task.items()},
                        "injected": sum(g.injected for g in batch), "trained": bool(updates),
                        "optimizer_steps": updates, "spent": spent})
        recent = [r["success"] for r in records[-5:]]
        log(f"[{arm}] step {len(records) - 1:4d} success {success:.2f} trailing5 {sum(recent) / len(recent):.2f} "
            f"groups dropped {dropped}/{len(groups)} injected {records[-1]['injected']} "
            f"loss {stats.get('loss', float('nan')):.3f} tokens {stats.get('tokens', 0):.0f} "
            f"grad_norm {stats.get('grad_norm', float('nan')):.2f} entropy {stats.get('entropy', float('nan')):.3f} "
            f"clip {stats.get('clip_frac', float('nan')):.3f} kl {stats.get('approx_kl', float('nan')):.3f} "
            f"behaviour_kl {stats.get('behaviour_kl', float('nan')):.3f} "
            f"policy_kl {stats.get('policy_kl', float('nan')):.4f} lr {stats.get('lr', float('nan')):.2e} "
            f"scale {stats.get('step_scale', float('nan')):.3f} | "
            + " ".join(f"{t}={v:.2f}" for t, v in sorted(records[-1]["task_success"].items())))
    return records


def _trajectory(group: Group, k: int, runner: EpisodeRunner, version: int) -> Trajectory:
    """The empty trajectory of rollout ``k`` of ``group``, as EpisodeRunner.run starts one."""
    return Trajectory(trajectory_id=f"{group.group_id}-{k}", actor_id="probe", task_id=group.task.id,
                      group_id=group.group_id, rollout_index=k, outcome=Outcome.ABORTED, score=0.0, format_ok=True,
                      steps=[], screenshots=[], assigned_version=version,
                      grammar=runner.sampling_params.get("regex", ""))

