"""Sessions: who owns a rollout, by something a peer cannot copy.

Role: the learner's book of the sessions its peers opened. A ZeroMQ routing id is picked by each peer itself, so a
peer can reuse an honest actor's id (ROUTER_HANDOVER then even gives it the route). Ownership of a waiting request or
a running rollout is therefore tied to a session: a secret of at least 128 random bits that the actor process draws
and sends in its Hello (arpo_async.messages.Hello.session), which the learner never sends back, bound to the routing
id that said Hello and, where CURVE is on, to the public key ZeroMQ's ZAP handler authenticated
(arpo_async.transport.Envelope.key). Every WorkRequest and Trajectory names its session; one that does not match is
refused (reason ``session``, or ``owner`` for a trajectory whose slot belongs to another session or that comes from
another routing id or key than the session's: learner.rollouts.peers.Peers.receive). Without CURVE the secret and
the routing id (with its random part, arpo_async.transport) travel in clear: a peer that can read the traffic can
copy both, take the route (ROUTER_HANDOVER) and act for the actor (turn CURVE on beyond one machine).

Bounds: at most SESSIONS_PER_PEER sessions per routing id. A further Hello evicts that id's least recently used
session that has nothing waiting or running (an actor that restarted leaves such sessions behind); when every one of
them still has work, the Hello is refused (reason ``session``), so a peer that copies an honest actor's routing id
and says Hello again and again can never evict a session that owns work.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from arpo_async.validation import InvalidMessage

SESSIONS_PER_PEER = 8
"""Sessions one routing id may hold at once (each Hello issues one)."""

MIN_SESSION_CHARS = 22
"""The shortest session accepted: 128 random bits in URL-safe base64 (``secrets.token_urlsafe(16)``)."""


@dataclass
class Session:
    """What a session is bound to, and its load.

    Attributes:
        peer: the routing id whose Hello it answered.
        key: the CURVE public key (Z85) of that Hello's connection; "" without CURVE.
        outstanding: its requests waiting plus its rollouts running.
    """

    peer: str
    key: str
    outstanding: int = 0


class SessionBook:
    """The sessions peers opened with this learner (see the module docstring). O(1) per message,
    O(SESSIONS_PER_PEER) per Hello."""

    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}
        self._by_peer: dict[str, collections.OrderedDict[str, None]] = {}
        """Routing id -> its sessions, least recently used first."""

    def open(self, session: str, peer: str, key: str = "") -> None:
        """Open ``session`` for routing id ``peer`` (CURVE key ``key``), as its Hello asked; a Hello again of a
        session this peer opened before only marks it used.

        Raises:
            InvalidMessage: reason "session": ``session`` is shorter than MIN_SESSION_CHARS, is another peer's (or
                another key's), or ``peer`` already holds SESSIONS_PER_PEER sessions and each still has work waiting
                or running.
        """
        found = self.sessions.get(session)
        if found is not None:
            self.check(session, peer, key)  # the same peer saying Hello again (a learner restart it missed)
            return
        if len(session) < MIN_SESSION_CHARS:
            raise InvalidMessage("session", f"{peer}'s Hello names a session of {len(session)} characters; draw one "
                                            f"of at least {MIN_SESSION_CHARS} (secrets.token_urlsafe(16))")
        mine = self._by_peer.setdefault(peer, collections.OrderedDict())
        if len(mine) >= SESSIONS_PER_PEER:
            idle = next((s for s in mine if self.sessions[s].outstanding == 0), None)
            if idle is None:
                raise InvalidMessage("session", f"{peer} already holds {SESSIONS_PER_PEER} sessions, each with work "
                                                "waiting or running; no new one until one of them is idle")
            del mine[idle], self.sessions[idle]
        self.sessions[session] = Session(peer, key)
        mine[session] = None  # the most recently used last

    def check(self, session: str, peer: str, key: str = "") -> Session:
        """The session a request of ``peer`` (CURVE key ``key``) names, marked as used.

        Raises:
            InvalidMessage: reason "session": ``peer`` (with ``key``) did not open ``session`` with this learner, or
                it was forgotten (an actor then says Hello again).
        """
        found = self.sessions.get(session)
        if found is None or found.peer != peer or found.key != key:
            raise InvalidMessage("session", f"{peer} names a session it did not open with this learner (or that was "
                                            "forgotten); say Hello with it first")
        self._by_peer[peer].move_to_end(session)  # eviction takes the least recently used first
        return found

    def latest(self, peer: str) -> str:
        """The session of ``peer`` most recently issued or used ("" when it holds none)."""
        mine = self._by_peer.get(peer)
        return next(reversed(mine)) if mine else ""

    def add(self, session: str, count: int = 1) -> None:
        """``count`` more requests or rollouts of ``session`` (negative: fewer); a forgotten session is skipped."""
        found = self.sessions.get(session)
        if found is not None:
            found.outstanding = max(0, found.outstanding + count)

    def forget_peer(self, peer: str) -> None:
        """Drop every session of ``peer`` that has no work left (a silent peer's, after its work was taken back)."""
        mine = self._by_peer.get(peer, {})
        for token in [t for t in mine if self.sessions[t].outstanding == 0]:
            del mine[token], self.sessions[token]
        if not mine:
            self._by_peer.pop(peer, None)
