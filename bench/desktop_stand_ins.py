"""Desktop stand-ins that apply the GPU timing model's episode shape (bench/gpu_model.py: ``EpisodeModel``) around
the real actor code, for bench/bench_gpu_model.py.

Each quacks like the product's desktop pool (and its desktops' controllers) for the EnvActors, and answers the
evaluator's getter of bench_actor_loop.TASK itself ("red" = success, drawn once per episode with
``success_share``):

- :class:`ModelledController` and :class:`ModelledPool`: an in-process desktop whose app actions take modelled
  time (``action_s / time_scale`` real seconds of sleep) and whose reset costs ``reset_s``;
- :class:`PaddedController` and :class:`PaddedPool` (``--real-desktops``, run.time_scale = 1): the product's
  DesktopPool of real docker desktops, whose app actions run for real and are then padded with a sleep up to
  their modelled time; only the evaluator's answer is drawn.

The modelled GPUs (inference servers, trainer, weight publication) are bench/gpu_stand_ins.py's. Nothing here is
imported by actors/, learner/, arpo_async/ or arpo_serve/.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time

from bench.bench_actor_loop import InstantController, InstantPool
from bench.gpu_model import EpisodeModel

EVALUATOR_GETTER = ["cat", "/tmp/r"]
"""The command of bench_actor_loop.TASK's evaluator getter, whose answer the modelled desktops draw."""


class ModelledController(InstantController):
    """An instant in-process desktop whose app actions take modelled time; the evaluator's answer ("red" =
    success) is drawn once per episode (``success_share``)."""

    def __init__(self, pngs: list[bytes], episode: EpisodeModel, time_scale: float, rng: random.Random,
                 totals: collections.Counter) -> None:
        super().__init__(pngs)
        self.episode, self.scale, self.rng, self.totals = episode, time_scale, rng, totals
        self.answer = "red"

    def new_episode(self) -> None:
        self.answer = "red" if self.rng.random() < self.episode.success_share else "blue"

    async def execute(self, command, *, shell: bool = False, timeout: float = 120, setup: bool = False) -> dict:
        if command == EVALUATOR_GETTER:
            return {"status": "success", "output": self.answer, "error": "", "returncode": 0}
        seconds = self.episode.action_s(self.rng)
        self.totals["actions"] += 1
        self.totals["action_s"] += seconds
        started = time.monotonic()
        await asyncio.sleep(seconds / self.scale)
        self.totals["action_real_s"] += (time.monotonic() - started) * self.scale  # > action_s: event-loop lag
        self.totals["desktop_s"] += seconds
        return {"status": "success", "output": "", "error": "", "returncode": 0}


class ModelledPool(InstantPool):
    """``DesktopPool`` of modelled desktops: ``acquire`` costs the in-place reset (``reset_s``). ``totals``
    counts ``episodes``, ``actions``, their modelled ``action_s`` and ``action_real_s``, the modelled time they
    took in fact (longer when this process's event loop wakes up late) over all of them, and ``desktop_s``, the
    modelled desktop seconds (actions and resets)."""

    def __init__(self, pngs: list[bytes], episode: EpisodeModel, time_scale: float, seed: int = 0) -> None:
        super().__init__(pngs)
        self.episode, self.scale = episode, time_scale
        self.rng = random.Random(seed)
        self.totals: collections.Counter = collections.Counter()

    async def acquire(self):
        desktop = await super().acquire()
        controller = ModelledController(self._pngs, self.episode, self.scale, self.rng, self.totals)
        controller.new_episode()
        self.totals["episodes"] += 1
        self.totals["desktop_s"] += self.episode.reset_s
        desktop.controller = controller
        await asyncio.sleep(self.episode.reset_s / self.scale)
        return desktop


class PaddedController:
    """A real desktop's ControllerClient (every other call forwarded to it) whose app actions last at least
    their modelled time (run.time_scale = 1: modelled = real seconds).

    An app action is the step's commands (``execute``: the xdotool click, for real) and the screenshot that
    observes their result (``screenshot``, for real); once that screenshot arrived, the span is padded with a
    sleep up to ``episode.action_s`` drawn at the action's first command. A span already longer is not padded
    and counted as ``late_actions``. A step's action that no screenshot follows (the budget ran out) is settled
    before the evaluator. The evaluator's getter is answered here ("red" = success, drawn per episode with
    ``success_share``); /reset is timed. ``totals`` (shared by the pool): ``actions``, ``action_s`` (modelled),
    ``action_real_s`` (the span with its pad), ``action_work_s`` (the real commands and screenshot alone),
    ``late_actions``, ``desktop_s`` (the desktop's real seconds: padded actions, the screenshots that observe no
    action (an episode's first), the waits for a desktop); ``samples`` keeps ``work_s`` (per action),
    its parts ``click_s`` (each command) and ``shot_s`` (each screenshot), and ``reset_s`` (per /reset), for
    medians.
    """

    def __init__(self, client, episode: EpisodeModel, rng: random.Random, totals: collections.Counter,
                 samples: dict[str, list[float]]) -> None:
        self.client, self.episode, self.rng, self.totals, self.samples = client, episode, rng, totals, samples
        self.answer = "red"
        self._action: tuple[float, float] | None = None  # (monotonic start, modelled seconds) of the open action

    def __getattr__(self, name: str):
        return getattr(self.client, name)

    def new_episode(self) -> None:
        self.answer = "red" if self.rng.random() < self.episode.success_share else "blue"
        self._action = None

    async def execute(self, command, *, shell: bool = False, timeout: float = 120, setup: bool = False) -> dict:
        if command == EVALUATOR_GETTER:
            await self._settle()
            return {"status": "success", "output": self.answer, "error": "", "returncode": 0}
        started = time.monotonic()
        if self._action is None:
            self._action = (started, self.episode.action_s(self.rng))
        result = await self.client.execute(command, shell=shell, timeout=timeout, setup=setup)
        self.samples["click_s"].append(time.monotonic() - started)
        return result

    async def screenshot(self, format: str = "png", quality: int = 85) -> bytes:
        started = time.monotonic()
        shot = await self.client.screenshot(format, quality)
        self.samples["shot_s"].append(time.monotonic() - started)
        if self._action is None:
            self.totals["desktop_s"] += time.monotonic() - started
        await self._settle()
        return shot

    async def reset(self, *, timeout: float = 30.0) -> dict:
        started = time.monotonic()
        answer = await self.client.reset(timeout=timeout)
        self.samples["reset_s"].append(time.monotonic() - started)
        return answer

    async def _settle(self) -> None:
        """Pad the open action up to its modelled seconds and count it."""
        if self._action is None:
            return
        started, modelled = self._action
        work = time.monotonic() - started
        if work > modelled:
            self.totals["late_actions"] += 1
        else:
            await asyncio.sleep(modelled - work)
        self._action = None
        real = time.monotonic() - started
        self.totals["actions"] += 1
        self.totals["action_s"] += modelled
        self.totals["action_real_s"] += real
        self.totals["action_work_s"] += work
        self.totals["desktop_s"] += real
        self.samples["work_s"].append(work)


class PaddedPool:
    """Quacks like DesktopPool for the EnvActors, over the product's real one (``pool``, started by the caller):
    each desktop's controller becomes a :class:`PaddedController` for good (the pool's own /reset and /health go
    through it, so /reset is timed), and ``acquire`` draws the episode's evaluator answer. The wait for a desktop
    (a reset desktop's /health, or the end of someone's reset) counts in ``totals["desktop_s"]``.

    ``stopping``: set it before cancelling the actors (the end of a schedule); a desktop whose episode was
    cancelled is then given back reusable, so the pool resets it in place rather than booting a replacement.
    """

    def __init__(self, pool, episode: EpisodeModel, seed: int = 0) -> None:
        self.pool, self.episode = pool, episode
        self.rng = random.Random(seed)
        self.totals: collections.Counter = collections.Counter()
        self.samples: dict[str, list[float]] = collections.defaultdict(list)
        self.stopping = False

    async def acquire(self):
        started = time.monotonic()
        desktop = await self.pool.acquire()
        if not isinstance(desktop.controller, PaddedController):
            desktop.controller = PaddedController(desktop.controller, self.episode, self.rng, self.totals,
                                                  self.samples)
        desktop.controller.new_episode()
        self.totals["episodes"] += 1
        self.totals["desktop_s"] += time.monotonic() - started
        return desktop

    async def release(self, desktop, *, reusable: bool = True) -> None:
        await self.pool.release(desktop, reusable=reusable or self.stopping)
