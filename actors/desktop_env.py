"""DesktopEnv: one desktop as a step-by-step async environment, for agents that run their own loop.

Role: the embedding API over one container. ``reset(task) -> Observation``, ``step(action) -> Observation``,
``evaluate() -> float``, as an async context manager that starts its own desktop container (DesktopFleet, run
config defaults from arpo_async.config.ActorConfig) and removes it on exit, whatever happens.

Everything goes through the same code the actors use: the task's setup steps and OSWorld-style scoring
(actors.evaluation), the UI-TARS parser (actors.uitars.parse_reply) and the executor chosen by
``actors.action_backend`` (actors.episode.perform); a desktop used before is put back to its boot state in place
(the controller's POST /reset, as DesktopPool does between episodes) before the next task's setup.

Invariants: ``step`` and ``evaluate`` need a ``reset`` first; after a ``finished(...)`` or ``call_user()`` action
the episode is over (``Observation.done``) and ``step`` refuses more actions until the next ``reset``.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Self

from actors.desktop.build import DesktopBuildError, image_exists, image_tag
from actors.desktop.controller_client import ControllerClient, DesktopError
from actors.desktop.fleet import DEFAULT_SOCKET_ROOT, Desktop, DesktopFleet
from actors.episode import load_task, perform
from actors.evaluation import FAIL_ACTION, SetupContext, evaluate, run_setup
from actors.settle import settled_screenshot
from actors.osworld.downloads import DownloadCache
from actors.uitars.actions import Action, parse_reply, smart_resize
from arpo_async.config import ActorConfig
from arpo_async.tasks import Task

log = logging.getLogger(__name__)

Coordinates = Literal["screen", "relative1000", "absolute"]
"""How the x, y of a UI-TARS action string are read: "screen" = pixels of the screen (what Observation's
screenshot shows); "relative1000" = 0..999 of each side (Qwen2-VL-era UI-TARS); "absolute" = pixels of the
screenshot after Qwen2.5-VL's smart_resize (UI-TARS-1.5)."""


@dataclass(frozen=True)
class Observation:
    """What the agent sees after ``reset`` or ``step``.

    Attributes:
        screenshot: the screen as PNG bytes (JPEG when ``actors.screenshot_format = "jpeg"``), cursor drawn in.
        screen_size: (width, height) of the screen in pixels.
        instruction: the task's instruction.
        step: actions performed since ``reset`` (0 after ``reset``).
        done: the last action was ``finished`` or ``call_user`` (FAIL): call ``evaluate``.
    """

    screenshot: bytes
    screen_size: tuple[int, int]
    instruction: str
    step: int = 0
    done: bool = False


class DesktopEnv:
    """One desktop container, driven step by step (see the module docstring).

    Use::

        async with DesktopEnv() as env:
            obs = await env.reset("grid4-green")
            obs = await env.step("click(start_box='(640,360)')")
            obs = await env.step("finished()")
            score = await env.evaluate()

    Args:
        config: actor settings: screen size, container memory and process limits, image (``image`` or
            ``image_profile``), ``action_backend``, ``setup_timeout_s``, ``step_timeout_s``, screenshot format.
            Default ``ActorConfig()``, the run config's defaults.
        coordinates: how action strings' coordinates are read (:data:`Coordinates`); default screen pixels.
        run_id: the ``arpo.run`` label of the container (default ``env-<random>``); every container with that
            label is removed on exit, so do not share it with a run.
        downloads: where tasks' download steps fetch from (default ``DownloadCache()``).
        socket_root: host folder of the controller's Unix socket (DesktopFleet's default).

    Raises:
        ValueError: an unknown ``coordinates``.
    """

    def __init__(self, config: ActorConfig | None = None, *, coordinates: Coordinates = "screen",
                 run_id: str = "", downloads: DownloadCache | None = None,
                 socket_root: Path = DEFAULT_SOCKET_ROOT) -> None:
        if coordinates not in ("screen", "relative1000", "absolute"):
            raise ValueError(f"coordinates must be 'screen', 'relative1000' or 'absolute', got {coordinates!r}")
        self.config = config or ActorConfig()
        self.coordinates = coordinates
        self.image = self.config.image or image_tag(self.config.image_profile)
        self.fleet = DesktopFleet(self.image, run_id or f"env-{secrets.token_hex(4)}", socket_root=socket_root,
                                  screen=self.config.screen_size, memory_mb=self.config.desktop_memory_mb,
                                  pids_limit=self.config.desktop_pids)
        self.downloads = downloads or DownloadCache()
        self.desktop: Desktop | None = None
        """The running desktop (container name, id, controller); None outside ``async with``."""
        self.task: Task | None = None
        """The task of the current episode; None before the first ``reset``."""
        self._used = False
        self._steps = 0
        self._last_action: str | None = None

    # ---- lifecycle -------------------------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        """Start the desktop container.

        Raises:
            DesktopError: the image is missing (build it with ``arpo desktop build``), Docker is unreachable, or
                the desktop did not come up (with the container's last log lines).
        """
        try:
            present = await asyncio.to_thread(image_exists, self.image)
        except DesktopBuildError as exc:  # no docker command
            raise DesktopError(str(exc)) from exc
        if not present:
            raise DesktopError(f"desktop image {self.image} is missing: build it with `arpo desktop build"
                               f"{'' if self.config.image_profile == 'default' else ' --profile osworld'}`")
        try:
            self.desktop = await self.fleet.start()
        except BaseException:
            await self.fleet.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Remove the container (and any other of this env's run label) and close the Docker client."""
        self.desktop = None
        try:
            await self.fleet.remove_all()
        finally:
            await self.fleet.close()

    @property
    def controller(self) -> ControllerClient:
        """The desktop's OSWorld-API controller client (screenshots, /execute, files, accessibility tree).

        Raises:
            RuntimeError: outside ``async with``.
        """
        if self.desktop is None:
            raise RuntimeError("DesktopEnv is not started: use `async with DesktopEnv() as env:`")
        return self.desktop.controller

    # ---- episodes --------------------------------------------------------------------------------------
    async def reset_desktop(self) -> ControllerClient:
        """Put the desktop back to its boot state if an episode used it (POST /reset; a desktop whose reset fails
        is replaced by a new container) and return its controller: for callers that run their own episode on
        it, e.g. ``EpisodeRunner.run_task(await env.reset_desktop(), task, sink)``.

        Raises:
            RuntimeError: outside ``async with``; DesktopError: no replacement desktop could be started.
        """
        controller = self.controller
        if self._used:
            try:
                await controller.reset(timeout=self.config.step_timeout_s)
            except DesktopError as exc:
                log.warning("in-place reset of %s failed (%s); starting a new desktop", self.desktop.name, exc)
                old, self.desktop = self.desktop, None
                await self.fleet.remove(old)
                self.desktop = await self.fleet.start()
                controller = self.desktop.controller
        self._used = True
        self.task, self._steps, self._last_action = None, 0, None
        return controller

    async def reset(self, task: Task | dict | str) -> Observation:
        """Start an episode of ``task``: reset the desktop, run the task's setup steps, take a screenshot.

        Args:
            task: a Task, an OSWorld task dict, a task file path or a built-in task id (e.g. "grid4-green").
        Raises:
            TaskFormatError: unknown id or invalid task; TaskSetupError: a setup step failed; DesktopError: the
            desktop is unreachable; TimeoutError: setup took over ``setup_timeout_s``.
        """
        resolved = load_task(task)
        controller = await self.reset_desktop()
        async with asyncio.timeout(self.config.setup_timeout_s):
            await run_setup(controller, resolved.config, SetupContext(self.downloads, resolved.id))
        self.task = resolved
        return await self._observe()

    async def step(self, action: str | Action) -> Observation:
        """Perform one action and return the screen after it, once it has settled (actors.settle).

        Args:
            action: a UI-TARS action string (``"click(start_box='(10,20)')"``, ``"type(content='hi')"``,
                ``"hotkey(key='ctrl s')"``, ``"finished()"``, ``"call_user()"``...; a full reply with
                ``Thought: ... Action: ...`` is fine too), coordinates read as ``coordinates`` says; or an
                ``actors.uitars.Action`` in screen pixels.
        Raises:
            RuntimeError: no ``reset`` yet, or the episode is over (``done``).
            ActionParseError: the string is not a UI-TARS action (the message says why).
            TypeError: ``action`` is neither a str nor an Action.
            DesktopError / TimeoutError: the desktop failed or a command took over ``step_timeout_s``.
        """
        if self.task is None:
            raise RuntimeError("call reset(task) before step()")
        if self._last_action is not None:
            raise RuntimeError(f"the episode is over (the agent said {self._last_action}); call reset(task)")
        if isinstance(action, Action):
            actions: tuple[Action, ...] = (action,)
        elif isinstance(action, str):
            text = action if "Action:" in action else f"Action: {action}"
            actions = parse_reply(text, resized_size=self._model_size(), screen_size=self.config.screen_size,
                                  coordinate_mode="relative1000" if self.coordinates == "relative1000"
                                  else "absolute").actions
        else:
            raise TypeError(f"an action is a UI-TARS string or an Action, got {type(action).__name__}")
        kinds = {a.kind for a in actions}
        if "finished" in kinds:
            self._last_action = "DONE"
        elif "fail" in kinds:
            self._last_action = FAIL_ACTION
        else:
            await perform(self.controller, actions, backend=self.config.action_backend,
                          timeout_s=self.config.step_timeout_s)
        self._steps += 1
        return await self._observe(settle=self._last_action is None)  # an action was performed: let it draw

    async def evaluate(self) -> float:
        """Score the episode from the desktop's real state with the task's evaluator (OSWorld's semantics,
        actors.evaluation.evaluate): a float in [0, 1]; an agent that said ``call_user()`` scores 1.0 on an
        infeasible task and 0.0 on any other.

        Raises:
            RuntimeError: no ``reset`` yet; EvaluationError / TaskSetupError: the evaluator or its postconfig
            failed; DesktopError: the desktop is unreachable; TimeoutError: over ``setup_timeout_s``.
        """
        if self.task is None:
            raise RuntimeError("call reset(task) before evaluate()")
        async with asyncio.timeout(self.config.setup_timeout_s):
            return float(await evaluate(self.controller, self.task, self._last_action, self.downloads))

    # ---- helpers ---------------------------------------------------------------------------------------
    def _model_size(self) -> tuple[int, int]:
        """The (w, h) that action coordinates are relative to, for parse_reply's "absolute" mode."""
        width, height = self.config.screen_size
        if self.coordinates == "absolute":
            return tuple(smart_resize(width=width, height=height))
        return width, height

    async def _observe(self, settle: bool = False) -> Observation:
        """The observation now; ``settle``: after an action, once the screen has settled (actors.settle)."""
        cfg = self.config
        async with asyncio.timeout(cfg.step_timeout_s):
            if settle:
                shot = await settled_screenshot(self.controller, cfg.screenshot_format, cfg.screenshot_quality,
                                                interval_s=cfg.settle_interval_s, timeout_s=cfg.settle_timeout_s)
            else:
                shot = await self.controller.screenshot(cfg.screenshot_format, cfg.screenshot_quality)
        return Observation(screenshot=shot, screen_size=self.config.screen_size, instruction=self.task.instruction,
                           step=self._steps, done=self._last_action is not None)
