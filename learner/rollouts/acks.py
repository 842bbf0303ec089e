"""Acknowledgements and fingerprints: how the learner tells an actor it holds a trajectory, and how it knows a
re-send from another trajectory that reuses its id.

Role: the learner service's (learner.rollouts.service) bookkeeping for received trajectories. :class:`HeldAcks`
holds the Acks of a burst of messages back and sends one Ack per peer at its end (fewer messages, fewer wake-ups of
the actors' pumps); :func:`fingerprint` is what de-duplication compares.

Invariant: an Ack goes out only for a trajectory the learner holds; held Acks go out before any Reject or
shutdown the service sends afterwards, so an actor sees a trajectory's Ack first.
"""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np

from arpo_async.messages import Ack, Trajectory
from arpo_async.transport import Outbox
from learner.state import RunState

ACK_BATCH = 64
"""Most trajectory ids held back for one Ack; then the held Acks go out at once."""
ACK_DELAY_S = 0.01
"""How long the Acks of trajectories that arrived one at a time wait for more, so that one Ack message (and one
wake-up of the actor's pump) covers several trajectories; an actor re-sends only after ``resend_after_s`` (30 s)."""


def fingerprint(traj: Trajectory) -> bytes:
    """A 16-byte fingerprint of what a trajectory says: its slot, outcome, score, and each step's sampled ids,
    versions, log-probs (their packed bytes, all steps' joined per field; the per-step lengths in the summary keep
    the step boundaries) and prompt length, and its screenshots' lengths (tells a re-send from another trajectory
    reusing its id; the prompt ids and screenshot bytes are left out, which keeps it ~50x cheaper than encoding)."""
    steps = traj.steps
    summary = (traj.actor_id, traj.task_id, traj.group_id, traj.rollout_index, str(traj.outcome), traj.score,
               traj.format_ok, traj.assigned_version, [len(shot) for shot in traj.screenshots],
               [(len(s.prompt_ids), s.image_indices, len(s.output_ids)) for s in steps])
    digest = hashlib.blake2b(repr(summary).encode(), digest_size=16)
    if steps:
        for values in (np.concatenate([s.output_ids for s in steps]), np.concatenate([s.versions for s in steps]),
                       np.concatenate([s.logprobs for s in steps])):
            digest.update(values.dtype.str.encode())
            digest.update(values)  # a fresh contiguous array
    return digest.digest()


class HeldAcks:
    """The Acks of trajectories received in the current burst of messages, by peer, until they go out.

    Args:
        outbox: where the Acks go (the ROUTER pump's outbox).
        state: the run's state: ``state.totals["acked"]`` counts the trajectory ids acknowledged.
        delay_s: how long the Acks held at the end of a burst wait for more trajectories (0: sent at the burst's
            end).
    """

    def __init__(self, outbox: Outbox, state: RunState, delay_s: float = ACK_DELAY_S) -> None:
        self.outbox = outbox
        self.state = state
        self.delay_s = delay_s
        self._by_peer: dict[str, list[str]] = {}
        self.held = 0
        """Trajectory ids held back now."""
        self._flush: asyncio.Task | None = None
        """The pending delayed send (:meth:`settle`)."""

    def receive(self, peer: str, traj: Trajectory, *, valid: bool) -> bytes | None:
        """Acknowledge ``traj`` to ``peer`` with the others of this burst (the learner holds it now, whatever
        becomes of it); returns its :func:`fingerprint` when it is ``valid``, else None (a flood of invalid
        trajectories costs no fingerprint)."""
        self._by_peer.setdefault(peer, []).append(traj.trajectory_id)
        self.held += 1
        return fingerprint(traj) if valid else None

    async def settle(self, more: bool) -> None:
        """After one message: with `ACK_BATCH` ids held, or at the end of a burst (``more`` False) with
        ``delay_s`` 0, send them now; at the end of a burst otherwise, send them ``delay_s`` from now (unless a
        send comes first)."""
        if self.held >= ACK_BATCH or (not more and self.delay_s <= 0):
            await self.send()
        elif not more and self.held and self._flush is None:
            self._flush = asyncio.create_task(self._send_later())

    async def _send_later(self) -> None:
        """Send the held Acks after ``delay_s`` (those sent earlier by a full batch or a Reject are gone)."""
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            if self._flush is asyncio.current_task():  # (not a newer one, after `send` cancelled this)
                self._flush = None
        await self.send()

    async def send(self) -> None:
        """Send every held Ack now: one per peer, its trajectory ids in arrival order (counted in
        ``totals["acked"]``)."""
        by_peer, self._by_peer, self.held = self._by_peer, {}, 0
        self.cancel()  # sent now: the delayed send has nothing left to do
        for peer, trajectory_ids in by_peer.items():
            self.state.totals["acked"] += len(trajectory_ids)
            await self.outbox.send(Ack(trajectory_ids), peer)

    def cancel(self) -> None:
        """Drop the pending delayed send (the held ids stay held)."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
