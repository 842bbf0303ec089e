"""The actor process's link to the learner: work requests out, assignments in, trajectories held until acked.

Owns: the outstanding work requests, the unacknowledged trajectories and the policy version last announced by
the learner. Channels (made by the wiring function, actors.main): it consumes the DEALER pump's inbox
(:meth:`LearnerLink.serve`) and sends through the pump's outbox.
Invariants:
- a trajectory is kept until the learner acknowledges it; it is sent again after ``resend_after_s`` and
  whenever the learner restarts (a new learner id in LearnerStatus); the learner drops duplicates by id.
  What ZeroMQ queued while no learner ran reaches a restarted learner first, possibly before any heartbeat
  (one written to the dead connection is lost), so some held trajectories may be acked before the restart is
  noticed; a trajectory lost on the dead connection stays held and is sent again;
- a work request is re-sent after a learner restart (the new learner never saw it) and when unanswered for
  ``resend_after_s`` (a full ROUTER queue drops replies silently); the learner answers a repeat with the same
  assignment, or keeps it waiting;
- a trajectory the codec cannot encode (a value msgpack cannot pack) is replaced, under its id, by an ENV_ERROR
  record of it with no steps or screenshots and the codec's reason as its error, which the learner counts and
  never trains on, so its group is not left waiting; if even that record cannot be encoded the trajectory is
  dropped with an error in the log. The actor process and every other trajectory go on;
- work is asked for under a session: a secret this process draws once (128 random bits) and sends in its Hello
  (arpo_async.messages.Hello.session), never received back. Every WorkRequest and trajectory names it, so a peer
  that copies this routing id can neither take these rollouts nor submit for them. The Hello goes again after a
  learner restart, and at the next heartbeat after a Reject of reason ``session`` (the learner lost the Hello, or
  forgot the session of a peer it thought silent); the refused requests then go again after ``resend_after_s``;
- nothing here blocks an EnvActor except the bounded outbox (backpressure) and waiting for work.

A LearnerLink is the run's ``actors.env_actor.WorkSource`` and an ``actors.sinks.TrajectorySink``
(``EpisodeRunner.run_task(..., sink=link)`` sends a trajectory to the learner).
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import logging
import time
from dataclasses import dataclass, replace

from arpo_async.config import TransportConfig
from arpo_async.messages import (Ack, Assignment, Heartbeat, Hello, LearnerStatus, Outcome, Reject, Shutdown,
                                 Trajectory, WorkRequest)
from arpo_async.transport import Envelope, Outbox, Undecodable
from arpo_async.validation import InvalidMessage, check_assignment

log = logging.getLogger(__name__)

UNENCODABLE = "the trajectory could not be encoded for the wire"
"""The start of the error of the ENV_ERROR record that replaces a trajectory the codec refused."""


@dataclass
class _Held:
    trajectory: Trajectory
    sent_at: float


class ActorRefused(RuntimeError):
    """The learner refused this actor process (it belongs to another run); the message is the learner's."""


class LearnerLink:
    """Actor-side protocol over one DEALER pump (see the module docstring).

    Args:
        outbox: the outbox of the SocketPump over a DEALER connected to the learner.
        actor_id: this process's id (also the DEALER routing id).
        slots: how many EnvActors share this link (reported in Hello).
        config: heartbeat and resend periods.
        run_id: the run this actor belongs to, sent in Hello and every WorkRequest (a learner of another run
            refuses it with a Shutdown that sets ``refused``); "" = not checked.
    """

    def __init__(self, outbox: Outbox, actor_id: str, slots: int, config: TransportConfig, run_id: str = "") -> None:
        self.outbox = outbox
        self.actor_id = actor_id
        self.run_id = run_id
        self.slots = slots
        self._config = config
        self._ids = itertools.count()
        self._requests: dict[str, asyncio.Future[Assignment]] = {}
        self._requested_at: dict[str, float] = {}
        self.session = secrets.token_urlsafe(16)
        """This process's session (see the module docstring)."""
        self._hello_again = False
        """A Reject said the learner does not know the session: say Hello at the next heartbeat."""
        self._said_hello = False
        self._held: dict[str, _Held] = {}
        self.learner_id: str | None = None
        self.policy_version = 0
        self.shutdown = asyncio.Event()
        self.shutdown_reason = ""
        self.refused = False
        """The learner refused this actor (another run's): ``shutdown_reason`` says why."""
        self.connected = asyncio.Event()
        self._all_acked = asyncio.Event()
        self._all_acked.set()
        self.running = 0
        self.rejects = 0
        self.unencodable = 0
        """Trajectories the codec could not encode (each replaced by an ENV_ERROR record, or dropped)."""
        outbox.on_unencodable = self._unencodable

    @property
    def unacked(self) -> int:
        return len(self._held)

    async def request_work(self) -> Assignment | None:
        """Ask the learner for one rollout and wait for it; None once the learner has said shutdown."""
        if self.shutdown.is_set():
            return None
        request_id = f"{self.actor_id}-r{next(self._ids)}"
        future: asyncio.Future[Assignment] = asyncio.get_running_loop().create_future()
        self._requests[request_id] = future
        stop = asyncio.ensure_future(self.shutdown.wait())
        try:
            await self._send_request(request_id)
            done, _ = await asyncio.wait({future, stop}, return_when=asyncio.FIRST_COMPLETED)
            return future.result() if future in done else None
        finally:
            stop.cancel()
            self._requests.pop(request_id, None)
            self._requested_at.pop(request_id, None)

    async def _send_request(self, request_id: str) -> None:
        """Send (or send again) an open request; a Hello first if none went yet (a request before ``keepalive``)."""
        if not self._said_hello:
            await self._say_hello()
        self._requested_at[request_id] = time.monotonic()
        await self.outbox.send(WorkRequest(request_id, self.actor_id, self.run_id, self.session))

    async def _say_hello(self) -> None:
        """Announce this process, its slots, what it holds and its session."""
        self._hello_again, self._said_hello = False, True
        await self.outbox.send(Hello(self.actor_id, self.slots, list(self._held), self.run_id, self.session))

    async def submit(self, trajectory: Trajectory) -> None:
        """Send a trajectory and hold it until the learner acknowledges it. An empty ``trajectory.session`` is set
        (in place) to this process's session."""
        trajectory.session = trajectory.session or self.session
        self._held[trajectory.trajectory_id] = _Held(trajectory, time.monotonic())
        self._all_acked.clear()
        await self.outbox.send(trajectory)

    def _unencodable(self, message: object, peer: str | None, reason: str) -> None:
        """The outbox's hook for a message the codec refused (see the module docstring)."""
        if not isinstance(message, Trajectory) or message.trajectory_id not in self._held:
            return  # a heartbeat or a request goes again by itself
        if message.error.startswith(UNENCODABLE):  # the stripped record failed too: nothing left to send
            log.error("trajectory %s dropped: even its error record cannot be encoded", message.trajectory_id)
            self._held.pop(message.trajectory_id)
            if not self._held:
                self._all_acked.set()
            return
        self.unencodable += 1
        record = replace(message, outcome=Outcome.ENV_ERROR, score=0.0, format_ok=True, steps=[], screenshots=[],
                         error=f"{UNENCODABLE}: {reason}"[:2000], timings={}, desktop="", grammar="")
        self._held[message.trajectory_id] = _Held(record, time.monotonic())
        try:
            self.outbox.put_nowait((peer, record))
        except asyncio.QueueFull:  # the keepalive re-sends it after resend_after_s
            pass

    async def wait_acked(self, timeout_s: float) -> bool:
        """Wait until every held trajectory is acknowledged; False if ``timeout_s`` passed first."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._all_acked.wait()
            return True
        except TimeoutError:
            return False

    async def serve(self, inbox: asyncio.Queue[Envelope]) -> None:
        """Handle every message of the DEALER pump's ``inbox``, in arrival order, until cancelled. A message
        whose handling raises is logged; the link goes on."""
        while True:
            envelope = await inbox.get()
            try:
                await self.handle(envelope)
            except Exception as error:  # noqa: BLE001 - one message's handler never stops the link
                log.error("handling %s from the learner failed: %s: %s", type(envelope.message).__name__,
                          type(error).__name__, error, exc_info=log.isEnabledFor(logging.DEBUG))

    async def handle(self, envelope: Envelope) -> None:
        """React to one message from the learner (see the module docstring)."""
        message = envelope.message
        if isinstance(message, Undecodable):
            log.warning("bad message from the learner: %s", message.reason)
        elif isinstance(message, Assignment):
            future = self._requests.get(message.request_id)
            try:
                check_assignment(message)
            except InvalidMessage as invalid:  # a learner bug: the request stays open and is re-sent later
                log.error("assignment for request %s dropped: %s", message.request_id, invalid)
                return
            if future is not None and not future.done():
                future.set_result(message)
            else:
                log.warning("assignment for unknown request %s (dropped; the learner re-issues it later)",
                            message.request_id)
        elif isinstance(message, Ack):
            for trajectory_id in message.trajectory_ids:
                self._held.pop(trajectory_id, None)
            if not self._held:
                self._all_acked.set()
        elif isinstance(message, LearnerStatus):
            await self._on_status(message)
        elif isinstance(message, Shutdown):
            self.shutdown_reason, self.refused = message.reason, message.refused
            if message.refused:
                log.error("the learner refuses this actor: %s", message.reason)
            self.shutdown.set()
        elif isinstance(message, Reject):
            self.rejects += 1
            log.warning("learner rejected a message: %s", message.reason)
            self._hello_again |= message.reason.startswith("session:")
        else:
            log.warning("unexpected %s from the learner", type(message).TYPE)

    async def _on_status(self, status: LearnerStatus) -> None:
        restarted = self.learner_id is not None and status.learner_id != self.learner_id
        self.learner_id = status.learner_id
        self.policy_version = status.policy_version
        self.connected.set()
        if restarted:
            log.warning("learner restarted (%s); re-sending %d trajectories and %d requests",
                        status.learner_id, len(self._held), len(self._requests))
            await self._say_hello()
            for held in self._held.values():
                held.sent_at = time.monotonic()
                await self.outbox.send(held.trajectory)
            for request_id, future in list(self._requests.items()):
                if not future.done():
                    await self._send_request(request_id)

    async def keepalive(self) -> None:
        """Hello, then heartbeats every ``heartbeat_s``; re-sends trajectories unacked for ``resend_after_s``."""
        if not self._said_hello:
            await self._say_hello()
        while True:
            await asyncio.sleep(self._config.heartbeat_s)
            if self._hello_again:
                await self._say_hello()
            waiting = sum(not f.done() for f in self._requests.values())
            await self.outbox.send(Heartbeat(self.actor_id, self.running, waiting, len(self._held),
                                             self.outbox.qsize()))
            now = time.monotonic()
            for held in list(self._held.values()):
                if now - held.sent_at > self._config.resend_after_s:
                    held.sent_at = now
                    await self.outbox.send(held.trajectory)
            for request_id, sent_at in list(self._requested_at.items()):
                if now - sent_at > self._config.resend_after_s:  # the answer may have been dropped on the way
                    await self._send_request(request_id)
