"""Learner service: the learner's side of the conversation with actors, and the message dispatch.

Role: takes each message from the ROUTER pump's inbox (:meth:`LearnerService.serve`) and routes it; owns the
hand-off of each complete group to its round control (:class:`learner.rollouts.rounds.RoundControl`: the task
pre-pass, lockstep rollout batches, evaluation rounds). Its halves: :class:`learner.rollouts.peers.Peers`
(known actors, waiting requests, running rollouts, de-duplication, the announced policy version),
:class:`learner.rollouts.acks.HeldAcks` (Acks held for a burst), :class:`learner.rollouts.run_stats.RunStats`
(counters, the outcome window, the stall check) and :class:`learner.rollouts.status.StatusReport` (the counters of a
metrics record, the status.json snapshot). Channels (made by the wiring function, learner.main): the pump's
inbox and outbox, and ``groups``, the queue of complete groups the training loop (learner.train.loop) takes; the
loop reports each step back through one call, :meth:`learner.rollouts.rounds.RoundControl.on_trained`. Shares the
run's state (learner.state.RunState: step, policy version, totals) with the loop; never scores a group
(learner.algo does).

- hello / heartbeat -> reply with LearnerStatus (learner id + version), so actors notice a restarted learner; a
  Hello opens the peer's session (learner.rollouts.sessions), which its requests and trajectories must name;
- work_request -> queued; handed an Assignment as soon as the scheduler has a slot and the admission rule
  (StalenessManager for the async schedule, LockstepAdmission for lockstep) admits one more rollout;
- trajectory -> acknowledged (the learner now holds it) at the end of the burst of messages it arrived in, plus
  learner.rollouts.acks.ACK_DELAY_S for trajectories arriving one at a time, one Ack per peer for all of them
  (:meth:`LearnerService.handle`), validated, de-duplicated by trajectory id, and
  taken for its rollout slot only under the session the slot was handed out under, with the slot's task (else a counted
  Reject: ``owner``, ``task``, ``duplicate`` for an id reused with other content; nothing it sends can erase a
  running slot's owner); taken ones are recorded in the scheduler; a complete group goes on ``groups`` as it
  completes (lockstep: once all of a rollout batch opened by
  :meth:`learner.rollouts.rounds.RoundControl.open_round` has come back, :data:`learner.rollouts.rounds.ROUND_END`
  follows its groups);
- an evaluation episode's trajectory (learner.rollouts.evaluation_rounds) is acked, validated and de-duplicated the same
  way, then goes to the evaluation rounds only: never to the scheduler, ``groups``, the task selector,
  task pre-pass, outcome window or trajectory sample; a round comes due in
  :meth:`learner.rollouts.rounds.RoundControl.on_trained`, and the final one of a run that stops as solved in
  :meth:`learner.rollouts.rounds.RoundControl.start_final_evaluation`;
- a message that failed to decode, or whose handling raised, is counted in ``rejections`` and answered with a
  Reject; the service goes on.

Invariant: a request waits (backpressure) rather than being refused; a trajectory is acked exactly when
it is held by the learner, so an actor never forgets one the learner has not got. A trajectory for a slot
this learner did not hand out (its predecessor's, before a restart, or one re-issued after a timeout) is
acked and counted as "late", never trained on.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Callable

from arpo_async.messages import Heartbeat, Hello, Outcome, Reject, Trajectory, WorkRequest
from arpo_async.process import WarningBudget
from arpo_async.transport import Envelope, Outbox, Undecodable, peer_name
from arpo_async.validation import InvalidMessage, WireLimits, check_hello, check_trajectory, check_work_request
from learner.algo.task_selection import NoTaskLeft, TaskSelector
from learner.rollouts.acks import ACK_DELAY_S, HeldAcks
from learner.rollouts.evaluation_rounds import EvaluationRounds
from learner.rollouts.peers import Admission, Peers
from learner.rollouts.rounds import GroupQueue, RoundControl
from learner.rollouts.run_stats import RunStats
from learner.rollouts.scheduler import GroupScheduler
from learner.rollouts.status import StatusReport
from learner.rollouts.trajectory_sample import TrajectorySampler
from learner.state import RunState

log = logging.getLogger(__name__)

class LearnerService:
    """Dispatches actor messages; see the module docstring.

    Args:
        outbox: the ROUTER pump's outbox (replies, assignments, announcements).
        scheduler: hands out rollout slots and assembles groups.
        admission: the admission rule (StalenessManager or LockstepAdmission).
        groups: where complete training groups go (a new unbounded queue when None).
        state: the run's state, shared with the training loop: its ``totals`` are the counters everything here
            counts into (when None: the state ``evaluation`` counts into, else a new one).
        rounds: lockstep: :data:`learner.rollouts.rounds.ROUND_END` follows each rollout batch's groups on
            ``groups`` (:meth:`learner.rollouts.rounds.RoundControl.open_round`).
        learner_id: this learner's id, announced in LearnerStatus; a new random one when None.
        selector: the online task selector fed with every complete training group (None: none).
        vocab_size: token ids of trajectories must lie in [0, vocab_size) (None: not checked).
        peer_timeout_s: see :class:`learner.rollouts.peers.Peers`.
        sampler: keeps a sample of received trajectories with their screenshots (learner.rollouts.trajectory_sample).
        run_id: this run's id: actors of another run are refused (:meth:`learner.rollouts.peers.Peers.check_run`).
        max_slots_per_peer: see :class:`learner.rollouts.peers.Peers`.
        message_counts: the ROUTER pump's messages by type (arpo_async.transport.SocketPump.message_counts),
            reported in metrics and status.json as ``messages`` (None: left out).
        evaluation: the held-out evaluation rounds (None: the run does not evaluate); they must count into
            ``state`` (built with it).
        ack_delay_s: how long the Acks held at a burst's end wait for more (learner.rollouts.acks.HeldAcks).
        ready_groups: how many complete groups wait to be trained on (queue depths ``ready_groups``; the
            groups on ``groups`` when None).

    Raises:
        ValueError: ``evaluation`` counts into another RunState than ``state``.
    """

    def __init__(self, outbox: Outbox, scheduler: GroupScheduler, admission: Admission,
                 groups: GroupQueue | None = None, *, state: RunState | None = None, rounds: bool = False,
                 learner_id: str | None = None, selector: TaskSelector | None = None,
                 vocab_size: int | None = None, limits: WireLimits = WireLimits(), peer_timeout_s: float = 30.0,
                 sampler: TrajectorySampler | None = None, run_id: str = "",
                 max_slots_per_peer: int = 1024,
                 message_counts: Callable[[], dict[str, dict[str, int]]] | None = None,
                 ack_delay_s: float = ACK_DELAY_S, evaluation: EvaluationRounds | None = None,
                 ready_groups: Callable[[], int] | None = None) -> None:
        self.outbox = outbox
        self.scheduler = scheduler
        self.admission = admission
        self.groups: GroupQueue = groups if groups is not None else GroupQueue()
        """Complete training groups for the training loop (and :data:`learner.rollouts.rounds.ROUND_END` markers in
        lockstep)."""
        if state is None:
            state = evaluation.state if evaluation is not None else RunState()
        if evaluation is not None and evaluation.state is not state:
            raise ValueError("the evaluation rounds count into another RunState than the service's: build them with "
                             "the run's state")
        self.state = state
        """The run's state (step, published version, counters), shared by argument; never replaced."""
        self.vocab_size = vocab_size
        self.limits = limits
        self.sampler = sampler
        """Keeps a sample of the trajectories with their screenshots for `arpo view` (None: none kept)."""
        self.learner_id = learner_id or uuid.uuid4().hex[:12]
        self.stats = RunStats(self.state)
        self.evaluation = evaluation
        self.peers = Peers(outbox, scheduler, admission, self.state, learner_id=self.learner_id,
                           peer_timeout_s=peer_timeout_s, run_id=run_id,
                           max_slots_per_peer=max_slots_per_peer, evaluation=evaluation)
        self.control = RoundControl(scheduler, admission, self.peers, self.stats, self.state, self.groups,
                                    lockstep=rounds, selector=selector, evaluation=evaluation)
        """Opens and closes the run's rounds (task pre-pass, lockstep batches, evaluation) and takes each complete
        training group (learner.rollouts.rounds.RoundControl)."""
        self.acks = HeldAcks(outbox, self.state, ack_delay_s)
        """The Acks of the current burst of messages (:meth:`handle`)."""
        self.report = StatusReport(self.learner_id, self.state, self.stats, self.peers, admission, self.control,
                                   outbox, ready_groups or (lambda: len(self.groups.pending())), message_counts)
        """The counters for metrics records and the status.json snapshot (learner.rollouts.status.StatusReport)."""
        self._warnings = WarningBudget(log)
        """Rejections are logged within a budget (a flood of bad frames writes a few lines; every one is counted)."""

    @property
    def announced_version(self) -> int:
        """The policy version last announced to actors (:attr:`learner.rollouts.peers.Peers.announced_version`);
        the published one is ``state.published_version``."""
        return self.peers.announced_version

    async def serve(self, inbox: asyncio.Queue[Envelope]) -> None:
        """Handle every message of the ROUTER pump's ``inbox``, in arrival order, until cancelled. A message
        whose handling raises is logged with its peer, counted as ``handler`` and answered with a Reject.

        Raises:
            learner.algo.task_selection.NoTaskLeft: every task has been set aside after TASK_ERRORs (the run stops).
        """
        self.report.inbox = inbox
        try:
            await self._serve(inbox)
        finally:
            self.acks.cancel()

    async def _serve(self, inbox: asyncio.Queue[Envelope]) -> None:
        while True:
            envelope = await inbox.get()
            try:
                await self.handle(envelope, more=not inbox.empty())
            except NoTaskLeft:
                raise  # every task set aside: nothing left to train on, the learner stops
            except Exception as error:  # noqa: BLE001 - one message's handler never stops the service
                log.error("handling %s from %s failed: %s: %s", type(envelope.message).__name__, envelope.peer,
                          type(error).__name__, error, exc_info=log.isEnabledFor(logging.DEBUG))
                await self._refuse(envelope.peer, "handler", f"internal error while handling "
                                   f"{getattr(envelope.message, 'TYPE', '?')!r}: {type(error).__name__}: {error}")

    async def handle(self, envelope: Envelope, *, more: bool = False) -> None:
        """Dispatch one message from actor ``envelope.peer`` (an Undecodable one is counted and refused).

        Args:
            more: further messages are waiting in the inbox: the Acks of the trajectories handled so far wait for
                the end of the burst. At its end (``more`` False) they wait ``ack_delay_s`` more for trajectories
                that arrive one at a time, then go out as one Ack per peer; with `ACK_BATCH` ids held back, or
                ``ack_delay_s`` 0 at the burst's end, they go out now.
        """
        try:
            await self._dispatch(envelope)
        finally:
            await self.acks.settle(more)

    async def _dispatch(self, envelope: Envelope) -> None:
        peer, message, key = envelope.peer, envelope.message, envelope.key
        if isinstance(message, Undecodable):
            await self._refuse(peer, "wire", message.reason)
            return
        self.peers.heard(peer)
        try:
            if isinstance(message, Hello):
                check_hello(message, self.limits)
                await self.peers.on_hello(peer, message, key)
            elif isinstance(message, Heartbeat):
                await self.peers.on_hello(peer, message)
            elif isinstance(message, WorkRequest):
                check_work_request(message, self.limits)
                await self.peers.request(peer, message, key)
            elif isinstance(message, Trajectory):
                await self._on_trajectory(peer, message, key)
            else:
                await self.outbox.send(Reject(f"the learner does not accept {type(message).TYPE!r}"), peer)
        except InvalidMessage as invalid:
            await self._reject(peer, invalid)

    async def _reject(self, peer: str, invalid: InvalidMessage) -> None:
        """Count an invalid message by reason, log it with its peer, and tell the peer why (after the Acks held
        back, so a peer sees a trajectory's Ack before its Reject)."""
        await self.acks.send()
        self.state.totals["bad_messages"] += 1
        self.stats.rejections[invalid.reason] += 1
        self._warn_rejected(peer, invalid)
        await self.outbox.send(Reject(str(invalid)[:500]), peer)

    async def _refuse(self, peer: str | None, kind: str, reason: str) -> None:
        """A message from ``peer`` failed to decode (``kind`` "wire"), or its handler raised ("handler"): count
        it, tell the peer (waiting for room in the outbox), keep going."""
        await self.acks.send()
        self.state.totals["bad_messages"] += 1
        self.stats.rejections[kind] += 1
        self._warn_rejected(peer, reason)
        if peer is not None:
            await self.outbox.send(Reject(reason[:500]), peer)

    def _warn_rejected(self, peer: str | None, why: object) -> None:
        """Log one rejection within the warning budget; one left out is counted in ``warnings_suppressed``."""
        if not self._warnings.warning("rejected a message from %s: %s", peer_name(peer or ""), why):
            self.state.totals["warnings_suppressed"] += 1

    async def _on_trajectory(self, peer: str, traj: Trajectory, key: str = "") -> None:
        """One trajectory, through the rollouts room in one pass (each module once): validated
        (arpo_async.validation), acked with its burst and fingerprinted (learner.rollouts.acks), taken for its
        slot or not (:meth:`learner.rollouts.peers.Peers.receive`, which hands a taken one to the scheduler or the
        evaluation rounds); a Reject when it says so. A training rollout taken is then counted (the statistics
        window, learner.rollouts.run_stats), offered to the sample kept for `arpo view`, reported to the admission
        rule and the task selector; the group it completes goes to the task pre-pass while that runs, else on
        ``groups`` (learner.rollouts.rounds.RoundControl.take_group)."""
        try:
            check_trajectory(traj, vocab_size=self.vocab_size, version=self.announced_version, limits=self.limits)
            problem = None
        except InvalidMessage as invalid:
            problem = invalid
        digest = self.acks.receive(peer, traj, valid=problem is None)  # sent at the end of the burst (`handle`)
        receipt = self.peers.receive(peer, traj, digest, problem, key)
        if receipt.problem is not None:
            await self._reject(peer, receipt.problem)
        taken, task, group = receipt.taken, receipt.task, receipt.group
        if taken is None or receipt.evaluation:  # an evaluation episode's goes to its round only
            if taken is not None:
                await self.peers.dispatch()
            return
        totals = self.state.totals
        totals["from_desktop"] += bool(taken.desktop)
        totals["desktop_busy_s"] += taken.timings.get("episode_s", 0.0)  # for desktop utilisation
        totals[taken.outcome] += 1
        totals["trajectories"] += 1
        self.stats.window.record(task, taken.outcome)
        self.stats.window.stages.add(taken)
        if self.sampler is not None:
            await self.sampler.offer(taken, task, step=self.state.step, version=self.announced_version)
        self.admission.on_finish(accepted=Outcome(taken.outcome).trainable)
        selector = self.control.selector
        if selector is not None and selector.record_rollout(task.id, taken.outcome == Outcome.TASK_ERROR):
            log.error("task %s set aside: its last %d rollouts ended in TASK_ERROR (the last: %s); it is not handed "
                      "out again in this run", task.id, selector.task_error_limit, taken.error[:300])
        if group is not None:
            self.control.take_group(group)
        await self.peers.dispatch()

    def state_dict(self, waiting: int = 0) -> dict[str, Any]:
        """The service's resumable state (the run's own, step, version and counters, is ``state``'s:
        learner.state.RunState.state_dict): the scheduler's state, and the admission's accepted count less what a
        restart loses (groups still open, and ``waiting``: trajectories of complete groups the training loop
        holds, scored or not, but has not trained)."""
        queued = sum(len(g.trajectories()) for g in self.groups.pending())
        lost = self.scheduler.pending_trainable() + queued + waiting
        return {"schema": 1, "accepted": max(0, self.admission.accepted - lost),
                "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (before any actor is served), after the run's state was restored
        (learner.train.checkpoint.restore): the announced version starts at the restored published one.

        Raises:
            ValueError: unknown schema or malformed state.
        """
        if state.get("schema") != 1:
            raise ValueError(f"unsupported learner service state schema {state.get('schema')!r}")
        try:
            accepted = int(state["accepted"])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"malformed learner service state: {type(error).__name__}: {error}") from error
        self.scheduler.load_state_dict(state["scheduler"])
        self.peers.restore(self.state.published_version)
        self.admission.accepted = accepted
        self.stats.zero_variance_at_step = self.state.drops.get("zero_variance", 0)  # counted from the resumed step

    async def shutdown_actors(self, reason: str) -> None:
        """Tell every known actor the run is over, after the Acks held back (:meth:`handle`): an actor learns that
        its last trajectories were taken before it stops waiting for them."""
        await self.acks.send()
        await self.peers.shutdown(reason)
