"""Held-out evaluation during training: rounds of evaluation episodes and their results (the ``[eval]`` section).

Role: owns the evaluation task set, the round in progress (its slots waiting, running and back) and the results
not yet written to metrics.jsonl. A round is ``repeats`` episodes of every task, handed out (by learner.rollouts.peers,
ahead of training work and outside the admission rule) at the policy version of the moment, on the run's own
desktops, with the round's step budget and temperature (:attr:`arpo_async.messages.Assignment.evaluation`).

When: a fresh run starts one before its first optimizer step (:meth:`EvaluationRounds.start`); then one whenever
the optimizer step count crosses a multiple of ``every_steps``, and one on the final weights: at ``learner.steps``
(:meth:`EvaluationRounds.on_step`), or when the run stops earlier because every task is solved
(:meth:`EvaluationRounds.on_stop`). A round due while another is still running is skipped (counted in
``totals["eval_rounds_skipped"]``; the running one finishes and is recorded), except the final round: it abandons
an older round still running (whose late trajectories are then acked and ignored) and always runs (a round of the
final weights already running, or complete and not yet recorded, is the final round); the learner waits for it, at
most ``eval.final_timeout_s``, before its last record and the actors' shutdown.

Counting: the round's headline is its mean score (``eval_score``), as OSWorld's harness and leaderboard score a
task set (actors.eval.report: the mean over every planned episode, partial credit kept): an errored episode
(ENV_ERROR, TASK_ERROR, ABORTED, and a trajectory the learner rejected) scores 0 and stays in the denominator;
``eval_score_ran`` leaves the errored ones out, as OSWorld's show_result.py does. Beside it, the success rate of
earlier versions stays: an episode is a success iff its outcome is SUCCESS (score above
``learner.success_threshold``); every other outcome, errors included, counts as a failure in the denominator and
errors are counted apart (``eval_errors``). A slot whose trajectory never comes back (its actor died,
or the rollout timed out) is handed out again; nothing else is. Evaluation trajectories are acked like any other
and reach nothing but this module: not the scheduler, batcher, replay buffer, task selector, task pre-pass,
outcome window or the sample kept for `arpo view`.

Results: a complete round becomes the fields :data:`RESULT_KEYS` (``eval_score``, ``eval_task_score``,
``eval_success``, ``eval_task_success``, ``eval_policy_version``, ...), which the next metrics record carries
(:meth:`EvaluationRounds.take_result`): its ``eval_step`` is the optimizer step whose weights were evaluated (a
record's own ``step`` is the training batch it was written after). Rounds are not saved in checkpoints: a resumed
run evaluates at its next due step and at the end.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arpo_async.config import ConfigError, EvalConfig, RunConfig
from arpo_async.messages import Outcome, Trajectory
from arpo_async.task_sets import builtin_split_names, load_task_set, runnable_tasks
from arpo_async.tasks import Task, TaskFormatError
from learner.rollouts.scheduler import Rollout
from learner.state import RunState

log = logging.getLogger(__name__)

RESULT_KEYS = ("eval_score", "eval_task_score", "eval_score_ran", "eval_success", "eval_task_success",
               "eval_policy_version", "eval_step", "eval_episodes", "eval_errors", "eval_version_max", "eval_s")
"""The fields a complete round adds to a metrics record (see :meth:`EvaluationRounds.result_of`)."""
ERROR_OUTCOMES = frozenset(o for o in Outcome if not o.trainable)
"""Outcomes counted as ``eval_errors`` (and as failures): ENV_ERROR, TASK_ERROR, ABORTED."""

Slot = tuple[str, int]
"""(group id, rollout index) of one evaluation episode."""


def evaluation_tasks(config: RunConfig) -> list[Task]:
    """The tasks ``[eval]`` names (see arpo_async.config.EvalConfig): ``eval.tasks`` as an existing path, else a
    built-in split name (cut from the built-in suite), else a built-in task id or family; ``eval.split`` cuts it
    (empty ``eval.tasks``: ``learner.tasks`` or the built-in suite). [] when the run does not evaluate.

    Raises:
        ConfigError: naming ``eval.tasks`` / ``eval.split``: a folder, file, name or split that does not load, a
            split entry missing from its folder, or a task that cannot run (an evaluation set must run whole).
    """
    ev = config.eval
    if not ev.enabled:
        return []
    folder, split = ev.tasks or config.learner.tasks or None, ev.split or None
    if split is None and ev.tasks and not Path(ev.tasks).exists() and ev.tasks in builtin_split_names():
        folder, split = None, ev.tasks
    try:
        return runnable_tasks(load_task_set(folder, split))
    except TaskFormatError as error:
        raise ConfigError(f"eval.tasks = {ev.tasks!r}, eval.split = {ev.split!r}: {error}") from error


@dataclass
class EvalRound:
    """One round: ``repeats`` episodes of each task at ``version`` (the weights after optimizer step ``step``)."""

    number: int
    step: int
    version: int
    slots: dict[Slot, Task]
    """Every episode of the round and its task."""
    started: float = field(default_factory=time.monotonic)
    waiting: collections.deque[Slot] = field(default_factory=collections.deque)
    """Episodes not handed out yet (or to hand out again), oldest first."""
    running: dict[Slot, float] = field(default_factory=dict)
    """Episodes handed out -> their deadline (time.monotonic)."""
    outcomes: dict[Slot, Outcome] = field(default_factory=dict)
    """Episodes back -> how they ended."""
    scores: dict[Slot, float] = field(default_factory=dict)
    """Episodes back -> their score (0.0 for an errored one, :data:`ERROR_OUTCOMES`)."""
    version_max: int = -1
    """The newest policy version among the tokens of the episodes back (-1: none yet)."""

    @property
    def complete(self) -> bool:
        return len(self.outcomes) == len(self.slots)


class EvaluationRounds:
    """The evaluation rounds of one learner (see the module docstring).

    Args:
        tasks: the evaluation task set (non-empty; :func:`evaluation_tasks`).
        config: the ``[eval]`` section (every_steps, repeats, max_steps, temperature).
        final_step: the run's last optimizer step (learner.steps; 0 = none, no final round).
        id_prefix: prepended to every group id (the learner's id, as the scheduler's), so a restarted learner never
            takes its predecessor's episodes for its own.
        rollout_timeout_s: an episode handed out and not back after this long is handed out again.
        state: the run's state (learner.state.RunState; a new one when None): this counts ``eval_rounds``,
            ``eval_rounds_skipped``, ``eval_rounds_abandoned``, ``eval_rounds_unrecorded`` and ``eval_trajectories``
            in its ``totals``. The learner service takes the same state (it refuses rounds built with another).

    Raises:
        ValueError: no task.
    """

    def __init__(self, tasks: list[Task], config: EvalConfig, *, final_step: int = 0, id_prefix: str = "",
                 rollout_timeout_s: float = 900.0, state: RunState | None = None) -> None:
        if not tasks:
            raise ValueError("an evaluation needs at least one task")
        self.tasks = list(tasks)
        self.config = config
        self.final_step = final_step
        self.id_prefix = id_prefix
        self.rollout_timeout_s = rollout_timeout_s
        self.state = state if state is not None else RunState()
        self.round: EvalRound | None = None
        """The round in progress (None between rounds)."""
        self.results: list[dict[str, Any]] = []
        """Complete rounds not yet taken into a metrics record (:meth:`take_result`), oldest first."""
        self._rounds = 0
        self._last_step = 0
        """The highest optimizer step seen (a round is due when a multiple of every_steps lies past it)."""
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def round_size(self) -> int:
        """Episodes per round: repeats x tasks."""
        return self.config.repeats * len(self.tasks)

    @property
    def assignment_fields(self) -> dict[str, Any]:
        """The Assignment fields of every evaluation episode: ``evaluation`` True, the round's ``max_steps`` (0:
        the actors' own) and ``temperature``."""
        return {"evaluation": True, "max_steps": self.config.max_steps, "temperature": self.config.temperature}

    def begin(self, step: int, version: int) -> bool:
        """Training starts after optimizer step ``step`` at ``version``: a fresh run (step 0) evaluates its initial
        weights now; a resumed one waits for its next due step. Returns whether a round started."""
        self._last_step = step
        return self.start(step, version) if step == 0 else False

    def start(self, step: int, version: int) -> bool:
        """Start a round at ``version`` (the weights after optimizer step ``step``), unless one is running (then
        it is skipped and counted). Returns whether a round started."""
        self._last_step = max(self._last_step, step)
        if self.round is not None:
            self.state.totals["eval_rounds_skipped"] += 1
            log.warning("evaluation due at step %d skipped: the round of step %d is still running (%d of %d "
                        "episodes back)", step, self.round.step, len(self.round.outcomes), len(self.round.slots))
            return False
        number, self._rounds = self._rounds, self._rounds + 1
        slots = {(f"{self.id_prefix}e{number}-{t}-{task.id}", r): task
                 for t, task in enumerate(self.tasks) for r in range(self.config.repeats)}
        self.round = EvalRound(number, step, version, slots, waiting=collections.deque(slots))
        self.state.totals["eval_rounds"] += 1
        self._idle.clear()
        log.info("evaluation round %d: %d episodes (%d tasks x %d) at policy version %d (step %d)", number,
                 len(slots), len(self.tasks), self.config.repeats, version, step)
        return True

    def is_final(self, step: int) -> bool:
        """Whether optimizer step ``step`` ends the run (learner.steps reached)."""
        return self.final_step > 0 and step >= self.final_step

    def due(self, step: int) -> bool:
        """Whether a round is due after optimizer step ``step``: the step count crossed a multiple of
        ``every_steps`` since the last round was due, or the run ends with it (and the final round is on)."""
        if self.is_final(step):
            return self.config.final_timeout_s > 0
        every = self.config.every_steps
        return every > 0 and step // every > self._last_step // every

    def on_step(self, step: int, version: int) -> bool:
        """The learner took optimizer steps up to ``step`` and published ``version``: start a round when one is
        due (the final one abandons an older round still running). Returns whether a round started."""
        if not self.due(step):
            self._last_step = max(self._last_step, step)
            return False
        if self.is_final(step) and self.round is not None and self.round.version != version:
            self._abandon("the final round takes its place")
        return self.start(step, version)

    def on_stop(self, step: int, version: int) -> bool:
        """The run ends before ``learner.steps`` (every task solved) with the weights of optimizer step ``step``,
        published as ``version``: make sure a final round evaluates them, as :meth:`on_step` does at
        ``learner.steps``. A round of ``version`` still running, or complete and not yet taken
        (:meth:`take_result`), is that round; a round of an older version still running is abandoned; otherwise a
        round starts now. Nothing with ``eval.final_timeout_s`` = 0 (no final round). Returns whether a round
        started (the caller hands its episodes out)."""
        self._last_step = max(self._last_step, step)
        if self.config.final_timeout_s <= 0:
            return False
        if self.round is not None and self.round.version == version:
            return False
        if self.round is None and self.results and self.results[-1]["eval_policy_version"] == version:
            return False
        self._abandon("the run stops as solved: the final round takes its place")
        return self.start(step, version)

    def _abandon(self, why: str) -> None:
        current = self.round
        if current is None:
            return
        self.state.totals["eval_rounds_abandoned"] += 1
        log.warning("evaluation round %d (step %d) abandoned with %d of %d episodes back: %s", current.number,
                    current.step, len(current.outcomes), len(current.slots), why)
        self.round = None
        self._idle.set()

    @property
    def has_work(self) -> bool:
        """Whether an episode is waiting to be handed out."""
        return self.round is not None and bool(self.round.waiting)

    def next_rollout(self, now: float | None = None) -> Rollout:
        """The next episode to hand out (its group id, rollout index, task and deadline), now marked running.

        Raises:
            RuntimeError: none is waiting (check :attr:`has_work` first).
        """
        if not self.has_work:
            raise RuntimeError("no evaluation episode to hand out")
        current = self.round
        slot = current.waiting.popleft()
        deadline = (time.monotonic() if now is None else now) + self.rollout_timeout_s
        current.running[slot] = deadline
        return Rollout(slot[0], slot[1], current.slots[slot], deadline)

    def is_running(self, group_id: str, rollout_index: int) -> bool:
        """Whether this slot is an evaluation episode handed out and not back."""
        return self.round is not None and (group_id, rollout_index) in self.round.running

    def running_task(self, group_id: str, rollout_index: int) -> Task:
        """The task of a running evaluation episode. Raises KeyError when it is not one (:meth:`is_running`)."""
        if not self.is_running(group_id, rollout_index):
            raise KeyError(f"no running evaluation episode {(group_id, rollout_index)}")
        return self.round.slots[(group_id, rollout_index)]

    def on_trajectory(self, traj: Trajectory) -> None:
        """A running episode's trajectory came back (the slot-owner interface learner.rollouts.peers uses, as
        GroupScheduler.on_trajectory): :meth:`record` it. No group ever completes (None)."""
        self.record(traj)

    def record(self, traj: Trajectory) -> dict[str, Any] | None:
        """Count the trajectory of a running evaluation episode; returns the round's result (:meth:`result_of`)
        when it completes the round (the result is also kept for :meth:`take_result`).

        Raises:
            KeyError: its slot is not a running evaluation episode.
        """
        slot = (traj.group_id, traj.rollout_index)
        if not self.is_running(*slot):
            raise KeyError(f"no running evaluation episode {slot}")
        current = self.round
        del current.running[slot]
        current.outcomes[slot] = Outcome(traj.outcome)
        current.scores[slot] = 0.0 if current.outcomes[slot] in ERROR_OUTCOMES else float(traj.score)
        current.version_max = max([current.version_max] + [int(s.versions.max()) for s in traj.steps
                                                           if len(s.versions)])
        self.state.totals["eval_trajectories"] += 1
        if not current.complete:
            return None
        result = self.result_of(current)
        self.results.append(result)
        self.round = None
        self._idle.set()
        log.info("evaluation round %d (policy version %d, step %d): mean score %.3f, success %.3f over %d episodes "
                 "(%d errors, scored 0) in %.1f s; per task %s", current.number, current.version, current.step,
                 result["eval_score"], result["eval_success"], result["eval_episodes"], result["eval_errors"],
                 result["eval_s"], result["eval_task_score"])
        return result

    @staticmethod
    def result_of(current: EvalRound) -> dict[str, Any]:
        """A complete round's metrics fields: ``eval_score`` (the mean score over all the round's episodes, errored
        ones 0: OSWorld's number, actors.eval.report), ``eval_task_score`` ({task id: that mean over its episodes}),
        ``eval_score_ran`` (the mean over the episodes that did not error, as OSWorld's show_result.py; None when
        every one errored), ``eval_success`` (SUCCESS episodes / all episodes, errors included),
        ``eval_task_success`` ({task id: that rate over its episodes}), ``eval_policy_version`` (the version the
        round was handed out at), ``eval_step`` (the optimizer step of those weights),
        ``eval_episodes``, ``eval_errors`` (ENV_ERROR, TASK_ERROR, ABORTED), ``eval_version_max`` (the newest
        version among its tokens: later than eval_policy_version when weights were published during the round)
        and ``eval_s`` (the round's wall time, seconds)."""
        per_task: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0, 0.0])
        for slot, outcome in current.outcomes.items():
            counts = per_task[current.slots[slot].id]
            counts[0] += outcome is Outcome.SUCCESS
            counts[1] += 1
            counts[2] += current.scores.get(slot, 0.0)
        successes = sum(outcome is Outcome.SUCCESS for outcome in current.outcomes.values())
        episodes = len(current.outcomes)
        ran = [current.scores.get(slot, 0.0) for slot, o in current.outcomes.items() if o not in ERROR_OUTCOMES]
        return {"eval_score": sum(current.scores.values()) / episodes if episodes else 0.0,
                "eval_task_score": {task_id: total / n for task_id, (_, n, total) in sorted(per_task.items())},
                "eval_score_ran": sum(ran) / len(ran) if ran else None,
                "eval_success": successes / episodes if episodes else 0.0,
                "eval_task_success": {task_id: wins / n for task_id, (wins, n, _) in sorted(per_task.items())},
                "eval_policy_version": current.version, "eval_step": current.step, "eval_episodes": episodes,
                "eval_errors": sum(outcome in ERROR_OUTCOMES for outcome in current.outcomes.values()),
                "eval_version_max": max(current.version_max, current.version),
                "eval_s": round(time.monotonic() - current.started, 3)}

    def take_result(self) -> dict[str, Any]:
        """The fields of the newest complete round not yet in a metrics record ({} if none), for the record about
        to be written. An older one not taken in time (two rounds completed between two records) is left out of
        metrics.jsonl: it was logged when it completed, and is counted in ``eval_rounds_unrecorded``."""
        if not self.results:
            return {}
        newest, older = self.results[-1], self.results[:-1]
        if older:
            self.state.totals["eval_rounds_unrecorded"] += len(older)
            log.warning("%d evaluation round(s) completed before a metrics record could carry them (steps %s); "
                        "their results are in this log only", len(older), [r["eval_step"] for r in older])
        self.results = []
        return newest

    def expire(self, now: float | None = None) -> int:
        """Hand out again every running episode past its deadline; returns how many."""
        now = time.monotonic() if now is None else now
        if self.round is None:
            return 0
        return self.expire_slots([slot for slot, deadline in self.round.running.items() if deadline <= now])

    def expire_slots(self, keys: list[Slot]) -> int:
        """Hand out again these slots where they are running evaluation episodes (e.g. those of an actor that went
        silent); others are skipped. Returns how many."""
        count = 0
        for key in keys:
            if self.round is not None and key in self.round.running:
                del self.round.running[key]
                self.round.waiting.append(key)
                count += 1
        return count

    async def wait(self, timeout_s: float) -> bool:
        """Wait until no round is running, at most ``timeout_s`` seconds; False when one still is."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False

    def status(self) -> dict[str, Any]:
        """For status.json: the round in progress (its step, version, episodes back and in all) and the rounds
        started so far."""
        current = self.round
        return {"rounds": self._rounds, **({"step": current.step, "policy_version": current.version,
                                            "episodes_back": len(current.outcomes),
                                            "episodes": len(current.slots)} if current is not None else {})}
