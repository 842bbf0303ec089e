"""Round control: which rollouts the learner hands out, and where a complete group goes.

Role: opens and closes the run's rounds of rollouts on the learner service's behalf
(learner.rollouts.service.LearnerService builds one as ``service.control``; the run, learner.run, and the training
loop, learner.train.loop, drive it): ARPO's task pre-pass (:meth:`RoundControl.run_prepass`), the switch to
training tasks (:meth:`RoundControl.start_training`), the lockstep rollout batches (:meth:`RoundControl.open_round`)
and the held-out evaluation rounds (:meth:`RoundControl.begin_evaluation`, :meth:`RoundControl.on_trained`,
:meth:`RoundControl.start_final_evaluation`, :meth:`RoundControl.finish_evaluation`). Holds the hooks a round works
through: the scheduler's group budget and task source, the task selector, the task pre-pass while it runs and the
evaluation rounds; hands out work through the service's peers (learner.rollouts.peers.Peers.dispatch). The
service's intake gives it each complete training group (:meth:`RoundControl.take_group`).
"""

from __future__ import annotations

import asyncio
import logging

from arpo_async.messages import Outcome
from learner.algo.prepass import TaskPrepass
from learner.algo.task_selection import TaskSelector, trainable_scores
from learner.rollouts.evaluation_rounds import EvaluationRounds
from learner.rollouts.peers import Admission, Peers
from learner.rollouts.run_stats import RunStats
from learner.rollouts.scheduler import Group, GroupScheduler
from learner.state import RunState

log = logging.getLogger(__name__)

ROUND_END = None
"""Lockstep: put on ``groups`` after the last group of a rollout batch (the loop trains on what came before it)."""


class GroupQueue(asyncio.Queue):
    """The unbounded queue of complete groups from the service to the training loop (each a
    :class:`learner.rollouts.scheduler.Group`, or :data:`ROUND_END` in lockstep); :meth:`pending` shows what waits."""

    def pending(self) -> list[Group]:
        """The groups waiting, oldest first (a copy; :data:`ROUND_END` markers left out)."""
        return [group for group in self._queue if group is not ROUND_END]


class RoundControl:
    """Opens and closes the run's rounds of rollouts; see the module docstring.

    Args:
        scheduler: hands out rollout slots and assembles groups (its group budget and task source are set here).
        admission: the admission rule (told of the pre-pass's groups, never trained on).
        peers: the service's actors: work goes out through ``peers.dispatch``, versions through ``peers.announce``.
        stats: the service's statistics (the stall clock, the outcome window).
        state: the run's state (step, published version, counters).
        groups: where complete training groups go.
        lockstep: :data:`ROUND_END` follows each rollout batch's groups on ``groups`` (:meth:`open_round`).
        selector: the online task selector fed with every complete training group (None: none).
        evaluation: the held-out evaluation rounds (None: the run does not evaluate).
    """

    def __init__(self, scheduler: GroupScheduler, admission: Admission, peers: Peers, stats: RunStats,
                 state: RunState, groups: GroupQueue, *, lockstep: bool = False, selector: TaskSelector | None = None,
                 evaluation: EvaluationRounds | None = None) -> None:
        self.scheduler = scheduler
        self.admission = admission
        self.peers = peers
        self.stats = stats
        self.state = state
        self.groups = groups
        self.lockstep = lockstep
        self.selector = selector
        """The online task selector fed with every complete training group (None: none)."""
        self.evaluation = evaluation
        self.prepass: TaskPrepass | None = None
        """The task pre-pass while it runs (its groups go to it, not to training)."""
        self._prepass_done = asyncio.Event()
        self._round_open = False

    def take_group(self, group: Group) -> None:
        """A complete training group from the service's intake: recorded in the task pre-pass while that runs
        (never trained on), else reported to the task selector and put on ``groups`` (lockstep: :data:`ROUND_END`
        after a rollout batch's last group)."""
        if self.prepass is not None:
            self.prepass.record_group(group.task.id, trainable_scores(group))
            self.admission.on_discard(sum(Outcome(t.outcome).trainable for t in group.trajectories()))  # never trained
            if self.prepass.done:
                self._prepass_done.set()
            return
        if self.selector is not None:
            self.selector.record_group(group.task.id, trainable_scores(group))
        self.groups.put_nowait(group)
        if self.lockstep and self._round_open and self.scheduler.idle:
            self._round_open = False
            self.groups.put_nowait(ROUND_END)

    async def run_prepass(self, prepass: TaskPrepass) -> None:
        """ARPO's task pre-pass (learner.algo.prepass): hand out ``prepass``'s groups (k rollouts of every task with
        the current policy) and wait until every one has come back. The groups are recorded in ``prepass`` and
        never trained on; the outcome window is reset afterwards, so the first training step's success rate is
        training's own. The scores are in ``prepass.results`` when this returns.

        The scheduler must have been built (or switched with ``set_task_source``) with ``prepass.pick_task``
        and a group budget of 0; this adds the pass's groups to the budget.
        """
        self.prepass, self.stats.prepass_running = prepass, True
        self._prepass_done.clear()
        self.scheduler.add_group_budget(prepass.planned_groups)
        await self.peers.dispatch()
        try:
            await self._prepass_done.wait()
        finally:
            self.prepass, self.stats.prepass_running = None, False
        self.stats.window.take()

    async def open_round(self, groups: int) -> None:
        """Lockstep: hand out one rollout batch of ``groups`` groups; once all of it came back, :data:`ROUND_END`
        follows its complete groups on ``groups``.

        Raises:
            RuntimeError: the previous round has not come back yet, or the schedule is not lockstep.
            ValueError: the scheduler opens groups without a budget (the async schedule).
        """
        if not self.lockstep or self._round_open or not self.scheduler.idle:
            raise RuntimeError("open_round while the previous rollout batch is still out (or not lockstep)")
        self._round_open = True
        self.scheduler.add_group_budget(groups)
        await self.peers.dispatch()

    async def start_training(self, selector: TaskSelector, group_budget: int | None) -> None:
        """After the task pre-pass: pick training tasks with ``selector`` (None budget: open groups without
        limit; 0: only what :meth:`open_round` adds), restart the stall clock and hand out work."""
        self.selector = selector
        self.scheduler.set_task_source(selector.pick_task, group_budget)
        self.stats.training_starts()
        await self.peers.dispatch()

    async def on_trained(self) -> None:
        """The training loop advanced ``state`` (its step and published version): start an evaluation round if one
        is due (at that version), announce the version to every known actor, admit more work."""
        self.stats.on_step()
        if self.evaluation is not None:
            self.evaluation.on_step(self.state.step, self.state.published_version)
        await self.peers.announce(self.state.published_version)

    async def begin_evaluation(self) -> None:
        """Training starts (or resumes): a fresh run hands out its evaluation round of the initial weights now
        (learner.rollouts.evaluation_rounds.EvaluationRounds.begin); nothing without ``evaluation``."""
        if self.evaluation is not None and self.evaluation.begin(self.state.step, self.state.published_version):
            await self.peers.dispatch()

    async def start_final_evaluation(self) -> bool:
        """The run stops before ``learner.steps`` (every task solved, learner.train.loop.TrainingLoop.stop_solved):
        make the evaluation round of the current weights (``state.step``, ``state.published_version``) the final one
        and hand its episodes out to the requests waiting (learner.rollouts.evaluation_rounds.EvaluationRounds.on_stop);
        the service keeps serving actors until they are told to shut down, so the round runs as any other. Returns
        whether a round started (False without ``evaluation``, with ``eval.final_timeout_s`` = 0, or when a round of
        these weights is already running or complete)."""
        if self.evaluation is None or not self.evaluation.on_stop(self.state.step, self.state.published_version):
            return False
        await self.peers.dispatch()
        return True

    async def finish_evaluation(self, timeout_s: float) -> bool:
        """Wait for the evaluation round running (the final one, at the end of a run), at most ``timeout_s``
        seconds; the wait and its outcome are logged. True when none runs any more (or the run does not
        evaluate)."""
        if self.evaluation is None or self.evaluation.round is None:
            return True
        current = self.evaluation.round
        log.info("waiting up to %.0f s for the evaluation round of step %d (%d of %d episodes back)", timeout_s,
                 current.step, len(current.outcomes), len(current.slots))
        done = await self.evaluation.wait(timeout_s)
        if not done:
            log.warning("the evaluation round of step %d is not complete after %.0f s (%d of %d episodes back); "
                        "the run ends without its result", current.step, timeout_s, len(current.outcomes),
                        len(current.slots))
        return done

    def on_unusable_batch(self) -> None:
        """The training loop got a batch with no usable sample (no optimizer step): count it."""
        self.state.totals["unusable_batches"] += 1
