"""One episode on one desktop: setup -> (screenshot -> prompt -> /generate -> parse -> act)* -> evaluate.

Owns: the mapping from what happens in an episode to a Trajectory and its Outcome:

| what happened                                   | outcome       | trained on |
|-------------------------------------------------|---------------|------------|
| evaluator score >= 0.5 (whatever ended the loop)| SUCCESS       | yes        |
| agent said finished / FAIL, score < 0.5         | FAILURE       | yes        |
| step budget ran out, score < 0.5                | TRUNCATED     | yes        |
| a reply did not parse (episode ends there)      | POLICY_ERROR  | yes, with ARPO's format penalty |
| desktop died, controller timed out, setup or evaluator failed | ENV_ERROR | no |
| inference server unreachable after all retries  | ABORTED       | no         |
| the server aborted a generation (finish_reason abort) | ABORTED | no         |

The reward always comes from the evaluator reading the desktop's real state after the episode, never from
the actor's own bookkeeping. Sampled token ids, their behaviour log-probs and weight versions are recorded
exactly as the server returned them (tokens in, tokens out).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

from actors.desktop.controller_client import ControllerClient, DesktopError
from actors.evaluation import EvaluationError, SetupContext, TaskSetupError, evaluate, run_setup
from actors.osworld.downloads import DownloadCache
from actors.policy_client import GenerationAborted, PolicyClient, PolicyRequestError, PolicyUnavailable
from actors.uitars.actions import Action, ActionParseError, parse_reply
from actors.uitars.grammar import action_regex
from actors.uitars.prompt import build_messages
from actors.uitars import pyautogui, xdotool
from arpo_async.config import ActorConfig
from arpo_async.messages import Assignment, Outcome, Step, Trajectory
from arpo_async.model.inputs import PromptEncoder
from arpo_async.tasks import Task, TaskFormatError

log = logging.getLogger(__name__)

SUCCESS_SCORE = 0.5
"""An episode whose evaluator score reaches this is a SUCCESS."""
RELATIVE_MAX = 999
"""Largest coordinate of ``coordinate_mode = "relative1000"`` (x / 1000 of the screen width; 3 digits)."""
ACTION_BACKENDS = {"xdotool": xdotool.to_commands, "pyautogui": pyautogui.to_commands}
"""``actors.action_backend`` -> Action -> argv lists run through the controller's /execute, in order."""


@dataclass(frozen=True)
class EpisodeRunner:
    """Everything an EnvActor needs to run episodes; shared by all actors of a process (stateless).

    Args:
        encoder: tokenizer + image-size logic of the policy (the same files the server and learner load).
        policy: client of the inference server(s).
        config: actor settings (step budget, sampling, screen size, history length).
        downloads: where tasks' ``download`` setup steps and ``cloud_file`` getters fetch files from (default
            ``DownloadCache()``; a run uses ``actors.osworld.downloads.run_download_cache``).
    """

    encoder: PromptEncoder
    policy: PolicyClient
    config: ActorConfig
    downloads: DownloadCache = field(default_factory=DownloadCache)
    resized_size: tuple[int, int] = field(init=False)
    """(w, h) of a screenshot as the model sees it (Qwen2.5-VL smart_resize of the screen size)."""
    sampling_params: dict = field(init=False)
    """SGLang sampling_params for every /generate of an episode (with the action regex when constrained)."""

    def __post_init__(self) -> None:
        """Build the sampling parameters once; a bad grammar setting fails here, at process start.

        Raises:
            ValueError: an unknown name in ``actors.grammar_actions`` or a bad bound.
        """
        width, height = self.encoder.resized_size(*self.config.screen_size)
        object.__setattr__(self, "resized_size", (width, height))
        params = dict(self.config.sampling_params)
        if self.config.constrained:
            extra = {"actions": self.config.grammar_actions} if self.config.grammar_actions else {}
            if self.config.coordinate_mode == "absolute":
                max_x, max_y = width - 1, height - 1
            else:
                max_x = max_y = RELATIVE_MAX
            params["regex"] = action_regex(max_x=max_x, max_y=max_y, fixed_width=self.config.fixed_width_coordinates,
                                           max_thought_chars=self.config.max_thought_chars, **extra)
        object.__setattr__(self, "sampling_params", params)

    async def run(self, controller: ControllerClient, assignment: Assignment, actor_id: str,
                  desktop: str = "") -> Trajectory:
        """Run one assigned rollout to its end and return its trajectory (never raises for env or policy faults).

        Raises:
            asyncio.CancelledError: the actor is shutting down (nothing is sent; the learner re-issues the rollout).
        """
        traj = Trajectory(
            trajectory_id=uuid.uuid4().hex, actor_id=actor_id, task_id=str(assignment.task.get("id", "")),
            group_id=assignment.group_id, rollout_index=assignment.rollout_index, outcome=Outcome.ABORTED.value,
            score=0.0, format_ok=True, steps=[], screenshots=[], assigned_version=assignment.policy_version,
            desktop=desktop, grammar=self.sampling_params.get("regex", ""))
        started = time.perf_counter()
        try:
            task = Task.from_dict(assignment.task, source=f"assignment {assignment.request_id}")
            t0 = time.perf_counter()
            async with asyncio.timeout(self.config.setup_timeout_s):
                await run_setup(controller, task.config, SetupContext(self.downloads, task.id))
            traj.timings["setup_s"] = time.perf_counter() - t0
            last_action = await self._loop(controller, task, traj)
            t0 = time.perf_counter()
            async with asyncio.timeout(self.config.setup_timeout_s):
                traj.score = float(await evaluate(controller, task, last_action, self.downloads))
            traj.timings["evaluate_s"] = time.perf_counter() - t0
            traj.outcome = self._outcome(traj, last_action).value
        except (DesktopError, TaskSetupError, EvaluationError, TaskFormatError, TimeoutError) as e:
            traj.outcome, traj.error = Outcome.ENV_ERROR.value, f"{type(e).__name__}: {e or 'deadline passed'}"
        except (PolicyUnavailable, PolicyRequestError, GenerationAborted) as e:
            traj.outcome, traj.error = Outcome.ABORTED.value, f"{type(e).__name__}: {e}"
        traj.timings["episode_s"] = time.perf_counter() - started
        return traj

    def _outcome(self, traj: Trajectory, last_action: str | None) -> Outcome:
        if traj.score >= SUCCESS_SCORE:
            return Outcome.SUCCESS
        if not traj.format_ok:
            return Outcome.POLICY_ERROR
        if last_action is None:
            return Outcome.TRUNCATED
        return Outcome.FAILURE

    async def _loop(self, controller: ControllerClient, task: Task, traj: Trajectory) -> str | None:
        """The step loop; returns the terminal action ("DONE" or "FAIL"), or None if the budget ran out."""
        cfg = self.config
        replies: list[str] = []
        shot_of_step: list[int] = []  # observation i -> its index in traj.screenshots (duplicates stored once)
        for _ in range(cfg.max_steps):
            t0 = time.perf_counter()
            async with asyncio.timeout(cfg.step_timeout_s):
                shot = await controller.screenshot(cfg.screenshot_format, cfg.screenshot_quality)
            shot_of_step.append(add_screenshot(traj.screenshots, shot))
            observe_s = time.perf_counter() - t0
            prompt = build_messages(task.instruction, replies, history_images=cfg.history_images,
                                    style=cfg.prompt_style)
            image_indices = [shot_of_step[i] for i in prompt.image_indices]
            prompt_ids = self.encoder.encode(prompt.messages, [cfg.screen_size] * len(image_indices))
            gen = await self.policy.generate(
                input_ids=prompt_ids, images=[traj.screenshots[i] for i in image_indices],
                sampling_params=self.sampling_params, rid=f"{traj.trajectory_id}-{len(traj.steps)}",
                episode_id=traj.trajectory_id)
            if gen.finish_reason == "abort":  # the server gave up on it: not a reply the policy chose
                raise GenerationAborted(f"{gen.url} aborted request {traj.trajectory_id}-{len(traj.steps)} after "
                                        f"{len(gen.output_ids)} tokens")
            step = Step(prompt_ids=prompt_ids, image_indices=image_indices, output_ids=gen.output_ids,
                        logprobs=gen.logprobs, versions=gen.token_versions, text=gen.text, action="",
                        generate_s=gen.latency_s, observe_s=observe_s)
            traj.steps.append(step)
            try:
                parsed = parse_reply(gen.text, resized_size=self.resized_size, screen_size=cfg.screen_size,
                                     coordinate_mode=cfg.coordinate_mode)
            except ActionParseError as e:
                traj.format_ok, traj.error = False, f"ActionParseError: {e}"
                return "FAIL"
            step.action = "; ".join(describe(a) for a in parsed.actions)
            replies.append(gen.text)
            action = parsed.action
            if action.kind == "finished":
                return "DONE"
            if action.kind == "fail":
                return "FAIL"
            t0 = time.perf_counter()
            to_commands = ACTION_BACKENDS[cfg.action_backend]
            for a in parsed.actions:
                for command in to_commands(a):
                    async with asyncio.timeout(cfg.step_timeout_s):
                        result = await controller.execute(command, timeout=cfg.step_timeout_s)
                    if result.get("returncode", 0) != 0:
                        log.debug("action %s exited %s: %s", command, result.get("returncode"), result.get("error"))
            step.act_s = time.perf_counter() - t0
        return None


def add_screenshot(screenshots: list[bytes], shot: bytes) -> int:
    """Append ``shot`` unless identical bytes are already in ``screenshots``; return its index there.

    An unchanged screen (same pixels, same cursor) encodes to the same bytes, so a trajectory carries each
    distinct screenshot once and steps reference it by index (``Step.image_indices``). O(len) byte compares.
    """
    for i, earlier in enumerate(screenshots):
        if earlier == shot:
            return i
    screenshots.append(shot)
    return len(screenshots) - 1


def describe(action: Action) -> str:
    """A compact, log-friendly form of an action, e.g. ``click(640,360)`` or ``type('hello')``."""
    if action.point is not None:
        args = f"{action.point[0]:.0f},{action.point[1]:.0f}"
        if action.end_point is not None:
            args += f",{action.end_point[0]:.0f},{action.end_point[1]:.0f}"
        return f"{action.kind}({args})"
    detail = action.text if action.text is not None else action.key or action.direction or ""
    return f"{action.kind}({detail!r})" if detail else f"{action.kind}()"
