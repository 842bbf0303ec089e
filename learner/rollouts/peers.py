"""Peers and admission: which actors the learner knows, their work requests, and who runs which rollout.

Role: the learner service's half that hands out work. Owns the known peers (when each was last heard, the slots
its Hello announced, its last Heartbeat's queue depths), the queue of waiting work requests, the running rollouts
and the peer each was handed to, the request ids seen (with the assignment each got), the trajectory ids received
(with their fingerprints, for de-duplication), and the policy version as announced to actors. Sends through the
ROUTER pump's outbox. :meth:`Peers.receive` decides what becomes of a trajectory that came back and, when it is
taken, hands it to its slot's owner (the scheduler, or the evaluation rounds).

Fairness: waiting requests are queued per peer and rollouts are handed out round-robin over the peers that wait,
so a peer with thousands of requests waiting delays another peer's by at most one rollout each. A peer may have at
most ``min(its Hello's slots, transport.max_slots_per_peer)`` requests waiting or running; a peer that has sent no
Hello at most UNANNOUNCED_SLOTS, and at most UNANNOUNCED_PEERS such peers at once (more are refused, reason
``hello``), so neither one hog nor a storm of fresh identities can take all of the admission's capacity.
Bookkeeping is O(1) per request (per-peer counts, not scans).

Invariants: a request waits (backpressure) rather than being refused, unless its peer is at its cap; a rollout is
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
from dataclasses import dataclass
from typing import Protocol

from arpo_async.messages import (Assignment, Heartbeat, Hello, LearnerStatus, Outcome, Shutdown, Trajectory,
                                 WorkRequest)
from arpo_async.tasks import Task
from arpo_async.transport import Outbox
from arpo_async.validation import InvalidMessage
from learner.rollouts.evaluation_rounds import EvaluationRounds
from learner.rollouts.scheduler import Group, GroupScheduler

log = logging.getLogger("learner.rollouts.service")

UNANNOUNCED_SLOTS = 64
"""Requests a peer may have waiting or running before its Hello arrived (an actor's first requests can overtake
its Hello; a peer that never says hello gets no more than this)."""

UNANNOUNCED_PEERS = 16
"""Peers without a Hello that may have requests waiting or running at once; a request of one more is refused."""

SEEN_IDS = 200_000
"""Ids remembered for de-duplication (oldest forgotten first)."""

INVALID = b"invalid"
"""The fingerprint remembered for an invalid trajectory taken as ABORTED: any later trajectory with its id is refused
as a ``duplicate`` (a real fingerprint is 16 bytes, never this)."""


class SlotOwner(Protocol):
    """Who runs a rollout slot: the scheduler (training rollouts) or the evaluation rounds (episodes)."""

    def is_running(self, group_id: str, rollout_index: int) -> bool: ...
    def running_task(self, group_id: str, rollout_index: int) -> Task: ...
    def on_trajectory(self, traj: Trajectory) -> Group | None: ...


@dataclass
class Receipt:
    """What :meth:`Peers.receive` made of one trajectory.

    Attributes:
        taken: what went into its slot: the trajectory, or an ABORTED one in place of an invalid one from the
            slot's peer (so the rollout is handed out again); None when nothing was taken.
        task: the slot's task (when taken).
        group: the group it completed (a training rollout's last), else None.
        evaluation: the slot was an evaluation episode's (learner.rollouts.evaluation_rounds).
        problem: why the peer gets a Reject (None: no Reject).
    """

    taken: Trajectory | None = None
    task: Task | None = None
    group: Group | None = None
    evaluation: bool = False
    problem: InvalidMessage | None = None


class Admission(Protocol):
    """What the service needs from an admission rule (learner.rollouts.staleness.StalenessManager,
    learner.rollouts.scheduler.LockstepAdmission)."""

    accepted: int
    running: int

    def can_admit(self, version: int) -> bool: ...
    def on_start(self) -> None: ...
    def on_finish(self, accepted: bool) -> None: ...
    def on_discard(self, count: int) -> None: ...


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
        totals: the run's counters (learner.rollouts.run_stats.RunStats.totals); this counts ``silent_peers`` and
            ``assignments_resent`` in it.
        learner_id: announced in every LearnerStatus.
        version: the policy version to announce first (a resumed learner's comes from its checkpoint).
        peer_timeout_s: a peer not heard from for this long (heartbeats come every transport.heartbeat_s) is
            forgotten.
        run_id: this run's id; a Hello or WorkRequest naming another run is refused (see :meth:`check_run`).
        max_slots_per_peer: the most requests one peer may have waiting or running, whatever its Hello announced
            (transport.max_slots_per_peer).
        evaluation: the held-out evaluation rounds whose episodes go out first (None: the run does not evaluate).
    """

    def __init__(self, outbox: Outbox, scheduler: GroupScheduler, admission: Admission,
                 totals: collections.Counter[str], *, learner_id: str, version: int = 0,
                 peer_timeout_s: float = 30.0, run_id: str = "", max_slots_per_peer: int = 1024,
                 evaluation: EvaluationRounds | None = None) -> None:
        self.outbox = outbox
        self.evaluation = evaluation
        self.run_id = run_id
        self.scheduler = scheduler
        self.admission = admission
        self.totals = totals
        self.learner_id = learner_id
        self.version = version
        """The policy version as announced to actors (changed only by :meth:`announce` and :meth:`restore`)."""
        self.peer_timeout_s = peer_timeout_s
        self.actors: dict[str, float] = {}
        """Peer -> when it was last heard from (time.monotonic)."""
        self.peer_slots: dict[str, int] = {}
        """Rollout slots each peer announced in its Hello: the most requests it may have waiting or running."""
        self.actor_queues: dict[str, tuple[int, int, int, int]] = {}
        """Peer -> (running, waiting, unacked, outbox) from its last Heartbeat (see :meth:`depths`)."""
        self.max_slots_per_peer = max_slots_per_peer
        self.waiting: collections.OrderedDict[str, collections.deque[WorkRequest]] = collections.OrderedDict()
        """Peer -> its waiting requests (oldest first); the peers in the order the next rollouts go to them."""
        self.waiting_count = 0
        """Requests waiting, over all peers."""
        self.assigned: dict[tuple[str, int], str] = {}
        """Running rollout (group id, rollout index) -> the peer it was handed to."""
        self._outstanding: collections.Counter[str] = collections.Counter()
        """Peer -> its requests waiting plus its rollouts running (peers with none are left out)."""
        self._unannounced: set[str] = set()
        """Peers without a Hello that have requests waiting or running (at most UNANNOUNCED_PEERS)."""
        self._requests_seen: collections.OrderedDict[str, Assignment | None] = collections.OrderedDict()
        """Request ids seen (None while waiting), with the assignment each got, so a re-sent request whose answer
        was lost (a full ROUTER queue drops silently) gets the same assignment again."""
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

    def receive(self, peer: str, traj: Trajectory, digest: bytes | None, problem: InvalidMessage | None) -> Receipt:
        """Decide what becomes of a trajectory ``peer`` sent: take it for its rollout slot only when it is valid,
        new, and comes from the peer the slot was handed to with the slot's task; a taken one leaves its slot
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
        owned = owner is not None and self.assigned.get(slot) == peer
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
            self.totals["duplicates"] += 1
            return Receipt()
        if owner is None:
            remember(self._received, traj.trajectory_id, digest)
            self.totals["late"] += 1  # its slot was re-issued after a timeout, or the learner restarted
            return Receipt()
        if not owned:
            return Receipt(problem=InvalidMessage("owner", f"rollout {slot} was handed to another peer"))
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
            why = (f"this learner runs {self.run_id!r} but actor {peer} belongs to run {run_id[:80]!r} (an arpo-actors "
                   "left over from another run?); stop it, or give both the same run_id")
            await self.outbox.send(Shutdown(why, refused=True), peer)
            raise InvalidMessage("run", why)

    async def on_hello(self, peer: str, hello: Hello | Heartbeat) -> None:
        """Note a Hello's slots or a Heartbeat's queue depths, and answer with the learner id and version.

        Raises:
            InvalidMessage: reason "run": a Hello of another run (:meth:`check_run`).
        """
        if isinstance(hello, Hello):
            await self.check_run(peer, hello.run_id)
            self.peer_slots[peer] = hello.slots
            self._unannounced.discard(peer)
        else:
            self.actor_queues[peer] = (hello.running, hello.waiting, hello.unacked, hello.outbox)
        await self.outbox.send(LearnerStatus(self.learner_id, self.version), peer)

    async def request(self, peer: str, request: WorkRequest) -> None:
        """Queue a (validated) work request and hand out what the admission rule allows; a repeat gets its
        assignment again (or keeps waiting).

        Raises:
            InvalidMessage: reason "slots": ``peer`` already has as many requests waiting or running as its
                Hello announced (UNANNOUNCED_SLOTS before one); reason "run": a request of another run.
        """
        await self.check_run(peer, request.run_id)
        if request.request_id in self._requests_seen:
            await self._answer_again(peer, request.request_id)
            return
        announced = peer in self.peer_slots
        allowed = min(self.peer_slots.get(peer, UNANNOUNCED_SLOTS), self.max_slots_per_peer)
        if not announced and peer not in self._unannounced and len(self._unannounced) >= UNANNOUNCED_PEERS:
            raise InvalidMessage("hello", f"{peer} sent no Hello, and {UNANNOUNCED_PEERS} such peers already have "
                                          "requests waiting or running")
        if self._outstanding[peer] >= allowed:
            raise InvalidMessage("slots", f"{peer} already has {self._outstanding[peer]} requests waiting or "
                                          f"running, its cap of {allowed} (the slots its Hello announced, at most "
                                          "transport.max_slots_per_peer)")
        remember(self._requests_seen, request.request_id)
        self.waiting.setdefault(peer, collections.deque()).append(request)
        self.waiting_count += 1
        self._outstanding[peer] += 1
        if not announced:
            self._unannounced.add(peer)
        await self.dispatch()

    def returned(self, group_id: str, rollout_index: int) -> None:
        """A trajectory for this rollout came back (the peer no longer runs it)."""
        peer = self.assigned.pop((group_id, rollout_index), None)
        if peer is not None:
            self._release(peer)

    def _release(self, peer: str, count: int = 1) -> None:
        """``count`` of ``peer``'s requests or rollouts ended."""
        self._outstanding[peer] -= count
        if self._outstanding[peer] <= 0:
            del self._outstanding[peer]
            self._unannounced.discard(peer)

    def _next_request(self) -> tuple[str, WorkRequest]:
        """The oldest request of the peer whose turn it is (round-robin over the peers that wait)."""
        peer, queue = next(iter(self.waiting.items()))
        request = queue.popleft()
        if queue:
            self.waiting.move_to_end(peer)
        else:
            del self.waiting[peer]
        self.waiting_count -= 1
        return peer, request

    async def dispatch(self) -> None:
        """Hand out work to waiting requests, round-robin over their peers: evaluation episodes first, then
        rollouts while the scheduler has slots and the admission rule admits them."""
        while self.waiting:
            evaluation = self.evaluation is not None and self.evaluation.has_work
            if not evaluation and not (self.scheduler.has_work and self.admission.can_admit(self.version)):
                return
            peer, request = self._next_request()
            if evaluation:
                rollout, extra = self.evaluation.next_rollout(), self.evaluation.assignment_fields
            else:
                rollout, extra = self.scheduler.next_rollout(), {}
                self.admission.on_start()
            assignment = Assignment(request.request_id, rollout.task.to_dict(), rollout.group_id,
                                    rollout.rollout_index, self.version, **extra)
            self.assigned[(rollout.group_id, rollout.rollout_index)] = peer
            if request.request_id in self._requests_seen:
                self._requests_seen[request.request_id] = assignment
            await self.outbox.send(assignment, peer)

    async def _answer_again(self, peer: str, request_id: str) -> None:
        """A request arrived again: re-send its assignment if it had one and the slot still runs; if it is still
        waiting, do nothing (it is answered when admitted)."""
        assignment = self._requests_seen[request_id]
        if assignment is not None and self.is_running(assignment.group_id, assignment.rollout_index):
            self.totals["assignments_resent"] += 1
            await self.outbox.send(assignment, peer)

    async def announce(self, version: int) -> None:
        """Adopt a newly published policy ``version``: announce it to every known actor, admit more work."""
        self.version = version
        for peer in list(self.actors):
            await self.outbox.send(LearnerStatus(self.learner_id, version), peer)
        await self.dispatch()

    def restore(self, version: int) -> None:
        """Resume at a checkpoint's policy ``version`` (before any actor is served)."""
        self.version = version

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
            self._outstanding.pop(peer, None)
            self._unannounced.discard(peer)
        slots = [key for key, p in self.assigned.items() if p in silent]
        for key in slots:
            del self.assigned[key]
        reissued = self.scheduler.expire_slots(slots)
        for _ in range(reissued):
            self.admission.on_finish(accepted=False)
        if self.evaluation is not None:
            reissued += self.evaluation.expire_slots(slots)
        for peer in silent:
            self.actors.pop(peer, None)
            self.peer_slots.pop(peer, None)
        self.totals["silent_peers"] += len(silent)
        log.warning("%d peer(s) silent for %.0f s (%s): dropped %d waiting requests, re-issued %d rollouts",
                    len(silent), self.peer_timeout_s, ", ".join(sorted(silent))[:200], dropped,
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
                self._release(self.assigned.pop(key))
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
