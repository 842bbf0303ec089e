"""SocketPump under a burst, over real ZeroMQ TCP sockets on 127.0.0.1: when one receive burst brings more
messages than the inbox and the outbox hold and the consumer replies to each, every reply still goes out, in order
(a consumer waiting for outbox room while the pump waits for inbox room would deadlock them)."""

import asyncio
import time

import zmq
import zmq.asyncio

from arpo_async import codec
from arpo_async.config import TransportConfig
from arpo_async.messages import Ack, Heartbeat, LearnerStatus, Reject, Trajectory
from arpo_async.transport import INBOX_SIZE, OUTBOX_SIZE, Outbox, SocketPump, dealer_socket, router_socket
from tests.support import cancelled, free_port, until


async def test_replies_to_a_burst_larger_than_the_outbox_all_go_out_in_order():
    burst = 3 * max(OUTBOX_SIZE, INBOX_SIZE)
    config = TransportConfig(endpoint=f"tcp://127.0.0.1:{free_port()}", high_water_mark=4 * burst)
    ctx = zmq.asyncio.Context()
    inbox, outbox = asyncio.Queue(INBOX_SIZE), Outbox(routed=True)

    async def reply() -> None:
        while True:
            envelope = await inbox.get()
            await outbox.send(LearnerStatus(envelope.message.actor_id, 0), envelope.peer)

    pump = SocketPump(router_socket(ctx, config), inbox=inbox, outbox=outbox, max_bytes=config.max_message_bytes)
    actor = ctx.socket(zmq.DEALER)
    for option in (zmq.LINGER, 0), (zmq.SNDHWM, 4 * burst), (zmq.RCVHWM, 4 * burst):
        actor.setsockopt(*option)
    actor.connect(config.endpoint)
    try:
        for i in range(burst):  # all queued at the ROUTER before the pump starts: one burst
            await actor.send_multipart(codec.encode(Heartbeat(f"a{i}", 0, 0, 0)))
        await until(lambda: pump._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN, 60, "the burst queued at the ROUTER",
                    every_s=0.01)
        tasks = [asyncio.create_task(pump.run()), asyncio.create_task(reply())]
        try:
            async with asyncio.timeout(60):
                replies = [codec.decode(await actor.recv_multipart(), max_bytes=1 << 20) for _ in range(burst)]
        finally:
            await cancelled(tasks)
        assert [r.learner_id for r in replies] == [f"a{i}" for i in range(burst)]
        assert pump.received == burst and pump.sent == burst
    finally:
        actor.close(0)
        ctx.destroy(linger=0)



def actor_pump_and_learner(ctx: zmq.asyncio.Context, **config_fields) -> tuple[TransportConfig, zmq.asyncio.Socket,
                                                                               SocketPump]:
    """A learner's ROUTER socket and an actor's DEALER pump (peer "a0", unrouted outbox) on a fresh port."""
    config = TransportConfig(endpoint=f"tcp://127.0.0.1:{free_port()}", **config_fields)
    learner = router_socket(ctx, config)
    pump = SocketPump(dealer_socket(ctx, config, "a0"), inbox=asyncio.Queue(INBOX_SIZE), outbox=Outbox(routed=False),
                      max_bytes=config.max_message_bytes)
    return config, learner, pump


async def test_replies_arriving_while_the_pump_sends_are_all_received():
    """The pump sends a burst without waiting (NOBLOCK) while the peer's replies stream in: every reply is received,
    in order. (The stall this path once had is pinned down by the next test.)"""
    rounds, burst = 10, 60
    ctx = zmq.asyncio.Context()
    config, learner, pump = actor_pump_and_learner(ctx)
    inbox, outbox = pump.inbox, pump.outbox
    shot = bytes(range(256)) * 2048  # 512 KB: each send takes long enough for replies to arrive meanwhile

    async def echo() -> None:  # the peer acks every trajectory at once
        while True:
            peer, *frames = await learner.recv_multipart(copy=False)
            trajectory = codec.decode([frame.buffer for frame in frames], max_bytes=config.max_message_bytes)
            await learner.send_multipart([peer, *codec.encode(Ack([trajectory.trajectory_id]))])

    tasks = [asyncio.create_task(pump.run()), asyncio.create_task(echo())]
    try:
        for r in range(rounds):
            ids = [f"t{r}-{i}" for i in range(burst)]
            for trajectory_id in ids:  # queued at once: the pump sends them in one go
                await outbox.send(Trajectory(trajectory_id, "a0", "task", "g", 0, "FAILURE", 0.0, True, [],
                                             [shot, shot]))
            async with asyncio.timeout(30):
                acked = [(await inbox.get()).message.trajectory_ids[0] for _ in ids]
            assert acked == ids, f"round {r}"
    finally:
        await cancelled(tasks)
        learner.close(0)
        ctx.destroy(linger=0)


async def test_a_message_whose_wake_up_was_taken_is_received_after_the_next_send():
    """ZeroMQ signals its file descriptor once for messages that arrive; whoever next reads the socket's EVENTS takes
    that signal (a send does too). A pump already waiting on the descriptor would then sleep with a message in its
    socket, so it looks for waiting messages before every wait: here the signal is taken while the pump waits, and
    the message must be received once the pump's next send wakes it."""
    ctx = zmq.asyncio.Context()
    config, learner, pump = actor_pump_and_learner(ctx)
    inbox, outbox = pump.inbox, pump.outbox
    task = asyncio.create_task(pump.run())
    try:
        await outbox.send(Heartbeat("a0", 0, 0, 0))
        peer, _ = await asyncio.wait_for(learner.recv_multipart(), 10)  # the pump has sent it and waits again
        await learner.send_multipart([peer, *codec.encode(LearnerStatus("l", 3))])
        # take the signal without yielding to the event loop: block until the message is in the pump's socket
        assert zmq.Socket.shadow(pump._sock.underlying).poll(10_000, zmq.POLLIN)
        await outbox.send(Heartbeat("a0", 0, 0, 0))  # wakes the pump: it sends, then must find the message
        envelope = await asyncio.wait_for(inbox.get(), 10)
        assert envelope.message == LearnerStatus("l", 3)
        await asyncio.wait_for(learner.recv_multipart(), 10)
    finally:
        await cancelled([task])
        learner.close(0)
        ctx.destroy(linger=0)


async def test_a_dealer_at_its_high_water_mark_waits_for_room_then_sends_everything_in_order():
    """Sends that find ZeroMQ full (the learner not reading) wait for room, woken by the socket's descriptor; nothing
    is dropped or reordered, and the pump still takes new messages from its outbox meanwhile."""
    ctx = zmq.asyncio.Context()
    _, learner, pump = actor_pump_and_learner(ctx, high_water_mark=2)
    learner.setsockopt(zmq.RCVHWM, 2)
    messages = [Reject(f"{i}:" + "x" * 1_000_000) for i in range(40)]  # 40 MB: more than the TCP buffers hold
    task = asyncio.create_task(pump.run())
    try:
        for message in messages:
            await pump.outbox.send(message)
        # the pump waits only with an empty outbox, or in a send that found no room: so this is the second
        await until(lambda: pump._wakeup is not None and not pump.outbox.empty(), 30,
                    "the pump waiting for room at the high-water mark", every_s=0.01)
        assert pump.sent < len(messages)
        async with asyncio.timeout(60):
            received = [codec.decode((await learner.recv_multipart())[1:], max_bytes=1 << 24) for _ in messages]
            await pump.outbox.join()
        assert received == messages and pump.sent == len(messages)
    finally:
        await cancelled([task])
        learner.close(0)
        ctx.destroy(linger=0)


async def test_a_pump_whose_inbox_is_full_sleeps_until_the_consumer_takes_a_message():
    """With the inbox full the pump leaves messages to ZeroMQ; the socket's descriptor keeps signalling that more
    wait, and the pump must not spin on it (it reads ZeroMQ's events to clear the signal, then sleeps)."""
    ctx = zmq.asyncio.Context()
    config, learner, _ = actor_pump_and_learner(ctx)
    learner.close(0)
    inbox = asyncio.Queue(2)
    pump = SocketPump(router_socket(ctx, config), inbox=inbox, outbox=Outbox(routed=True),
                      max_bytes=config.max_message_bytes)
    actor = ctx.socket(zmq.DEALER)
    actor.setsockopt(zmq.LINGER, 0)
    actor.connect(config.endpoint)
    task = asyncio.create_task(pump.run())
    try:
        for i in range(10):
            await actor.send_multipart(codec.encode(Heartbeat(f"a{i}", 0, 0, 0)))
        await until(lambda: inbox.full(), 30, "the inbox filled", every_s=0.01)
        cpu = time.thread_time()  # the event loop's thread, where a spinning pump would run
        await asyncio.sleep(1.0)
        assert time.thread_time() - cpu < 0.3  # asleep, not polling a descriptor that stays readable
        got = [(await inbox.get()).message.actor_id for _ in range(10)]  # taking messages wakes it
        assert got == [f"a{i}" for i in range(10)]
    finally:
        await cancelled([task])
        actor.close(0)
        ctx.destroy(linger=0)
