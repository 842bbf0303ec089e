"""ZeroMQ transport: the learner's ROUTER and the actors' DEALER, each owned by exactly one task.

Role: move messages between a socket and two bounded queues that the process's wiring function creates.
A `SocketPump` owns one socket: it sleeps on one future that the socket's ZeroMQ descriptor (a reader on the event
loop), a put on its `Outbox` or room in its inbox resolves; it receives without blocking, decodes with the codec and
puts each message on its bounded inbox as an `Envelope`, in bursts of at most `RECEIVE_BURST` messages after each of
which the consumer runs and its replies are sent; it sends what any task put on its `Outbox`. The pump
never runs a consumer's code: one task (the learner's LearnerService, the actors' LearnerLink) consumes the inbox
and replies through the outbox, so a burst of incoming messages that produces more replies than the outbox holds
only makes that consumer wait while the pump keeps sending.

Invariants: the pump never blocks on a full inbox (it stops receiving, which leaves messages to ZeroMQ's
high-water mark, and keeps sending); a message that fails to decode is counted by reason in ``rejected`` and goes
to the inbox as an `Undecodable`, never stopping the pump; a queued message that fails to encode is counted by type
in ``unencodable``, logged, handed to the outbox's ``on_unencodable`` (the actors' LearnerLink replaces a
trajectory by an error record of it) and not sent, never stopping the pump either; a full outbox makes its sender
wait (backpressure) and is counted in ``Outbox.full_waits``, never dropped. Sockets are made with explicit high-water marks and linger 0.

Addressing: an actor process sets its ZeroMQ routing id to its actor id, ``#`` and 96 random bits (drawn once per
process), so the learner addresses it by that id and a reconnecting actor keeps its address (ROUTER_HANDOVER). The
random part matters: with ROUTER_HANDOVER a routing id goes to whoever connects with it last, and the old connection
is cut off for good, so a peer that could guess another's id could take its route. :func:`peer_name` is the id
without it, for messages to people.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from arpo_async import codec
from arpo_async.config import TransportConfig

log = logging.getLogger(__name__)

ROUTE_MARK = "#"
"""Separates an actor id from the random part of its routing id (see Addressing above)."""

OUTBOX_SIZE = 1024
"""Bounded outbox per socket: producers wait (backpressure) when it is full."""

INBOX_SIZE = 1024
"""Bounded inbox per socket: the pump stops receiving while it is full (ZeroMQ's high-water mark holds the rest)."""

RECEIVE_BURST = 64
"""Most messages the pump receives in one go before the consumer handles them and their replies go out: one
event-loop round trip per burst instead of per message (and the learner acks a burst with one Ack), at the cost of
replies to the burst's first message waiting for the rest of the burst (a few ms for 64 trajectories)."""


class TransportSecurityError(RuntimeError):
    """A CURVE certificate or the authorized-keys folder is missing or unreadable (names the config key)."""


def _certificate(path: str, key: str, *, secret: bool) -> tuple[bytes, bytes | None]:
    """(public key, secret key or None) from a certificate file written by `arpo keys` (zmq.auth)."""
    import zmq.auth

    if not path:
        raise TransportSecurityError(f"{key} must name a certificate file from `arpo keys`")
    try:
        public, private = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as error:
        raise TransportSecurityError(f"{key} = {path!r}: cannot read the certificate ({error})") from error
    if secret and not private:
        raise TransportSecurityError(f"{key} = {path!r} holds no secret key (use the .key_secret file)")
    return public, private


def start_authenticator(ctx: zmq.asyncio.Context, config: TransportConfig):
    """With CURVE on (``transport.curve_secret_key_file``), start ZeroMQ's ZAP handler for ``ctx`` accepting only
    the public certificates in ``transport.curve_authorized_dir``; returns it (``.stop()`` it when done), or None
    without CURVE. Call before :func:`router_socket`, inside the running event loop.

    Raises:
        TransportSecurityError: CURVE on but no readable authorized-keys folder.
    """
    if not config.curve_secret_key_file:
        return None
    from zmq.auth.asyncio import AsyncioAuthenticator

    folder = Path(config.curve_authorized_dir) if config.curve_authorized_dir else None
    if folder is None or not folder.is_dir() or not any(folder.glob("*.key")):
        raise TransportSecurityError("transport.curve_authorized_dir must name a folder holding the public "
                                     "certificates (*.key) of the actor hosts allowed to connect")
    auth = AsyncioAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(folder))
    return auth


def exposure_warning(config: TransportConfig) -> str | None:
    """The warning to log when the learner binds beyond this machine without CURVE."""
    host = config.endpoint.split("://", 1)[-1].rsplit(":", 1)[0]
    if config.curve_secret_key_file or host in ("127.0.0.1", "localhost", "[::1]") or config.endpoint.startswith(
            ("ipc://", "inproc://")):
        return None
    return (f"the learner binds {config.endpoint} without CURVE: anyone who can reach this port can submit "
            "trajectories; set transport.curve_secret_key_file and transport.curve_authorized_dir (`arpo keys`)")


def router_socket(ctx: zmq.asyncio.Context, config: TransportConfig, bind_wait_s: float = 5.0) -> zmq.asyncio.Socket:
    """A bound ROUTER for the learner.

    A restarted learner may find its port still held for a moment by the socket it replaces (ZeroMQ releases
    it asynchronously), so "address in use" is retried for up to ``bind_wait_s`` seconds.

    Raises:
        zmq.ZMQError: the endpoint cannot be bound (still in use after ``bind_wait_s``, bad address).
    """
    sock = ctx.socket(zmq.ROUTER)
    _set_common(sock, config)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    if config.curve_secret_key_file:  # peers are checked by start_authenticator's ZAP handler
        public, secret = _certificate(config.curve_secret_key_file, "transport.curve_secret_key_file", secret=True)
        sock.curve_publickey, sock.curve_secretkey, sock.curve_server = public, secret, True
    deadline = time.monotonic() + bind_wait_s
    while True:
        try:
            sock.bind(config.endpoint)
            if sock.getsockopt(zmq.LAST_ENDPOINT).decode() != config.endpoint:  # port 0 or *: the kernel's pick
                log.info("the learner listens on %s", sock.getsockopt(zmq.LAST_ENDPOINT).decode())
            return sock
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                sock.close(linger=0)
                raise
            time.sleep(0.05)


@contextlib.contextmanager
def learner_socket(config: TransportConfig) -> Iterator[zmq.asyncio.Socket]:
    """The learner's bound ROUTER (:func:`router_socket`) in a ZeroMQ context of its own, with CURVE's
    authenticator running when configured (:func:`start_authenticator`) and the :func:`exposure_warning` logged;
    on exit the authenticator stops and the context is destroyed with linger 0. Enter it inside the running
    event loop.

    Raises:
        TransportSecurityError: CURVE on but a certificate or the authorized-keys folder is unreadable.
        zmq.ZMQError: the endpoint cannot be bound.
    """
    ctx = zmq.asyncio.Context()
    authenticator = None
    try:
        authenticator = start_authenticator(ctx, config)
        if warning := exposure_warning(config):
            log.warning("%s", warning)
        yield router_socket(ctx, config)
    finally:
        if authenticator is not None:
            authenticator.stop()
        ctx.destroy(linger=0)


def dealer_socket(ctx: zmq.asyncio.Context, config: TransportConfig, identity: str) -> zmq.asyncio.Socket:
    """A DEALER for an actor process, connected to the learner, with routing id ``identity``, ``#`` and 96 random
    bits (see Addressing in the module docstring); ZeroMQ reconnects by itself. With
    ``transport.curve_secret_key_file`` it authenticates with that certificate and encrypts (CURVE), trusting
    only the learner's public certificate ``transport.curve_server_key_file``.

    Raises:
        TransportSecurityError: a certificate file is missing or unreadable.
        ValueError: ``transport.endpoint`` has port 0 or * (a learner's "a free one": not a port to connect to).
    """
    if config.endpoint.startswith("tcp://") and config.endpoint.rpartition(":")[2] in ("0", "*"):
        raise ValueError(f"transport.endpoint = {config.endpoint!r}: port 0 means a free one for the learner to "
                         "bind; actors need the port it listens on (its log says; `arpo run` writes it into "
                         "<run>/config.toml)")
    sock = ctx.socket(zmq.DEALER)
    _set_common(sock, config)
    if config.curve_secret_key_file:
        public, secret = _certificate(config.curve_secret_key_file, "transport.curve_secret_key_file", secret=True)
        server, _ = _certificate(config.curve_server_key_file, "transport.curve_server_key_file", secret=False)
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server
    sock.setsockopt(zmq.ROUTING_ID, f"{identity}{ROUTE_MARK}{secrets.token_urlsafe(12)}".encode())
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
    sock.connect(config.endpoint)
    return sock


def peer_name(routing_id: str) -> str:
    """A routing id without the random part :func:`dealer_socket` adds (the actor id), for messages to people."""
    return routing_id.partition(ROUTE_MARK)[0]


def _set_common(sock: zmq.asyncio.Socket, config: TransportConfig) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, config.high_water_mark)
    sock.setsockopt(zmq.RCVHWM, config.high_water_mark)
    sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)


def _user_id(frame: zmq.Frame) -> str:
    """The ZAP user id of a received ``frame`` (pyzmq's Authenticator gives a CURVE peer's Z85 public key), or ""
    when ZAP set none."""
    try:
        return frame.get("User-Id") or ""
    except zmq.ZMQError:
        return ""


@dataclass
class Envelope:
    """A decoded message and, on a ROUTER, the routing id of the peer that sent it (else None).

    ``key`` is the sender's CURVE public key (Z85, 40 characters) as ZeroMQ's ZAP handler authenticated it, on a
    ROUTER with CURVE on; "" otherwise. Unlike the routing id, which each peer picks itself, a peer cannot claim
    another's key without its secret certificate."""

    message: Any
    peer: str | None
    key: str = ""


@dataclass(frozen=True)
class Undecodable:
    """Stands in an inbox `Envelope` for a message that failed to decode: ``reason`` is the codec's error."""

    reason: str


class Outbox(asyncio.Queue):
    """The bounded queue of ``(peer, message)`` one SocketPump sends, in order. Any task may :meth:`send`; only
    the pump takes.

    Args:
        routed: True for a ROUTER's outbox (every message needs a peer routing id).
        size: capacity in messages.
    """

    def __init__(self, *, routed: bool, size: int = OUTBOX_SIZE) -> None:
        super().__init__(size)
        self.routed = routed
        self.full_waits = 0
        """Sends that found the outbox full and had to wait (metrics ``queues.outbox_full_waits``)."""
        self.listener: Callable[[], None] | None = None
        """Called after each message is queued (the running `SocketPump` sets it to wake itself)."""
        self.on_unencodable: Callable[[Any, str | None, str], None] | None = None
        """Called by the pump with ``(message, peer, reason)`` for a queued message the codec could not encode
        (it is not sent); the sender may queue a replacement. An exception it raises is logged."""

    def put_nowait(self, item: Any) -> None:
        """Queue ``item`` (``put`` comes here too) and tell the listener. Raises asyncio.QueueFull when full."""
        super().put_nowait(item)
        if self.listener is not None:
            self.listener()

    async def send(self, message: Any, peer: str | None = None) -> None:
        """Queue ``message`` for ``peer`` (None on a DEALER); waits while the outbox is full.

        Raises:
            ValueError: a ROUTER message without a peer.
        """
        if self.routed and peer is None:
            raise ValueError("a ROUTER message needs a peer routing id")
        if self.full():
            self.full_waits += 1
        await self.put((peer, message))

    async def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything queued so far has been handed to ZeroMQ; False if ``timeout_s`` passed first."""
        try:
            async with asyncio.timeout(timeout_s):
                await self.join()
            return True
        except TimeoutError:
            return False


class SocketPump:
    """Owns one ROUTER or DEALER socket: receive -> decode -> inbox; outbox -> encode -> send.

    Args:
        sock: the socket; the pump closes it when `run` ends.
        inbox: where each received message goes, as an `Envelope` (an `Undecodable` one where decoding failed).
        outbox: what the pump sends; its ``routed`` must match the socket (True for a ROUTER, whose frames carry
            the peer's routing id first).
        max_bytes: largest message accepted; larger or malformed ones arrive as `Undecodable`.
    """

    def __init__(self, sock: zmq.asyncio.Socket, *, inbox: asyncio.Queue[Envelope], outbox: Outbox,
                 max_bytes: int) -> None:
        self._sock = sock
        self._shadow = zmq.Socket.shadow(sock.underlying)
        """The same socket without asyncio's futures, for the calls that never wait (NOBLOCK)."""
        self._routed = outbox.routed
        self._curve = bool(sock.getsockopt(zmq.CURVE_SERVER))
        """A CURVE server: each message carries the key ZAP authenticated (`Envelope.key`)."""
        self._max_bytes = max_bytes
        self.inbox = inbox
        self.outbox = outbox
        self.received = 0
        self.sent = 0
        self.received_types: collections.Counter[str] = collections.Counter()
        """Messages decoded, by message type (``Hello.TYPE`` ...); see :meth:`message_counts`."""
        self.sent_types: collections.Counter[str] = collections.Counter()
        """Messages handed to ZeroMQ, by message type."""
        self.rejected: collections.Counter[str] = collections.Counter()
        """Messages that failed to decode, by the codec's reason."""
        self.unencodable: collections.Counter[str] = collections.Counter()
        """Queued messages that failed to encode (not sent), by message type."""
        self._blocked: asyncio.Future | None = None  # the pending inbox.put() while the inbox is full
        self._wakeup: asyncio.Future | None = None  # what `run` waits on (see `_wait`)

    async def run(self) -> None:
        """Pump until cancelled; closes the socket on the way out.

        One wake-up future at a time, resolved by whichever comes first: the socket's ZeroMQ file descriptor
        (a reader on the event loop), a message put on the outbox, or room in a full inbox. No task and no
        pyzmq future per message: each costs tens of microseconds, paid once per trajectory on each side."""
        loop = asyncio.get_running_loop()
        fd = self._shadow.get(zmq.FD)
        loop.add_reader(fd, self._on_socket_event)
        self.outbox.listener = self._wake
        try:
            while True:
                await self._send_queued()
                if self._blocked is not None and self._blocked.done():
                    self._blocked.result()
                    self._blocked = None
                # checked before every wait: a send may have taken ZeroMQ's wake-up for messages already waiting
                if self._blocked is None and self._readable():
                    await self._drain_incoming()
                    continue
                if self.outbox.empty():
                    await self._wait()
        finally:
            loop.remove_reader(fd)
            self.outbox.listener = None
            if self._blocked is not None:
                self._blocked.cancel()
                self._blocked = None
            self._sock.close(linger=0)

    async def _wait(self) -> None:
        """Sleep until the socket's descriptor fires, the outbox gets a message or a blocked inbox put ends."""
        self._wakeup = asyncio.get_running_loop().create_future()
        try:
            await self._wakeup
        finally:
            self._wakeup = None

    def _wake(self, *_: Any) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    def _on_socket_event(self) -> None:
        """The descriptor fired: reading EVENTS consumes ZeroMQ's signal (so a level-triggered reader does not fire
        again for it while the pump is busy or its inbox is full), then the pump wakes to look."""
        self._shadow.get(zmq.EVENTS)
        self._wake()

    async def _drain_incoming(self) -> None:
        """Receive while the socket has messages and the inbox has room (else leave one put pending), in bursts of
        at most `RECEIVE_BURST`: after each burst the consumer handles it and its replies are sent."""
        while self._blocked is None and self._readable():
            for _ in range(RECEIVE_BURST):
                # copy=False: no copy of the frames into new bytes objects (~1 ms per 2.9 MB trajectory); the codec
                # decodes from the frames' buffers and a large bytes field (a screenshot) stays a view of its frame
                envelope = self._envelope(self._shadow.recv_multipart(zmq.NOBLOCK, copy=False))
                try:
                    self.inbox.put_nowait(envelope)
                except asyncio.QueueFull:
                    self._blocked = asyncio.ensure_future(self.inbox.put(envelope))
                    self._blocked.add_done_callback(self._wake)
                    break
                if not self._readable():
                    break
            await asyncio.sleep(0)  # the consumer takes the burst now (its wake-up was queued first) ...
            await self._send_queued()  # ... and its replies go out before the next receive

    def _readable(self) -> bool:
        """True when a whole message waits on the socket (reading EVENTS also re-arms ZeroMQ's edge-triggered fd)."""
        return bool(self._shadow.get(zmq.EVENTS) & zmq.POLLIN)

    def _envelope(self, frames: list[zmq.Frame]) -> Envelope:
        """The received ``frames`` decoded into an `Envelope` (an `Undecodable` one, counted, where that fails)."""
        buffers = [frame.buffer for frame in frames]
        peer, key = None, ""
        if self._routed:
            peer = bytes(buffers[0]).decode("latin-1")  # routing ids are bytes; latin-1 round-trips any of them
            key = _user_id(frames[-1]) if self._curve else ""
            buffers = buffers[1:]
        try:
            message = codec.decode(buffers, max_bytes=self._max_bytes)
        except codec.WireError as e:
            self.rejected[str(e).split(":")[0]] += 1
            return Envelope(Undecodable(str(e)), peer, key)
        self.received += 1
        self.received_types[message.TYPE] += 1
        return Envelope(message, peer, key)

    async def _send_queued(self) -> None:
        """Send everything waiting in the outbox, in order (without waiting for more)."""
        outbox = self.outbox
        while not outbox.empty():
            peer, message = outbox.get_nowait()
            try:
                await self._send_now(peer, message)
            except codec.WireError as e:  # this message only: the pump and every other message go on
                self._unencodable(peer, message, str(e))
            finally:
                outbox.task_done()

    def _unencodable(self, peer: str | None, message: Any, reason: str) -> None:
        kind = getattr(message, "TYPE", type(message).__name__)
        self.unencodable[kind] += 1
        log.error("a %s message for %s could not be encoded and was not sent: %s", kind, peer or "the learner",
                  reason)
        if self.outbox.on_unencodable is not None:
            try:
                self.outbox.on_unencodable(message, peer, reason)
            except Exception:  # noqa: BLE001 - the sender's hook must not stop the pump
                log.exception("the outbox's on_unencodable hook failed")

    async def _send_now(self, peer: str | None, message: Any) -> None:
        frames = codec.encode(message)
        if self._routed:
            frames = [peer.encode("latin-1"), *frames]
        while True:  # at once when ZeroMQ has room; else wait for room (a DEALER at its high-water mark)
            try:
                self._shadow.send_multipart(frames, zmq.NOBLOCK, copy=False)
                break
            except zmq.Again:
                if not self._shadow.get(zmq.EVENTS) & zmq.POLLOUT:
                    await self._wait()
        self.sent += 1
        self.sent_types[type(message).TYPE] += 1

    def message_counts(self) -> dict[str, dict[str, int]]:
        """``{"received": {type: n}, "sent": {type: n}}``: messages this pump decoded and handed to ZeroMQ so far,
        by message type (an undecodable message is counted only in ``rejected``). Comparing one end's ``sent``
        with the other end's ``received`` shows whether the wire lost any (bench/bench_hosts.py)."""
        return {"received": dict(self.received_types), "sent": dict(self.sent_types)}
