"""Run statistics: the window of what arrived since the last optimizer step, the run's counters, the stall check,
and <run>/status.json.

Role: the learner service's bookkeeping half; it reads the run's drop counts (learner.state.RunState.drops) and never
changes a component.
Owns: :class:`WindowStats` (counts since the last optimizer step, taken by the training loop for each metrics
record), the run's ``totals`` and ``rejections`` counters (checkpointed with the service), when the last optimizer
step finished, and why no step happens while that lasts (``stall``); the event loop's lag probe (``lag``,
arpo_async.loop_lag) and the peak depth of every queue (:meth:`RunStats.watch_depths`), per metrics record and
over the run.

Invariants: a window counts each trajectory the learner takes into training once; ``take`` starts a new window;
``stall`` is None from the moment an optimizer step finishes until the stall check next finds none for
``learner.stall_warning_s``.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from arpo_async.loop_lag import LoopLag
from arpo_async.messages import Outcome
from arpo_async.stage_timings import StageTimings
from arpo_async.tasks import Task
from learner.state import RunState

log = logging.getLogger("learner.rollouts.service")


class StalledRun(RuntimeError):
    """No optimizer step for ``learner.stall_timeout_s`` while every group came back without a reward difference."""


@dataclass
class WindowStats:
    """Counts since the last optimizer step (reset by ``take``)."""

    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    """Outcome name -> trajectories received."""
    task_outcomes: collections.defaultdict[str, collections.Counter[str]] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter))
    """Task id -> outcome name -> trajectories received."""
    families: dict[str, str] = field(default_factory=dict)
    """Task id -> its family (``arpo_async.tasks.Task.family``), for every task counted."""
    stages: StageTimings = field(default_factory=StageTimings)
    """Stage timings of every trajectory received (metrics.jsonl ``stage_s``)."""

    def record(self, task: Task, outcome: str) -> None:
        """Count one received trajectory of ``task`` with ``outcome`` (an Outcome value)."""
        self.outcomes[outcome] += 1
        self.task_outcomes[task.id][outcome] += 1
        self.families[task.id] = task.family

    def take(self) -> WindowStats:
        """The counts so far; this window starts again from zero."""
        taken, fresh = replace(self), WindowStats()
        self.outcomes, self.task_outcomes, self.families = fresh.outcomes, fresh.task_outcomes, fresh.families
        self.stages = fresh.stages
        return taken


class RunStats:
    """The run's counters, the outcome window and the stall check (see the module docstring).

    Args:
        state: the run's state: its zero-variance drop count feeds the stall rule (the run's counters are its
            ``totals``; this class keeps only ``rejections`` and the window of its own).
    """

    def __init__(self, state: RunState) -> None:
        self._drops = state.drops
        self.window = WindowStats()
        self.rejections: collections.Counter[str] = collections.Counter()
        """Messages rejected, by reason (``wire`` for ones the codec refused, ``handler`` for internal errors,
        else arpo_async.validation.InvalidMessage.reason)."""
        self.started = time.monotonic()
        self.last_step_at = self.started
        """When the last optimizer step finished (or training started, after a task pre-pass)."""
        self.zero_variance_at_step = 0
        """The zero-variance drop count at the last optimizer step."""
        self.stall: str | None = None
        """Why no optimizer step is happening, while that lasts (shown in status.json and the progress line)."""
        self.prepass_running = False
        """True while the task pre-pass runs (set by learner.rollouts.rounds.RoundControl.run_prepass): the stall
        check is quiet then."""
        self.lag = LoopLag()
        """The learner's event-loop lag (its :meth:`LoopLag.run` is one of the learner's tasks)."""
        self.peak_depths: collections.Counter[str] = collections.Counter()
        """Queue name -> the deepest it was seen since the last metrics record (:meth:`take_peaks`)."""
        self.run_peak_depths: collections.Counter[str] = collections.Counter()
        """Queue name -> the deepest it was seen in this process's run."""

    def on_step(self) -> None:
        """An optimizer step finished just now: restart the stall clock."""
        self.last_step_at, self.stall = time.monotonic(), None
        self.zero_variance_at_step = self._drops.get("zero_variance", 0)

    @property
    def zero_variance_since_step(self) -> int:
        """Groups dropped for having no reward difference since the last optimizer step (or training's start)."""
        return self._drops.get("zero_variance", 0) - self.zero_variance_at_step

    def training_starts(self) -> None:
        """Training starts now (after the task pre-pass): restart the stall clock."""
        self.last_step_at = time.monotonic()

    def stall_reason(self, now: float | None = None, *, after_s: float) -> str | None:
        """Why the run makes no progress, when no optimizer step happened for ``after_s`` seconds although
        groups came back, every one without a reward difference; else None (also while the task pre-pass runs)."""
        now = time.monotonic() if now is None else now
        idle = now - self.last_step_at
        flat = self._drops.get("zero_variance", 0) - self.zero_variance_at_step
        if after_s <= 0 or idle < after_s or self.prepass_running or flat <= 0:
            return None
        trajectories = sum(self.window.outcomes.values())
        successes = self.window.outcomes.get(Outcome.SUCCESS.value, 0)
        return (f"no optimizer step for {idle:.0f} s: {successes} successes in {trajectories} trajectories since "
                f"the last step, {flat} groups without a reward difference; nothing to learn from. Consider a "
                "task pre-pass (learner.prepass_k) or easier tasks")

    async def watch_stall(self, warning_s: float, timeout_s: float, period_s: float = 5.0) -> None:
        """Say why no optimizer step happens (every ``warning_s``; also kept in ``stall``), and raise StalledRun
        after ``timeout_s`` without one (0: never); quiet while the task pre-pass runs.

        Raises:
            StalledRun: no optimizer step for ``timeout_s`` while groups keep coming back without a reward
                difference.
        """
        warned_at = 0.0
        while True:
            await asyncio.sleep(period_s)
            now = time.monotonic()
            self.stall = self.stall_reason(now, after_s=warning_s)
            if self.stall and now - warned_at >= warning_s:
                log.warning("%s", self.stall)
                warned_at = now
            timeout = self.stall_reason(now, after_s=timeout_s) if timeout_s else None
            if timeout:
                raise StalledRun(f"{timeout} (learner.stall_timeout_s = {timeout_s:g} s)")

    def note_depths(self, depths: dict[str, int]) -> None:
        """Fold one sample of queue depths (name -> items) into the window's and the run's peaks."""
        for name, depth in depths.items():
            if depth > self.peak_depths[name]:
                self.peak_depths[name] = depth
            if depth > self.run_peak_depths[name]:
                self.run_peak_depths[name] = depth

    def take_peaks(self) -> dict[str, int]:
        """The peak depth of every queue since the last call (metrics.jsonl ``queues_max``); a new window starts
        at the depths of now (a queue that stays deep shows in every window)."""
        taken = {name: int(depth) for name, depth in sorted(self.peak_depths.items())}
        self.peak_depths = collections.Counter()
        return taken

    async def watch_depths(self, depths: Callable[[], dict[str, int]], period_s: float = 0.05) -> None:
        """Sample ``depths()`` (learner.rollouts.status.StatusReport.queue_depths) every ``period_s`` seconds into
        the peaks, until cancelled: a queue that fills and drains between two metrics records still shows its peak
        (to within one period)."""
        while True:
            self.note_depths(depths())
            await asyncio.sleep(period_s)

    @property
    def wall_s(self) -> float:
        """Seconds since this process's learner started."""
        return round(time.monotonic() - self.started, 3)


async def write_status(path: Path, status: Callable[[], dict[str, Any]], period_s: float = 1.0) -> None:
    """Rewrite ``path`` (<run>/status.json) with ``status()`` every ``period_s`` seconds, atomically (via a temp
    file), until cancelled."""
    while True:
        write_status_now(path, status)
        await asyncio.sleep(period_s)


def write_status_now(path: Path, status: Callable[[], dict[str, Any]]) -> None:
    """Rewrite ``path`` with ``status()`` once, atomically (via a temp file): the last word of a learner that
    stops, which the periodic writer might not get to."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(status()))
    tmp.replace(path)
