"""One episode on one desktop: setup -> (screenshot -> prompt -> /generate -> parse -> act)* -> evaluate.

Owns: the mapping from what happens in an episode to a Trajectory and its Outcome:

| what happened                                   | outcome       | trained on |
|-------------------------------------------------|---------------|------------|
| score > threshold (whatever ended the loop)     | SUCCESS       | yes        |
| agent said finished / FAIL, score <= threshold  | FAILURE       | yes        |
| step budget ran out, score <= threshold         | TRUNCATED     | yes        |
| no try of a step's reply parsed (episode ends there, scored 0) | POLICY_ERROR | yes, with ARPO's format penalty |
| desktop died, controller timed out, setup or evaluator failed | ENV_ERROR | no |
| a setup or evaluator step needs a program the desktop image lacks (kind app_missing) | TASK_ERROR | no |
| inference server unreachable after all retries  | ABORTED       | no         |
| no policy reply within actors.policy_timeout_s  | ABORTED (PolicyTimeout) | no |
| the server aborted a generation (finish_reason abort) | ABORTED | no         |

The threshold is ``learner.success_threshold`` (ARPO's 0.1), applied by :func:`arpo_async.success.is_success`,
the run's one definition of success. The reward always comes from the evaluator reading the desktop's real state
after the episode, never from the actor's own bookkeeping. Sampled token ids, their behaviour log-probs and weight
versions are recorded exactly as the server returned them (tokens in, tokens out).

Replies that do not parse: a step asks the policy again up to ``actors.reply_retries`` times (re-asks sampled at
temperature >= 1.0, :func:`reask_params`) and keeps the first reply that parses; only that reply is the step
(discarded tries leave no tokens, so nothing is trained on them and they carry no format penalty). When no try
parses, the last one is the step, the episode ends POLICY_ERROR with ``format_ok`` False, and its last action is
``actors.evaluation.PARSE_ERROR_ACTION``, which scores 0.0 on every task: only a FAIL the agent chose
(``call_user()``) wins an infeasible task. Source: OSWorld's UI-TARS agent (https://github.com/xlang-ai/OSWorld,
mm_agents/uitars_agent.py, ``UITARSAgent.predict``; the upstream repository could not be fetched here, read in the
copy in MacPaw/MacArena at dcdc7d36) asks at most ``try_times = 3`` times, re-asks at ``temperature = 1`` after a
parse failure, and then returns ``["DONE"]`` ("client error"), which OSWorld's evaluator runs the metric on. We
differ in scoring that end 0 on every task (the agent never said it was done) and in the default of 0 re-asks
for training (ARPO's gui_agent.py ends the trajectory at the first unparseable reply with format reward -1);
`arpo eval` asks 3 times in all, as OSWorld does.

Without a learner: :meth:`EpisodeRunner.run_task` runs one episode of a task (a Task, a task dict or a
built-in task id, :func:`load_task`) and hands the trajectory to a sink (actors.sinks); the policy may be any
``actors.policy.Policy`` or async callable. Actions are performed by :func:`perform` (also used by
actors.desktop_env.DesktopEnv), through the ``actors.action_backend`` executor.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from actors.desktop.controller_client import ControllerClient, DesktopError
from actors.evaluation import (PARSE_ERROR_ACTION, EvaluationError, SetupContext, TaskSetupError, evaluate,
                               run_setup)
from actors.osworld.downloads import DownloadCache
from actors.policy import GenerateFn, Policy, PolicyTimeout, as_policy
from actors.settle import settle
from actors.sinks import TrajectorySink
from actors.uitars.actions import Action, ActionParseError, Parsed, parse_reply
from actors.uitars.grammar import action_regex
from arpo_async.prompt import build_messages
from actors.uitars import pyautogui, xdotool
from arpo_async.config import ActorConfig
from arpo_async.inference_client import Generation, GenerationAborted, PolicyRequestError, PolicyUnavailable
from arpo_async.messages import Assignment, Outcome, Step, Trajectory
from arpo_async.success import DEFAULT_SUCCESS_THRESHOLD, is_success
from arpo_async.model.inputs import PromptEncoder
from arpo_async.text import encodable
from arpo_async.tasks import BUILTIN_DIR, Task, TaskFormatError, load_task_file, load_tasks

log = logging.getLogger(__name__)

RELATIVE_MAX = 999
"""Largest coordinate of ``coordinate_mode = "relative1000"`` (x / 1000 of the screen width; 3 digits)."""
CURRENT_CONTROLLER: contextvars.ContextVar[ControllerClient] = contextvars.ContextVar("arpo_current_controller")
"""The controller of the desktop whose episode is running in this asyncio task (set by :meth:`EpisodeRunner.run`).

A policy's ``generate`` runs in the episode's task, so a policy that needs more than the screenshot (an
accessibility tree, a file, a scripted oracle reading the app's layout) gets the desktop with
``CURRENT_CONTROLLER.get()``. Raises LookupError outside an episode."""
REASK_TEMPERATURE = 1.0
"""Sampling temperature of a re-ask after an unparseable reply, at least (OSWorld's UI-TARS agent: 1)."""
ACTION_BACKENDS = {"xdotool": xdotool.to_commands, "pyautogui": pyautogui.to_commands}
"""``actors.action_backend`` -> Action -> argv lists run through the controller's /execute, in order."""


@dataclass(frozen=True)
class EpisodeRunner:
    """Everything an EnvActor needs to run episodes; shared by all actors of a process (stateless).

    Args:
        encoder: tokenizer + image-size logic of the policy (the same files the server and learner load).
        policy: client of the inference server(s) (PolicyClient), or any ``actors.policy.Policy``, or an async
            callable with ``Policy.generate``'s keyword arguments (wrapped by ``actors.policy.as_policy``).
        config: actor settings (step budget, sampling, screen size, history length).
        downloads: where tasks' ``download`` setup steps and ``cloud_file`` getters fetch files from (default
            ``DownloadCache()``; a run uses ``actors.osworld.downloads.run_download_cache``).
        success_threshold: an episode scored above this is a SUCCESS (``learner.success_threshold``).
    """

    encoder: PromptEncoder
    policy: Policy | GenerateFn
    config: ActorConfig
    downloads: DownloadCache = field(default_factory=DownloadCache)
    success_threshold: float = DEFAULT_SUCCESS_THRESHOLD
    keep_final_screenshot: bool = False
    """Keep the settled screen after the last action (the one the evaluator reads) in the trajectory
    (``Trajectory.final_screenshot``): ``arpo eval`` writes it as the last step's after-screen; training leaves it
    out, so the learner gets no extra image."""
    resized_size: tuple[int, int] = field(init=False)
    """(w, h) of a screenshot as the model sees it (Qwen2.5-VL smart_resize of the screen size)."""
    sampling_params: dict = field(init=False)
    """SGLang sampling_params for every /generate of an episode (with the action regex when constrained)."""

    def __post_init__(self) -> None:
        """Build the sampling parameters once; a bad grammar setting fails here, at process start.

        Raises:
            ValueError: an unknown name in ``actors.grammar_actions`` or a bad bound.
            TypeError: ``policy`` is neither a Policy nor an async callable (None is allowed for a runner used
                only for its sampling parameters; it cannot run episodes).
        """
        if self.policy is not None:
            object.__setattr__(self, "policy", as_policy(self.policy))
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
        """Run one assigned rollout to its end and return its trajectory. Every step of the episode (task load,
        setup, the policy loop, evaluation) runs under one boundary: a desktop fault or a missed deadline ends it
        as ENV_ERROR, an inference server that stays away as ABORTED, and anything else it raises (a task that
        does not load, a setup step, getter, metric or controller answer that fails in a way nobody expected) as
        TASK_ERROR; the trajectory's ``error`` carries the exception's type and message, and the caller goes on.
        The assignment's ``max_steps`` and ``temperature`` (an evaluation episode's) replace actors.max_steps and
        the sampling temperature when set (0 / negative: the actor's own).

        Raises:
            asyncio.CancelledError: the actor is shutting down (nothing is sent; the learner re-issues the rollout).
        """
        traj = Trajectory(
            trajectory_id=uuid.uuid4().hex, actor_id=actor_id, task_id=str(assignment.task.get("id", "")),
            group_id=assignment.group_id, rollout_index=assignment.rollout_index, outcome=Outcome.ABORTED,
            score=0.0, format_ok=True, steps=[], screenshots=[], assigned_version=assignment.policy_version,
            desktop=desktop, grammar=self.sampling_params.get("regex", ""))
        started = time.perf_counter()
        token = CURRENT_CONTROLLER.set(controller)
        try:
            task = Task.from_dict(assignment.task, source=f"assignment {assignment.request_id}")
            t0 = time.perf_counter()
            async with asyncio.timeout(self.config.setup_timeout_s):
                await run_setup(controller, task.config, SetupContext(self.downloads, task.id))
            traj.timings["setup_s"] = time.perf_counter() - t0
            params = (self.sampling_params if assignment.temperature < 0
                      else {**self.sampling_params, "temperature": assignment.temperature})
            last_action = await self._loop(controller, task, traj, max_steps=assignment.max_steps or None,
                                           sampling_params=params)
            t0 = time.perf_counter()
            async with asyncio.timeout(self.config.setup_timeout_s):
                traj.score = float(await evaluate(controller, task, last_action, self.downloads))
            traj.timings["evaluate_s"] = time.perf_counter() - t0
            traj.outcome = episode_outcome(traj.score, traj.format_ok, last_action, self.success_threshold)
        except (DesktopError, TaskSetupError, EvaluationError, TimeoutError) as e:
            # a program the image lacks fails every episode of the task alike: the task's fault, set aside after
            # learner.task_error_limit, not the desktop's (an ENV_ERROR is retried on a fresh desktop)
            missing = getattr(e, "kind", "") == "app_missing"
            traj.outcome = Outcome.TASK_ERROR if missing else Outcome.ENV_ERROR
            traj.error = f"{type(e).__name__}: {e or 'deadline passed'}"
        except (PolicyUnavailable, PolicyRequestError, GenerationAborted) as e:
            traj.outcome, traj.error = Outcome.ABORTED, f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - the episode's boundary: the task's fault stays in its episode
            traj.outcome, traj.error = Outcome.TASK_ERROR, f"{type(e).__name__}: {e}"[:2000]
            log.warning("task %s raised %s in an episode (TASK_ERROR)", traj.task_id, traj.error[:300],
                        exc_info=log.isEnabledFor(logging.DEBUG))
        finally:
            CURRENT_CONTROLLER.reset(token)
        traj.error = encodable(traj.error)  # an exception's text may quote what a desktop or a task file said
        traj.timings["episode_s"] = time.perf_counter() - started
        return traj

    async def run_task(self, controller: ControllerClient, task: Task | dict | str,
                       sink: TrajectorySink | None = None, *, actor_id: str = "local", desktop: str = "",
                       group_id: str = "", rollout_index: int = 0, policy_version: int = 0) -> Trajectory:
        """Run one episode of ``task`` on a desktop without a learner; hand the trajectory to ``sink``.

        Builds the Assignment a learner would send (request id ``local-<hex>``, group id ``group_id`` or the
        task id, ``rollout_index``, ``policy_version``) and calls :meth:`run`. The desktop should be in its boot
        state (a fresh container, or ``DesktopEnv.reset_desktop()``).

        Args:
            controller: the desktop's controller client.
            task: a Task, an OSWorld task dict or a built-in task id / task file path (:func:`load_task`).
            sink: where the trajectory goes (``actors.sinks``: ListSink, JsonlSink, or a LearnerLink); None = only
                returned.
        Returns:
            The trajectory (also submitted to ``sink``); env and policy faults are its outcome, not exceptions.
        Raises:
            TaskFormatError: ``task`` is an unknown id, or an invalid task.
            asyncio.CancelledError: cancelled (nothing is submitted).
        """
        resolved = load_task(task)
        assignment = Assignment(request_id=f"local-{uuid.uuid4().hex[:12]}", task=resolved.to_dict(),
                                group_id=group_id or resolved.id, rollout_index=rollout_index,
                                policy_version=policy_version)
        traj = await self.run(controller, assignment, actor_id, desktop)
        if sink is not None:
            await sink.submit(traj)
        return traj

    async def _loop(self, controller: ControllerClient, task: Task, traj: Trajectory, *,
                    max_steps: int | None = None, sampling_params: dict | None = None) -> str | None:
        """The step loop; returns the terminal action ("DONE" or "FAIL", the agent's own; PARSE_ERROR_ACTION when
        no try of a step's reply parsed, :meth:`_ask`), or None if the budget ran out. Every
        screenshot after an action, and the screen after the last one, waits for the screen to settle
        (actors.settle), so the policy sees what its action did and the evaluator reads the app after it.
        ``max_steps`` and ``sampling_params`` override actors.max_steps and :attr:`sampling_params` (an
        Assignment's own step budget and temperature, e.g. an evaluation episode's)."""
        cfg = self.config
        replies: list[str] = []
        shot_of_step: list[int] = []  # observation i -> its index in traj.screenshots (duplicates stored once)
        for k in range(max_steps or cfg.max_steps):
            t0 = time.perf_counter()
            async with asyncio.timeout(cfg.step_timeout_s):
                shot = await (self._settled(controller, traj.steps[-1]) if k else
                              controller.screenshot(cfg.screenshot_format, cfg.screenshot_quality))
            shot_of_step.append(add_screenshot(traj.screenshots, shot))
            observe_s = time.perf_counter() - t0
            prompt = build_messages(task.instruction, replies, history_images=cfg.history_images,
                                    style=cfg.prompt_style)
            image_indices = [shot_of_step[i] for i in prompt.image_indices]
            prompt_ids = self.encoder.encode(prompt.messages, [cfg.screen_size] * len(image_indices))
            # The learner trains on prompt_ids (pads expanded); the server gets one pad per image and expands it
            # to the same ids (PromptEncoder.collapse_image_pads says why SGLang needs this form).
            gen, parsed = await self._ask(traj, prompt_ids, [traj.screenshots[i] for i in image_indices],
                                          sampling_params or self.sampling_params)
            step = Step(prompt_ids=prompt_ids, image_indices=image_indices, output_ids=gen.output_ids,
                        logprobs=gen.logprobs, versions=gen.token_versions, text=gen.text, action="",
                        generate_s=gen.latency_s, observe_s=observe_s)
            traj.steps.append(step)
            step.acted_at = time.time()  # OSWorld's action_timestamp: just before the action (or the end) is taken
            if parsed is None:  # no try parsed: POLICY_ERROR, and never FAIL (module docstring)
                return PARSE_ERROR_ACTION
            step.action = "; ".join(describe(a) for a in parsed.actions)
            replies.append(gen.text)
            action = parsed.action
            if action.kind == "finished":
                return "DONE"
            if action.kind == "fail":
                return "FAIL"
            step.act_s = await perform(controller, parsed.actions, backend=cfg.action_backend,
                                       timeout_s=cfg.step_timeout_s)
        async with asyncio.timeout(cfg.step_timeout_s):  # the last action drawn before the evaluator reads
            final = await self._settled(controller, traj.steps[-1] if traj.steps else None)
        if self.keep_final_screenshot:
            traj.final_screenshot = add_screenshot(traj.screenshots, final)
        return None

    async def _ask(self, traj: Trajectory, prompt_ids: list[int], images: list[bytes],
                   params: dict) -> tuple[Generation, Parsed | None]:
        """The step's reply and its parse; a reply that does not parse is discarded and the policy asked again,
        up to ``actors.reply_retries`` times, each re-ask sampled by :func:`reask_params` (OSWorld's UI-TARS agent,
        module docstring). Returns the kept reply and its actions, or the last try and None when no try parsed
        (then ``traj.format_ok`` is False and ``traj.error`` quotes the last parse error and the try count).
        Discarded tries leave no step and no tokens in the trajectory; their seconds go to
        ``traj.timings["reask_s"]``.

        Raises:
            GenerationAborted: the server aborted the generation, or ran another prompt than ``prompt_ids``;
            PolicyTimeout and what the policy raises (:meth:`_generate`).
        """
        cfg, rid = self.config, f"{traj.trajectory_id}-{len(traj.steps)}"
        for attempt in range(cfg.reply_retries + 1):
            gen = await self._generate(input_ids=self.encoder.collapse_image_pads(prompt_ids), images=images,
                                       sampling_params=reask_params(params) if attempt else params,
                                       rid=f"{rid}-try{attempt + 1}" if attempt else rid,
                                       episode_id=traj.trajectory_id)
            if gen.finish_reason == "abort":  # the server gave up on it: not a reply the policy chose
                raise GenerationAborted(f"{gen.url} aborted request {rid} after {len(gen.output_ids)} tokens")
            if gen.prompt_tokens and gen.prompt_tokens != len(prompt_ids):  # it ran other ids than we would train on
                raise GenerationAborted(f"{gen.url} ran a prompt of {gen.prompt_tokens} tokens for request "
                                        f"{rid}, the learner would train on {len(prompt_ids)}: its image pad counts "
                                        f"differ (is every screenshot {cfg.screen_size[0]}x{cfg.screen_size[1]}, "
                                        "actors.screen_width/height, and min/max pixels one value in "
                                        "preprocessor_config.json?)")
            try:
                return gen, parse_reply(gen.text, resized_size=self.resized_size, screen_size=cfg.screen_size,
                                        coordinate_mode=cfg.coordinate_mode)
            except ActionParseError as e:
                error = f"ActionParseError: {e}"
            if attempt < cfg.reply_retries:
                traj.timings["reask_s"] = traj.timings.get("reask_s", 0.0) + gen.latency_s
                log.info("task %s request %s: the reply did not parse (%s); asking again (try %d of %d)",
                         traj.task_id, rid, error[:200], attempt + 2, cfg.reply_retries + 1)
        tries = f" (the reply of try {cfg.reply_retries + 1} of {cfg.reply_retries + 1}; none parsed)"
        traj.format_ok, traj.error = False, error + (tries if cfg.reply_retries else "")
        return gen, None

    async def _generate(self, **request) -> Generation:
        """``policy.generate(**request)`` under the deadline ``actors.policy_timeout_s`` (every try and backoff wait
        of the call together).

        Raises:
            PolicyTimeout: no reply within the deadline (the call is cancelled); what the policy raises otherwise
                (a TimeoutError of its own included) propagates unchanged.
        """
        deadline = asyncio.timeout(self.config.policy_timeout_s)
        try:
            async with deadline:
                return await self.policy.generate(**request)
        except TimeoutError:
            if not deadline.expired():
                raise
            url = getattr(self.policy, "url", "")  # OpenAIChatPolicy's endpoint
            raise PolicyTimeout(f"no reply from {type(self.policy).__name__}{f' at {url}' if url else ''} for "
                                f"request {request.get('rid')} within actors.policy_timeout_s = "
                                f"{self.config.policy_timeout_s:g} s") from None

    async def _settled(self, controller: ControllerClient, step: Step | None) -> bytes:
        """The screen once it has settled after ``step``'s action (actors.settle, ``actors.settle_*``); the wait's
        seconds and whether it hit the timeout go to ``step.settle_s`` and ``step.settle_timed_out``."""
        cfg = self.config
        settled = await settle(controller, cfg.screenshot_format, cfg.screenshot_quality,
                               interval_s=cfg.settle_interval_s, timeout_s=cfg.settle_timeout_s)
        if step is not None:
            step.settle_s, step.settle_timed_out = settled.seconds, settled.timed_out
        return settled.screenshot


def reask_params(params: dict) -> dict:
    """Sampling parameters of a re-ask after a reply that did not parse: ``params`` with the temperature raised to
    :data:`REASK_TEMPERATURE` when below it (a greedy request would return the same reply again; a hotter one is
    kept). Source: OSWorld's mm_agents/uitars_agent.py (module docstring) sets ``temperature = 1`` after a parse
    failure."""
    return {**params, "temperature": max(float(params.get("temperature", REASK_TEMPERATURE)), REASK_TEMPERATURE)}


def episode_outcome(score: float, format_ok: bool, last_action: str | None,
                    success_threshold: float = DEFAULT_SUCCESS_THRESHOLD) -> Outcome:
    """The outcome of an evaluated episode (the module docstring's table): its evaluator ``score``, whether every
    reply parsed, how the step loop ended ("DONE", "FAIL", or None when the step budget ran out), and the score
    above which it is a SUCCESS (:func:`arpo_async.success.is_success`)."""
    if is_success(score, success_threshold):
        return Outcome.SUCCESS
    if not format_ok:
        return Outcome.POLICY_ERROR
    if last_action is None:
        return Outcome.TRUNCATED
    return Outcome.FAILURE


async def perform(controller: ControllerClient, actions: Sequence[Action], *, backend: str = "xdotool",
                  timeout_s: float = 120.0) -> float:
    """Perform ``actions`` in the desktop, in order, and return the seconds it took.

    Each action becomes argv lists (``ACTION_BACKENDS[backend]``: actors.uitars.xdotool or .pyautogui) run
    through the controller's /execute; ``finished``, ``fail`` and ``wait`` produce no command. A command that
    exits non-zero is logged at DEBUG (the screenshot shows what happened), not raised.

    Raises:
        KeyError: an unknown ``backend``.
        DesktopError: the controller is unreachable; TimeoutError: one command took over ``timeout_s``.
    """
    to_commands = ACTION_BACKENDS[backend]
    t0 = time.perf_counter()
    for a in actions:
        for command in to_commands(a):
            async with asyncio.timeout(timeout_s):
                result = await controller.execute(command, timeout=timeout_s)
            if result.get("returncode", 0) != 0:
                log.debug("action %s exited %s: %s", command, result.get("returncode"), result.get("error"))
    return time.perf_counter() - t0


def load_task(task: Task | dict | str | Path) -> Task:
    """A Task from a Task (returned as is), an OSWorld task dict, a task file path, or a built-in task id.

    Raises:
        TaskFormatError: an invalid dict or file, or a string that is neither a file nor a built-in id (the
            message lists the built-in ids).
        TypeError: any other type.
    """
    if isinstance(task, Task):
        return task
    if isinstance(task, dict):
        return Task.from_dict(task, check_names=True)
    if isinstance(task, (str, Path)):
        if Path(task).is_file():
            return load_task_file(task)
        builtin = {t.id: t for t in load_tasks(BUILTIN_DIR)}
        if str(task) in builtin:
            return builtin[str(task)]
        raise TaskFormatError(f"{str(task)!r} is neither a task file nor a built-in task id "
                              f"(built-in: {', '.join(sorted(builtin))})")
    raise TypeError(f"a task is a Task, a task dict, a file path or a built-in id; got {type(task).__name__}")


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
