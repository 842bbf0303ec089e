"""Peers and admission: which actors the learner knows, their work requests, and who runs which rollout.

Role: the learner service's half that hands out work. Owns the known peers (when each was last heard, the slots
its Hello announced, its last Heartbeat's queue depths), the queue of waiting work requests, the running rollouts
and the peer each was handed to, the request ids seen (with the assignment each got), the trajectory ids received
(with their fingerprints, for de-duplication), and the policy version as announced to actors. Sends through the
ROUTER pump's outbox. :meth:`Peers.receive` decides what becomes of a trajectory that came back and, when it is
taken, hands it to its slot's owner (the scheduler, or the evaluation rounds).

Ownership: a request or a rollout belongs to the session (learner.rollouts.sessions) its WorkRequest named, a secret
the peer opened in its Hello; a request naming no session its peer opened gets nothing (reason ``session``), and a
trajectory is taken only with its slot's session and from the routing id the slot was handed to (else reason
``owner``), so a peer that copies another's routing id, or learns another's session, can neither take its rollouts
nor submit for them.

Fairness: waiting requests are queued per peer, and training rollouts go round-robin over the peers that wait, first
to those holding fewer than their fair share (learner.rollouts.fair_share: max-min fairness of the admitted rollouts
over the active peers' slots), then to the others, so capacity is never left idle while someone waits. A peer may
have at most ``min(its Hello's slots, transport.max_slots_per_peer)`` requests waiting or running. A peer that has
waited ``starved_after_s`` holding no rollout at all, while the admission rule admits none and another peer holds
more than its share, takes one back: that peer's newest rollout is re-issued (counted in ``rollouts_reclaimed``;
its trajectory, if it still comes, is acked as late). So a hog, or a storm of peers, that took every admitted
rollout before an honest actor arrived delays it by ``starved_after_s``, not by ``rollout_timeout_s``. Bookkeeping
is O(1) per request, plus a sort of the active peers per dispatch when more than one peer is active.

Invariants: a request waits (backpressure) rather than being refused, unless its peer is at its cap or names no session
it was issued; a rollout is
handed out only while the scheduler has a slot and the admission rule (StalenessManager or LockstepAdmission)
admits one more; an evaluation episode (learner.rollouts.evaluation_rounds) waiting goes out first, outside the
admission rule (it is never trained on, so it adds no policy lag to any batch); a re-sent request gets the assignment it
got before while that rollout still runs; a peer silent for ``peer_timeout_s`` is forgotten, its waiting requests
dropped and its running rollouts handed out again at once.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

from arpo_async.messages import (Assignment, Heartbeat, Hello, LearnerStatus, Outcome, Shutdown, Trajectory,
                                 WorkRequest)
from arpo_async.process import WarningBudget
from arpo_async.tasks import Task
from arpo_async.transport import Outbox, peer_name
from arpo_async.validation import InvalidMessage
from learner.rollouts.evaluation_rounds import EvaluationRounds
from learner.rollouts.fair_share import fair_shares
from learner.rollouts.holds import Admission, Hold, Receipt, SlotOwner, Waiting
from learner.rollouts.scheduler import GroupScheduler
from learner.rollouts.sessions import SessionBook
from learner.state import RunState

log = logging.getLogger("learner.rollouts.service")

STARVED_AFTER_S = 30.0
"""A peer waiting this long with no rollout running may take one back from a peer above its fair share."""

SEEN_IDS = 200_000
"""Ids remembered for de-duplication (oldest forgotten first)."""

INVALID = b"invalid"
"""The fingerprint remembered for an invalid trajectory taken as ABORTED: any later trajectory with its id is refused
as a ``duplicate`` (a real fingerprint is 16 bytes, never this)."""


def remember(seen: collections.OrderedDict, key: str, value: object = None) -> None:
    """Add ``key`` to ``seen``, forgetting the oldest key beyond SEEN_IDS."""
    seen[key] = value
    if len(seen) > SEEN_IDS:
        seen.popitem(last=False)


class Peers:
    """The known actors and the work handed to them (see the module docstring).

    Args:
        outbox: the ROUTER pump's outbox.
        scheduler: hands out rollout slots.
        admission: the admission rule.
        state: the run's state (learner.state.RunState): this counts ``silent_peers``, ``duplicates``, ``late``,
            ``rollouts_reclaimed`` and ``assignments_resent`` in its ``totals``, and announces its published
            version first (a resumed learner's comes from its checkpoint: :meth:`restore`).
        learner_id: announced in every LearnerStatus.
        peer_timeout_s: a peer not heard from for this long (heartbeats come every transport.heartbeat_s) is
            forgotten.
        run_id: this run's id; a Hello or WorkRequest naming another run is refused (see :meth:`check_run`).
        max_slots_per_peer: the most requests one peer may have waiting or running, whatever its Hello announced
            (transport.max_slots_per_peer).
        evaluation: the held-out evaluation rounds whose episodes go out first (None: the run does not evaluate).
        starved_after_s: how long a peer holding no rollout waits before it takes one back from a peer above its
            fair share (see the module docstring).
    """

    def __init__(self, outbox: Outbox, scheduler: GroupScheduler, admission: Admission,
                 state: RunState, *, learner_id: str,
                 peer_timeout_s: float = 30.0, run_id: str = "", max_slots_per_peer: int = 1024,
                 evaluation: EvaluationRounds | None = None, starved_after_s: float = STARVED_AFTER_S) -> None:
        self.outbox = outbox
        self.evaluation = evaluation
        self.run_id = run_id
        self.scheduler = scheduler
        self.admission = admission
        self.state = state
        self.learner_id = learner_id
        self.announced_version = state.published_version
        """The policy version last announced to actors (changed only by :meth:`announce` and :meth:`restore`);
        never ahead of ``state.published_version``."""
        self.peer_timeout_s = peer_timeout_s
        self.actors: dict[str, float] = {}
        """Peer -> when it was last heard from (time.monotonic)."""
        self.peer_slots: dict[str, int] = {}
        """Rollout slots each peer announced in its Hello: the most requests it may have waiting or running."""
        self.actor_queues: dict[str, tuple[int, int, int, int]] = {}
        """Peer -> (running, waiting, unacked, outbox) from its last Heartbeat (see :meth:`depths`)."""
        self.max_slots_per_peer = max_slots_per_peer
        self.waiting: collections.OrderedDict[str, collections.deque[Waiting]] = collections.OrderedDict()
        """Peer -> its waiting requests (oldest first); the peers in the order the next rollouts go to them."""
        self.waiting_count = 0
        """Requests waiting, over all peers."""
        self.sessions = SessionBook()
        """The sessions issued in answers to Hello; every request and trajectory must name its own."""
        self.assigned: dict[tuple[str, int], Hold] = {}
        """Running slot (group id, rollout index) -> who holds it (oldest first)."""
        self.starved_after_s = starved_after_s
        self._outstanding: collections.Counter[str] = collections.Counter()
        """Peer -> its requests waiting plus its rollouts running (peers with none are left out)."""
        self._running: collections.Counter[str] = collections.Counter()
        """Peer -> the training rollouts it holds (peers with none are left out)."""
        self._requests_seen: collections.OrderedDict[str, tuple[str, Assignment | None]] = collections.OrderedDict()
        """Request ids seen, with the session each came with and the assignment it got (None while waiting), so a
        re-sent request whose answer was lost (a full ROUTER queue drops silently) gets the same assignment again,
        and only under its own session."""
        self._warnings = WarningBudget(log)
        self._received: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        """Trajectory ids taken (or late), with the fingerprint of their content (learner.rollouts.acks)."""

    def is_running(self, group_id: str, rollout_index: int) -> bool:
        """Whether this slot is handed out and not back: a training rollout or an evaluation episode."""
        return self.scheduler.is_running(group_id, rollout_index) or (
            self.evaluation is not None and self.evaluation.is_running(group_id, rollout_index))

    def is_evaluation(self, group_id: str, rollout_index: int) -> bool:
        """Whether this slot is a running evaluation episode."""
        return self.evaluation is not None and self.evaluation.is_running(group_id, rollout_index)

    def running_task(self, group_id: str, rollout_index: int) -> Task:
        """The task of a running slot (:meth:`is_running`). Raises KeyError when the slot is not running."""
        if self.is_evaluation(group_id, rollout_index):
            return self.evaluation.running_task(group_id, rollout_index)
        return self.scheduler.running_task(group_id, rollout_index)

    def _slot_owner(self, group_id: str, rollout_index: int) -> SlotOwner | None:
        """Who runs this slot now: the scheduler, the evaluation rounds, or nobody (None: not running)."""
        if self.scheduler.is_running(group_id, rollout_index):
            return self.scheduler
        if self.evaluation is not None and self.evaluation.is_running(group_id, rollout_index):
            return self.evaluation
        return None

    def receive(self, peer: str, traj: Trajectory, digest: bytes | None, problem: InvalidMessage | None,
                key: str = "") -> Receipt:
        """Decide what becomes of a trajectory ``peer`` sent: take it for its rollout slot only when it is valid,
        new, and carries the session the slot was handed out under, from the routing id the slot was handed to
        (the one that opened the session) and, with CURVE, with that session's key ``key``, with the slot's task;
        a taken one leaves its slot
        (the peer's count drops) and goes to the slot's owner (:meth:`GroupScheduler.on_trajectory`, or the
        evaluation rounds'). Otherwise nothing of the slot changes, and the receipt says why: a Reject (reasons
        ``owner``, ``task``, ``duplicate`` for an id reused with other content, or the validation's), or a count
        (``duplicates`` for a re-send after a lost Ack, ``late`` for a slot not running). An invalid trajectory
        from the slot's peer ends the slot as ABORTED, so the rollout is handed out again; its id is remembered.

        Args:
            digest: the trajectory's fingerprint (learner.rollouts.acks.fingerprint); None when it is invalid.
            problem: why it is invalid (arpo_async.validation.check_trajectory), or None.
        """
        slot = (traj.group_id, traj.rollout_index)
        owner = self._slot_owner(*slot)
        hold = self.assigned.get(slot)
        owned = owner is not None and hold is not None and (peer, traj.session, key) == (hold.peer, hold.session,
                                                                                          hold.key)
        seen = self._received.get(traj.trajectory_id, False)
        if problem is None and seen is False and owned and traj.task_id != (task := owner.running_task(*slot)).id:
            problem = InvalidMessage("task", f"rollout {slot} is of task {task.id!r}, not {traj.task_id[:80]!r}")
        if problem is not None:
            if seen is not False or not owned:
                return Receipt(problem=problem)
            remember(self._received, traj.trajectory_id, INVALID)  # never trained on; a re-send is a duplicate
            aborted = Trajectory(traj.trajectory_id, traj.actor_id, traj.task_id, traj.group_id, traj.rollout_index,
                                 Outcome.ABORTED.value, 0.0, False, [], [], error=f"rejected: {problem}"[:500])
            return self._take(slot, owner, aborted, problem)
        if seen is not False:
            if seen != digest:
                return Receipt(problem=InvalidMessage("duplicate", f"trajectory id {traj.trajectory_id[:80]!r} was "
                                                                   "already received with other content"))
            self.state.totals["duplicates"] += 1
            return Receipt()
        if owner is None:
            remember(self._received, traj.trajectory_id, digest)
            self.state.totals["late"] += 1  # its slot was re-issued after a timeout, or the learner restarted
            return Receipt()
        if not owned:
            return Receipt(problem=InvalidMessage("owner", f"rollout {slot} belongs to another session"))
        remember(self._received, traj.trajectory_id, digest)
        return self._take(slot, owner, traj, None)

    def _take(self, slot: tuple[str, int], owner: SlotOwner, traj: Trajectory,
              problem: InvalidMessage | None) -> Receipt:
        """``traj`` leaves its running ``slot`` for ``owner``."""
        task = owner.running_task(*slot)
        self.returned(*slot)
        group = owner.on_trajectory(traj)
        return Receipt(traj, task, group, owner is self.evaluation, problem)

    def heard(self, peer: str) -> None:
        """``peer`` sent something just now."""
        self.actors[peer] = time.monotonic()

    async def check_run(self, peer: str, run_id: str) -> None:
        """Refuse a message of an actor of another run (an orphan of an earlier run that took this run's
        endpoint and actor id): tell it to exit with a Shutdown that names both runs (``refused``).

        Raises:
            InvalidMessage: reason "run", when ``run_id`` and this run's are both set and differ.
        """
        if run_id and self.run_id and run_id != self.run_id:
            why = (f"this learner runs {self.run_id!r} but actor {peer_name(peer)} belongs to run {run_id[:80]!r} (an "
                   "arpo-actors left over from another run?); stop it, or give both the same run_id")
            await self.outbox.send(Shutdown(why, refused=True), peer)
            raise InvalidMessage("run", why)

    async def on_hello(self, peer: str, hello: Hello | Heartbeat, key: str = "") -> None:
        """Note a Hello's slots and open its session (bound to ``peer`` and its CURVE key ``key``), or note a
        Heartbeat's queue depths; answer with the learner id and version.

        Raises:
            InvalidMessage: reason "run": a Hello of another run (:meth:`check_run`); reason "session": a Hello
                whose session cannot be opened (learner.rollouts.sessions.SessionBook.open).
        """
        if isinstance(hello, Hello):
            await self.check_run(peer, hello.run_id)
            self.sessions.open(hello.session, peer, key)
            self.peer_slots[peer] = hello.slots
        else:
            self.actor_queues[peer] = (hello.running, hello.waiting, hello.unacked, hello.outbox)
        await self.outbox.send(LearnerStatus(self.learner_id, self.announced_version), peer)

    async def request(self, peer: str, request: WorkRequest, key: str = "") -> None:
        """Queue a (validated) work request of ``peer`` (CURVE key ``key``) and hand out what the admission rule
        allows; a repeat under the same session gets its assignment again (or keeps waiting).

        Raises:
            InvalidMessage: reason "run": a request of another run; reason "session": a session ``peer`` did not
                open (learner.rollouts.sessions.SessionBook.check); reason "duplicate": a request
                id already seen under another session; reason "slots": ``peer`` already has as many requests
                waiting or running as its Hello announced.
        """
        await self.check_run(peer, request.run_id)
        self.sessions.check(request.session, peer, key)
        if request.request_id in self._requests_seen:
            await self._answer_again(peer, request)
            return
        allowed = min(self.peer_slots.get(peer, 0), self.max_slots_per_peer)
        if self._outstanding[peer] >= allowed:
            raise InvalidMessage("slots", f"{peer} already has {self._outstanding[peer]} requests waiting or "
                                          f"running, its cap of {allowed} (the slots its Hello announced, at most "
                                          "transport.max_slots_per_peer)")
        remember(self._requests_seen, request.request_id, (request.session, None))
        self.waiting.setdefault(peer, collections.deque()).append(Waiting(request, key, time.monotonic()))
        self.waiting_count += 1
        self._outstanding[peer] += 1
        self.sessions.add(request.session)
        await self.dispatch()

    def returned(self, group_id: str, rollout_index: int) -> None:
        """A trajectory for this rollout came back (the peer no longer runs it)."""
        hold = self.assigned.pop((group_id, rollout_index), None)
        if hold is not None:
            self._release_hold(hold)

    def _release(self, peer: str, session: str, count: int = 1) -> None:
        """``count`` of ``peer``'s requests or rollouts (of ``session``) ended."""
        self.sessions.add(session, -count)
        self._outstanding[peer] -= count
        if self._outstanding[peer] <= 0:
            del self._outstanding[peer]

    def _release_hold(self, hold: Hold) -> None:
        """A running slot held by ``hold`` ended (came back, or was taken back)."""
        self._release(hold.peer, hold.session)
        if hold.training:
            self._running[hold.peer] -= 1
            if self._running[hold.peer] <= 0:
                del self._running[hold.peer]

    def _pop_request(self, peer: str) -> Waiting:
        """The oldest waiting request of ``peer``, which goes to the end of the round-robin order."""
        queue = self.waiting[peer]
        waiting = queue.popleft()
        if queue:
            self.waiting.move_to_end(peer)
        else:
            del self.waiting[peer]
        self.waiting_count -= 1
        return waiting

    def fair_shares(self) -> dict[str, int]:
        """The active peers' (those with requests waiting or rollouts running) fair shares of the training
        rollouts the admission rule allows now: those running plus those it admits (learner.rollouts.fair_share)."""
        slots = {peer: min(self.peer_slots.get(peer, 0), self.max_slots_per_peer) for peer in self._outstanding}
        return fair_shares(slots, self.admission.running + self.admission.capacity(self.announced_version))

    def _next_peer(self, shares: dict[str, int] | None) -> str:
        """Whose turn it is: the first waiting peer (round-robin) below its share, else the first waiting peer."""
        if shares is not None:
            for peer in self.waiting:
                if self._running[peer] < shares.get(peer, 0):
                    return peer
        return next(iter(self.waiting))

    def _reclaim(self, shares: dict[str, int]) -> bool:
        """A waiting peer with a share has held no rollout for ``starved_after_s`` while the admission rule admits
        none: take the newest training rollout back from the peer furthest above its share and re-issue it. True
        when one was taken back (the admission rule then admits one more, and :meth:`_next_peer` hands it to a peer
        below its share, so reclaiming never feeds the peer it took from and always ends)."""
        now = time.monotonic()
        starved = next((peer for peer, queue in self.waiting.items() if not self._running[peer]
                        and shares.get(peer, 0) > 0 and now - queue[0].since >= self.starved_after_s), None)
        over = max(self._running, key=lambda peer: self._running[peer] - shares.get(peer, 0), default=None)
        if starved is None or over is None or self._running[over] <= shares.get(over, 0):
            return False
        slot, hold = next((slot, hold) for slot, hold in reversed(self.assigned.items())
                          if hold.peer == over and hold.training)
        del self.assigned[slot]
        self._release_hold(hold)
        for _ in range(self.scheduler.expire_slots([slot])):
            self.admission.on_finish(accepted=False)
        self.state.totals["rollouts_reclaimed"] += 1
        if not self._warnings.warning("%s waited %.0f s with no rollout while %s held %d (its fair share: %d); "
                                      "re-issued rollout %s", peer_name(starved), self.starved_after_s, peer_name(over),
                                      self._running[over] + 1, shares.get(over, 0), slot):
            self.state.totals["warnings_suppressed"] += 1
        return True

    async def dispatch(self) -> None:
        """Hand out work to waiting requests, round-robin over their peers: evaluation episodes first, then
        training rollouts, first to peers below their fair share, while the scheduler has slots and the admission
        rule admits them; a peer starved for ``starved_after_s`` takes one back (:meth:`_reclaim`)."""
        shares: dict[str, int] | None = None
        while self.waiting:
            evaluation = self.evaluation is not None and self.evaluation.has_work
            if not evaluation:
                if not self.scheduler.has_work:
                    return
                if shares is None and len(self._outstanding) > 1:
                    shares = self.fair_shares()  # running + admissible is unchanged by handing one out
                if not self.admission.can_admit(self.announced_version) and not (shares and self._reclaim(shares)):
                    return
            peer = self._next_peer(None if evaluation else shares)
            waiting = self._pop_request(peer)
            request = waiting.request
            if evaluation:
                rollout, extra = self.evaluation.next_rollout(), self.evaluation.assignment_fields
            else:
                rollout, extra = self.scheduler.next_rollout(), {}
                self.admission.on_start()
                self._running[peer] += 1
            assignment = Assignment(request.request_id, rollout.task.to_dict(), rollout.group_id,
                                    rollout.rollout_index, self.announced_version, **extra)
            self.assigned[(rollout.group_id, rollout.rollout_index)] = Hold(peer, request.session, waiting.key,
                                                                           not evaluation)
            if request.request_id in self._requests_seen:
                self._requests_seen[request.request_id] = (request.session, assignment)
            await self.outbox.send(assignment, peer)

    async def _answer_again(self, peer: str, request: WorkRequest) -> None:
        """A request arrived again: under its first session, re-send its assignment if it had one and the slot
        still runs, or do nothing while it waits (it is answered when admitted).

        Raises:
            InvalidMessage: reason "duplicate": the id was first sent under another session.
        """
        session, assignment = self._requests_seen[request.request_id]
        if session != request.session:
            raise InvalidMessage("duplicate", f"request id {request.request_id[:80]!r} was sent under another "
                                              "session")
        if assignment is not None and self.is_running(assignment.group_id, assignment.rollout_index):
            self.state.totals["assignments_resent"] += 1
            await self.outbox.send(assignment, peer)

    async def announce(self, version: int) -> None:
        """Adopt a newly published policy ``version``: announce it to every known actor, admit more work."""
        self.announced_version = version
        for peer in list(self.actors):
            await self.outbox.send(LearnerStatus(self.learner_id, version), peer)
        await self.dispatch()

    def restore(self, version: int) -> None:
        """Resume at a checkpoint's policy ``version`` (before any actor is served)."""
        self.announced_version = version

    async def forget_silent_peers(self, now: float | None = None) -> int:
        """Drop the waiting requests of every peer silent for ``peer_timeout_s`` and re-issue its running
        rollouts at once (its trajectories, if it comes back, are then acked as late). Returns the peers dropped."""
        now = time.monotonic() if now is None else now
        silent = {peer for peer, seen in self.actors.items() if now - seen > self.peer_timeout_s}
        if not silent:
            return 0
        dropped = 0
        for peer in silent:
            queue = self.waiting.pop(peer, ())
            dropped += len(queue)
            self.waiting_count -= len(queue)
            for waiting in queue:  # never answered: the same id may come again, under a new session
                self._release(peer, waiting.request.session)
                self._requests_seen.pop(waiting.request.request_id, None)
        slots = [key for key, hold in self.assigned.items() if hold.peer in silent]
        for key in slots:
            self._release_hold(self.assigned.pop(key))
        reissued = self.scheduler.expire_slots(slots)
        for _ in range(reissued):
            self.admission.on_finish(accepted=False)
        if self.evaluation is not None:
            reissued += self.evaluation.expire_slots(slots)
        for peer in silent:
            self.actors.pop(peer, None)
            self.peer_slots.pop(peer, None)
            self.sessions.forget_peer(peer)
        self.state.totals["silent_peers"] += len(silent)
        log.warning("%d peer(s) silent for %.0f s (%s): dropped %d waiting requests, re-issued %d rollouts",
                    len(silent), self.peer_timeout_s, ", ".join(sorted(map(peer_name, silent)))[:200], dropped,
                    reissued)
        await self.dispatch()
        return len(silent)

    async def expire_loop(self, period_s: float = 5.0) -> None:
        """Every ``period_s``: re-issue rollouts that never came back (their actor died) and forget silent peers."""
        while True:
            await asyncio.sleep(period_s)
            for _ in range(self.scheduler.expire()):
                self.admission.on_finish(accepted=False)
            if self.evaluation is not None:
                self.evaluation.expire()
            for key in [key for key in self.assigned if not self.is_running(*key)]:
                self._release_hold(self.assigned.pop(key))
            await self.forget_silent_peers()
            await self.dispatch()

    async def shutdown(self, reason: str) -> None:
        """Tell every known actor the run is over."""
        for peer in list(self.actors):
            await self.outbox.send(Shutdown(reason), peer)

    def depths(self) -> dict[str, int]:
        """``waiting_requests`` (not yet admitted, over all peers), ``waiting_max_peer`` (the longest one peer's
        request queue), ``running`` (rollouts out) and, over the actors heard from, their last Heartbeat's
        ``actor_running``, ``actor_waiting``, ``actor_unacked`` and ``actor_outbox`` (summed) and
        ``actor_outbox_max`` (the fullest actor process's outbox). O(peers)."""
        heard = [q for peer, q in self.actor_queues.items() if peer in self.actors]
        return {"waiting_requests": self.waiting_count,
                "waiting_max_peer": max(map(len, self.waiting.values()), default=0),
                "running": self.admission.running,
                "actor_running": sum(q[0] for q in heard), "actor_waiting": sum(q[1] for q in heard),
                "actor_unacked": sum(q[2] for q in heard), "actor_outbox": sum(q[3] for q in heard),
                "actor_outbox_max": max((q[3] for q in heard), default=0)}
