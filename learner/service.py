"""Learner service: the learner's side of the conversation with actors.

Owns: the known actors, the queue of waiting work requests, trajectory de-duplication, and the current
policy version as announced to actors. Channels (made by the wiring function, learner.main): it consumes the
ROUTER pump's inbox (:meth:`LearnerService.serve`), replies through the pump's outbox, and puts training batches
on ``batches``, the bounded queue the training loop awaits; the loop reports each step back through
:meth:`LearnerService.on_trained`. It reacts to each message from the inbox:

- hello / heartbeat -> reply with LearnerStatus (learner id + version), so actors notice a restarted learner;
- work_request -> queued; handed an Assignment as soon as the scheduler has a slot and the admission rule
  (StalenessManager for the async schedule, LockstepAdmission for lockstep) admits one more rollout;
- trajectory -> acknowledged at once (the learner now holds it), de-duplicated by trajectory id, recorded in
  the scheduler; complete groups go to the batcher. Async schedule: a batch goes on ``batches`` as soon as the
  batcher has one and ``batches`` is empty (at most one batch is formed ahead of the training loop); lockstep: a
  rollout batch opened by :meth:`open_round` goes on ``batches`` (every scored group of it, perhaps none) once
  all of it has come back;
- a message that failed to decode, or whose handling raised, is counted in ``rejections`` and answered with a
  Reject; the service goes on.

Invariant: a request waits (backpressure) rather than being refused; a trajectory is acked exactly when
it is held by the learner, so an actor never forgets one the learner has not got. A trajectory for a slot
this learner did not hand out (its predecessor's, before a restart, or one re-issued after a timeout) is
acked and counted as "late", never trained on.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from arpo_async.messages import (Ack, Assignment, Heartbeat, Hello, LearnerStatus, Outcome, Reject, Shutdown,
                                 Trajectory, WorkRequest)
from arpo_async.stage_timings import StageTimings
from arpo_async.tasks import Task
from arpo_async.transport import Envelope, Outbox, Undecodable
from arpo_async.validation import (InvalidMessage, WireLimits, check_hello, check_trajectory,
                                   check_work_request)
from learner.batcher import Batcher, BatchQueue
from learner.scheduler import GroupScheduler
from learner.baseline import BaselinePass
from learner.task_selection import TaskSelector, trainable_scores
from learner.trajectory_sample import TrajectorySampler

log = logging.getLogger(__name__)

UNANNOUNCED_SLOTS = 64
"""Requests a peer may have waiting or running before its Hello arrived (an actor's first requests can overtake
its Hello; a peer that never says hello gets no more than this)."""

SEEN_IDS = 200_000
"""Trajectory ids remembered for de-duplication (oldest forgotten first)."""


def _number(value: Any) -> int | float:
    """A counter value from a checkpoint (counts are ints, summed seconds floats). Raises TypeError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected a number, got {type(value).__name__}")
    return value


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


class Admission(Protocol):
    """What the service needs from an admission rule (learner.staleness.StalenessManager,
    learner.scheduler.LockstepAdmission)."""

    accepted: int
    running: int

    def can_admit(self, version: int) -> bool: ...
    def on_start(self) -> None: ...
    def on_finish(self, accepted: bool) -> None: ...
    def on_discard(self, count: int) -> None: ...


class StalledRun(RuntimeError):
    """No optimizer step for ``learner.stall_timeout_s`` while every group came back without a reward difference."""


class LearnerService:
    """Handles actor messages; see the module docstring.

    Args:
        outbox: the ROUTER pump's outbox (replies, assignments, announcements).
        scheduler: hands out rollout slots and assembles groups.
        admission: the admission rule (StalenessManager or LockstepAdmission).
        batcher: scores complete groups.
        batches: where training batches go (a new one of capacity 1 when None).
        rounds: lockstep: ``batches`` gets whole rollout batches (:meth:`open_round`), not the batcher's batches.
        version: the current policy version (a resumed learner passes the checkpoint's).
        learner_id: this learner's id, announced in LearnerStatus; a new random one when None.
        sampler: keeps a sample of received trajectories with their screenshots (learner.trajectory_sample).
    """

    def __init__(self, outbox: Outbox, scheduler: GroupScheduler, admission: Admission,
                 batcher: Batcher, *, batches: BatchQueue | None = None, rounds: bool = False, version: int = 0,
                 learner_id: str | None = None, selector: TaskSelector | None = None,
                 vocab_size: int | None = None, limits: WireLimits = WireLimits(), peer_timeout_s: float = 30.0,
                 sampler: TrajectorySampler | None = None) -> None:
        self.outbox = outbox
        self.batches = batches if batches is not None else BatchQueue(1)
        """Training batches for the training loop (lists of ScoredGroup)."""
        self.rounds = rounds
        self._round_open = False
        self.sampler = sampler
        """Keeps a sample of the trajectories with their screenshots for `arpo view` (None: none kept)."""
        self.peer_timeout_s = peer_timeout_s
        """A peer not heard from for this long (heartbeats come every transport.heartbeat_s) is forgotten: its
        waiting requests are dropped and its running rollouts handed out again at once."""
        self.peer_slots: dict[str, int] = {}
        """Rollout slots each peer announced in its Hello: the most requests it may have waiting or running."""
        self.assigned: dict[tuple[str, int], str] = {}
        """Running rollout (group id, rollout index) -> the peer it was handed to."""
        self.actor_queues: dict[str, tuple[int, int, int]] = {}
        """Peer -> (running, waiting, unacked) from its last Heartbeat (see :meth:`queue_depths`)."""
        self.vocab_size = vocab_size
        """The policy's vocabulary: token ids of trajectories must lie in [0, vocab_size) (None: not checked)."""
        self.limits = limits
        self.rejections: collections.Counter[str] = collections.Counter()
        """Messages rejected, by reason (``wire`` for ones the codec refused, ``handler`` for internal errors,
        else arpo_async.validation.InvalidMessage.reason)."""
        self.selector = selector
        self.scheduler = scheduler
        self.admission = admission
        self.batcher = batcher
        self.version = version
        self.learner_id = learner_id or uuid.uuid4().hex[:12]
        self.step = 0
        """Optimizer steps taken in this run, across restarts (kept up to date by the training loop)."""
        self.actors: dict[str, float] = {}
        self.waiting: collections.deque[tuple[str, WorkRequest]] = collections.deque()
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._requests_seen: collections.OrderedDict[str, Assignment | None] = collections.OrderedDict()
        """Request ids seen (None while waiting), with the assignment each got, so a re-sent request whose answer
        was lost (a full ROUTER queue drops silently) gets the same assignment again."""
        self.started = time.monotonic()
        self.last_step_at = self.started
        """When the last optimizer step finished (the training loop sets it), for the stall check."""
        self.zero_variance_at_step = 0
        """The batcher's zero-variance drop count at the last optimizer step."""
        self.stall: str | None = None
        """Why no optimizer step is happening, while that lasts (shown in status.json and the progress line)."""
        self.window = WindowStats()
        self.totals: collections.Counter[str] = collections.Counter()
        self.baseline: BaselinePass | None = None
        """The baseline pass while it runs (its groups go to it, not to training)."""
        self._baseline_done = asyncio.Event()

    async def serve(self, inbox: asyncio.Queue[Envelope]) -> None:
        """Handle every message of the ROUTER pump's ``inbox``, in arrival order, until cancelled. A message
        whose handling raises is logged with its peer, counted as ``handler`` and answered with a Reject."""
        while True:
            envelope = await inbox.get()
            try:
                await self.handle(envelope)
            except Exception as error:  # noqa: BLE001 - one message's handler never stops the service
                log.error("handling %s from %s failed: %s: %s", type(envelope.message).__name__, envelope.peer,
                          type(error).__name__, error, exc_info=log.isEnabledFor(logging.DEBUG))
                await self._refuse(envelope.peer, "handler", f"internal error while handling "
                                   f"{getattr(envelope.message, 'TYPE', '?')!r}: {type(error).__name__}: {error}")

    async def handle(self, envelope: Envelope) -> None:
        """Dispatch one message from actor ``envelope.peer`` (an Undecodable one is counted and refused)."""
        peer, message = envelope.peer, envelope.message
        if isinstance(message, Undecodable):
            await self._refuse(peer, "wire", message.reason)
            return
        self.actors[peer] = time.monotonic()
        try:
            if isinstance(message, Hello):
                check_hello(message, self.limits)
            elif isinstance(message, WorkRequest):
                check_work_request(message, self.limits)
        except InvalidMessage as invalid:
            await self._reject(peer, invalid)
            return
        if isinstance(message, Hello):
            self.peer_slots[peer] = message.slots
        if isinstance(message, Heartbeat):
            self.actor_queues[peer] = (message.running, message.waiting, message.unacked)
        if isinstance(message, (Hello, Heartbeat)):
            await self.outbox.send(LearnerStatus(self.learner_id, self.version), peer)
        elif isinstance(message, WorkRequest):
            if message.request_id in self._requests_seen:
                await self._answer_again(peer, message.request_id)
                return
            allowed = self.peer_slots.get(peer, UNANNOUNCED_SLOTS)
            if self._outstanding(peer) >= allowed:
                await self._reject(peer, InvalidMessage(
                    "slots", f"{peer} already has {self._outstanding(peer)} requests waiting or running, the "
                             f"{allowed} slots its Hello announced"))
                return
            self._remember(self._requests_seen, message.request_id)
            self.waiting.append((peer, message))
            await self.dispatch()
        elif isinstance(message, Trajectory):
            await self._on_trajectory(peer, message)
        else:
            await self.outbox.send(Reject(f"the learner does not accept {type(message).TYPE!r}"), peer)

    async def _reject(self, peer: str, invalid: InvalidMessage) -> None:
        """Count an invalid message by reason, log it with its peer, and tell the peer why."""
        self.totals["bad_messages"] += 1
        self.rejections[invalid.reason] += 1
        log.warning("rejected a message from %s: %s", peer, invalid)
        await self.outbox.send(Reject(str(invalid)[:500]), peer)

    async def _refuse(self, peer: str | None, kind: str, reason: str) -> None:
        """A message from ``peer`` failed to decode (``kind`` "wire"), or its handler raised ("handler"): count
        it, tell the peer (waiting for room in the outbox), keep going."""
        self.totals["bad_messages"] += 1
        self.rejections[kind] += 1
        log.warning("rejected a message from %s: %s", peer, reason)
        if peer is not None:
            await self.outbox.send(Reject(reason[:500]), peer)

    def _outstanding(self, peer: str) -> int:
        """Requests of ``peer`` waiting, plus rollouts handed to it that have not come back."""
        return (sum(1 for p, _ in self.waiting if p == peer)
                + sum(1 for p in self.assigned.values() if p == peer))

    async def forget_silent_peers(self, now: float | None = None) -> int:
        """Drop the waiting requests of every peer silent for ``peer_timeout_s`` and re-issue its running
        rollouts at once (its trajectories, if it comes back, are then acked as late). Returns the peers dropped."""
        now = time.monotonic() if now is None else now
        silent = {peer for peer, seen in self.actors.items() if now - seen > self.peer_timeout_s}
        if not silent:
            return 0
        before = len(self.waiting)
        self.waiting = collections.deque((p, r) for p, r in self.waiting if p not in silent)
        slots = [key for key, p in self.assigned.items() if p in silent]
        for key in slots:
            del self.assigned[key]
        reissued = self.scheduler.expire_slots(slots)
        for _ in range(reissued):
            self.admission.on_finish(accepted=False)
        for peer in silent:
            self.actors.pop(peer, None)
            self.peer_slots.pop(peer, None)
        self.totals["silent_peers"] += len(silent)
        log.warning("%d peer(s) silent for %.0f s (%s): dropped %d waiting requests, re-issued %d rollouts",
                    len(silent), self.peer_timeout_s, ", ".join(sorted(silent))[:200], before - len(self.waiting),
                    reissued)
        await self.dispatch()
        return len(silent)

    @staticmethod
    def _remember(seen: collections.OrderedDict, key: str) -> None:
        seen[key] = None
        if len(seen) > SEEN_IDS:
            seen.popitem(last=False)

    async def dispatch(self) -> None:
        """Hand out rollouts to waiting requests while the scheduler has slots and the admission rule admits them."""
        while self.waiting and self.scheduler.has_work and self.admission.can_admit(self.version):
            peer, request = self.waiting.popleft()
            rollout = self.scheduler.next_rollout()
            self.admission.on_start()
            assignment = Assignment(request.request_id, rollout.task.to_dict(), rollout.group_id,
                                    rollout.rollout_index, self.version)
            self.assigned[(rollout.group_id, rollout.rollout_index)] = peer
            if request.request_id in self._requests_seen:
                self._requests_seen[request.request_id] = assignment
            await self.outbox.send(assignment, peer)

    async def _answer_again(self, peer: str, request_id: str) -> None:
        """A request arrived again: re-send its assignment if it had one and the slot still runs; if it is still
        waiting, do nothing (it is answered when admitted)."""
        assignment = self._requests_seen[request_id]
        if assignment is not None and self.scheduler.is_running(assignment.group_id, assignment.rollout_index):
            self.totals["assignments_resent"] += 1
            await self.outbox.send(assignment, peer)

    async def _on_trajectory(self, peer: str, traj: Trajectory) -> None:
        await self.outbox.send(Ack([traj.trajectory_id]), peer)
        self.assigned.pop((traj.group_id, traj.rollout_index), None)
        if traj.trajectory_id in self._seen:
            self.totals["duplicates"] += 1
            return
        self._remember(self._seen, traj.trajectory_id)
        try:
            check_trajectory(traj, vocab_size=self.vocab_size, version=self.version, limits=self.limits)
        except InvalidMessage as invalid:
            await self._reject(peer, invalid)
            if not self.scheduler.is_running(traj.group_id, traj.rollout_index):
                return
            # never trained on: its slot ends as ABORTED, so the rollout is handed out again (rollout_retries)
            traj = Trajectory(traj.trajectory_id, traj.actor_id, traj.task_id, traj.group_id, traj.rollout_index,
                              Outcome.ABORTED.value, 0.0, False, [], [], error=f"rejected: {invalid}"[:500])
        if not self.scheduler.is_running(traj.group_id, traj.rollout_index):
            self.totals["late"] += 1  # its slot was re-issued after a timeout, or the learner restarted
            return
        self.totals["from_desktop"] += bool(traj.desktop)
        self.totals["desktop_busy_s"] += traj.timings.get("episode_s", 0.0)  # for desktop utilisation
        task = self.scheduler.running_task(traj.group_id, traj.rollout_index)
        self.window.record(task, traj.outcome)
        self.window.stages.add(traj)
        if self.sampler is not None:
            await self.sampler.offer(traj, task, step=self.step, version=self.version)
        self.totals[traj.outcome] += 1
        self.totals["trajectories"] += 1
        group = self.scheduler.on_trajectory(traj)
        self.admission.on_finish(accepted=Outcome(traj.outcome).trainable)
        if group is not None:
            accepted = sum(Outcome(t.outcome).trainable for t in group.trajectories())
            if self.baseline is not None:
                self.baseline.record_group(group.task.id, trainable_scores(group))
                self.admission.on_discard(accepted)  # evaluated, never trained on
                if self.baseline.done:
                    self._baseline_done.set()
                await self.dispatch()
                return
            if self.selector is not None:
                self.selector.record_group(group.task.id, trainable_scores(group))
            scored = self.batcher.add_group(group, self.version)
            self.admission.on_discard(accepted - (len(scored.trajectories) if scored else 0))
            self._offer_batch()
        await self.dispatch()

    def _offer_batch(self) -> None:
        """Put the next training batch on ``batches`` when one is due (see the module docstring)."""
        if self.rounds:
            if self._round_open and self.scheduler.idle:
                self._round_open = False
                self.batches.put_nowait(self.batcher.take_all())
        elif self.batches.empty() and self.batcher.has_batch:
            self.batches.put_nowait(self.batcher.take_batch())

    async def expire_loop(self, period_s: float = 5.0) -> None:
        """Re-issue rollouts that never came back (their actor died) every ``period_s``."""
        while True:
            await asyncio.sleep(period_s)
            for _ in range(self.scheduler.expire()):
                self.admission.on_finish(accepted=False)
            self.assigned = {key: p for key, p in self.assigned.items() if self.scheduler.is_running(*key)}
            await self.forget_silent_peers()
            await self.dispatch()

    async def evaluate(self, baseline: BaselinePass) -> None:
        """ARPO's baseline pass (learner.baseline): hand out ``baseline``'s groups (k rollouts of every task with the current policy)
        and wait until every one has come back. The groups are recorded in ``baseline`` and never trained on; the
        outcome window is reset afterwards, so the first training step's success rate is training's own.
        The scores are in ``baseline.results`` when this returns.

        The scheduler must have been built (or switched with ``set_task_source``) with ``baseline.pick_task``
        and a group budget of 0; this adds the pass's groups to the budget.
        """
        self.baseline = baseline
        self._baseline_done.clear()
        self.scheduler.add_group_budget(baseline.planned_groups)
        await self.dispatch()
        try:
            await self._baseline_done.wait()
        finally:
            self.baseline = None
        self.window.take()

    async def open_round(self, groups: int) -> None:
        """Lockstep: hand out one rollout batch of ``groups`` groups; once all of it came back, its scored groups
        (a list, perhaps empty) go on ``batches``.

        Raises:
            RuntimeError: the previous round has not come back yet, or the service was not built with ``rounds``.
            ValueError: the scheduler opens groups without a budget (the async schedule).
        """
        if not self.rounds or self._round_open or not self.scheduler.idle:
            raise RuntimeError("open_round while the previous rollout batch is still out (or not lockstep)")
        self._round_open = True
        self.scheduler.add_group_budget(groups)
        await self.dispatch()

    async def start_training(self, selector: TaskSelector, group_budget: int | None) -> None:
        """After the baseline pass: pick training tasks with ``selector`` (None budget: open groups without
        limit; 0: only what :meth:`open_round` adds), restart the stall clock and hand out work."""
        self.selector = selector
        self.scheduler.set_task_source(selector.pick_task, group_budget)
        self.last_step_at = time.monotonic()
        await self.dispatch()

    async def on_trained(self, step: int, version: int) -> None:
        """The training loop took optimizer steps up to ``step`` (in all, across restarts) and published
        ``version``: adopt it, announce it to every known actor, admit more work, offer the next batch."""
        self.step, self.version = step, version
        self.last_step_at, self.stall = time.monotonic(), None
        self.zero_variance_at_step = self.batcher.drops.get("zero_variance", 0)
        for peer in list(self.actors):
            await self.outbox.send(LearnerStatus(self.learner_id, version), peer)
        await self.dispatch()
        self._offer_batch()

    def on_unusable_batch(self) -> None:
        """The training loop got a batch with no usable sample (no optimizer step): count it."""
        self.totals["unusable_batches"] += 1

    async def watch_stall(self, warning_s: float, timeout_s: float, period_s: float = 5.0) -> None:
        """Say why no optimizer step happens (every ``warning_s``; also shown as ``stall`` in status.json), and
        raise StalledRun after ``timeout_s`` without one (0: never)."""
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

    def stall_reason(self, now: float | None = None, *, after_s: float) -> str | None:
        """Why the run makes no progress, when no optimizer step happened for ``after_s`` seconds although
        groups came back, every one without a reward difference; else None."""
        now = time.monotonic() if now is None else now
        idle = now - self.last_step_at
        flat = self.batcher.drops.get("zero_variance", 0) - self.zero_variance_at_step
        if after_s <= 0 or idle < after_s or self.baseline is not None or flat <= 0:
            return None
        trajectories = sum(self.window.outcomes.values())
        successes = self.window.outcomes.get(Outcome.SUCCESS.value, 0)
        return (f"no optimizer step for {idle:.0f} s: {successes} successes in {trajectories} trajectories since "
                f"the last step, {flat} groups without a reward difference; nothing to learn from. Consider a "
                "baseline pass (learner.baseline_k) or easier tasks")

    def queue_depths(self) -> dict[str, int]:
        """Queue depths now (metrics.jsonl ``queues``): the learner's ``waiting_requests`` (work requests not yet
        admitted), ``running`` (rollouts out), ``ready_groups`` (scored groups not yet trained on), ``outbox``
        (messages queued for the socket), and, summed over the actors heard from, their last Heartbeat's
        ``actor_running``, ``actor_waiting`` and ``actor_unacked`` (trajectories not yet acked)."""
        heard = [q for peer, q in self.actor_queues.items() if peer in self.actors]
        return {"waiting_requests": len(self.waiting), "running": self.admission.running,
                "ready_groups": self._ready_groups(), "outbox": self.outbox.qsize(),
                "outbox_full_waits": self.outbox.full_waits,
                "actor_running": sum(q[0] for q in heard), "actor_waiting": sum(q[1] for q in heard),
                "actor_unacked": sum(q[2] for q in heard)}

    def _ready_groups(self) -> int:
        """Scored groups not yet taken by the training loop (in the batcher or on ``batches``)."""
        return len(self.batcher.ready) + sum(len(batch) for batch in self.batches.pending())

    def counters(self) -> dict[str, Any]:
        """The counters a metrics record carries now (learner.records.step_record's ``counters``)."""
        return {"replay": self.batcher.replay.stats(),
                "task_selection": self.selector.stats() if self.selector is not None else {},
                "drops": dict(self.batcher.drops), "totals": dict(self.totals), "rejections": dict(self.rejections),
                "queues": self.queue_depths()}

    async def write_status(self, path: Path, period_s: float = 1.0) -> None:
        """Rewrite ``path`` (<run>/status.json) with :meth:`status` every ``period_s`` seconds, atomically (via a
        temp file), until cancelled."""
        tmp = path.with_suffix(".tmp")
        while True:
            tmp.write_text(json.dumps(self.status()))
            tmp.replace(path)
            await asyncio.sleep(period_s)

    def status(self) -> dict:
        """A snapshot for progress displays (written to <run>/status.json by the learner)."""
        return {"learner_id": self.learner_id, "policy_version": self.version, "stall": self.stall,
                "trajectories": self.totals["trajectories"],
                "from_desktop": self.totals["from_desktop"], "running": self.admission.running,
                "step": self.step,
                "waiting_requests": len(self.waiting), "actors": len(self.actors),
                "outcomes": {k: v for k, v in self.totals.items() if k.isupper()},
                "drops": dict(self.batcher.drops), "ready_groups": self._ready_groups(),
                "queues": self.queue_depths(),
                "totals": dict(self.totals), "wall_s": round(time.monotonic() - self.started, 3),
                **({"baseline": {"groups_recorded": self.baseline.recorded_groups,
                                 "groups_planned": self.baseline.planned_groups}} if self.baseline else {})}

    def state_dict(self) -> dict[str, Any]:
        """The service's resumable state: version, step, totals, drop counters, scheduler state, and the
        admission's accepted count less what a restart loses (groups still open or scored but not trained)."""
        ready = [g for batch in [self.batcher.ready, *self.batches.pending()] for g in batch]
        lost = self.scheduler.pending_trainable() + sum(len(g.trajectories) for g in ready)
        return {"schema": 1, "version": self.version, "step": self.step, "totals": dict(self.totals),
                "drops": dict(self.batcher.drops), "accepted": max(0, self.admission.accepted - lost),
                "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (before any actor is served).

        Raises:
            ValueError: unknown schema or malformed state.
        """
        if state.get("schema") != 1:
            raise ValueError(f"unsupported learner service state schema {state.get('schema')!r}")
        try:
            version, step, accepted = int(state["version"]), int(state["step"]), int(state["accepted"])
            totals = collections.Counter({str(k): _number(v) for k, v in state["totals"].items()})
            drops = collections.Counter({str(k): int(v) for k, v in state["drops"].items()})
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"malformed learner service state: {type(error).__name__}: {error}") from error
        self.scheduler.load_state_dict(state["scheduler"])
        self.version, self.step, self.totals, self.admission.accepted = version, step, totals, accepted
        self.batcher.drops.clear()
        self.batcher.drops.update(drops)

    async def shutdown_actors(self, reason: str) -> None:
        """Tell every known actor the run is over."""
        for peer in list(self.actors):
            await self.outbox.send(Shutdown(reason), peer)
