"""The learner's Acks: one Ack per peer for a burst of trajectories, every id acked once, in arrival order, before
any Reject, never more than ACK_BATCH ids held back, and trajectories that arrive one at a time share an Ack sent
``ack_delay_s`` after the first (a real LearnerService on ZeroMQ-free envelopes)."""

import asyncio

from arpo_async.messages import Ack, Reject, Shutdown, Step, Trajectory
from arpo_async.transport import Envelope, Outbox
from learner.algo.batcher import Batcher
from learner.algo.replay import SuccessReplay
from learner.rollouts.acks import ACK_BATCH
from learner.rollouts.scheduler import GroupScheduler
from learner.rollouts.service import LearnerService
from learner.rollouts.staleness import StalenessManager
from tests.support import cancelled
from tests.unit.test_queue_depths import TASK


def make_service(ack_delay_s: float = 0.0) -> LearnerService:
    return LearnerService(Outbox(routed=True, size=4 * ACK_BATCH), GroupScheduler([TASK], group_size=2),
                          StalenessManager(2, 0), Batcher(SuccessReplay(), max_staleness=0, groups_per_step=1),
                          ack_delay_s=ack_delay_s)


def trajectory(trajectory_id: str, score: float = 0.0) -> Envelope:
    """A trajectory for a slot this learner never handed out: acked, then counted "late" (or refused if invalid)."""
    step = Step([1, 2], [0], [5], [-1.0], [0], "t", "wait()")
    return Envelope(Trajectory(trajectory_id, "a", TASK.id, "g-old", 0, "FAILURE", score, True, [step], [b"png"]),
                    "a")


def sent(service: LearnerService) -> list:
    return [service.outbox.get_nowait() for _ in range(service.outbox.qsize())]


async def test_a_burst_is_acked_by_one_ack_at_its_end():
    service = make_service()
    await service.handle(trajectory("t0"), more=True)
    await service.handle(trajectory("t1"), more=True)
    assert sent(service) == []  # held back while the burst goes on
    await service.handle(trajectory("t2"))
    assert sent(service) == [("a", Ack(["t0", "t1", "t2"]))]
    assert service.state.totals["acked"] == 3 and service.state.totals["late"] == 3


async def test_serve_acks_what_the_inbox_held_at_once():
    service = make_service()
    inbox: asyncio.Queue[Envelope] = asyncio.Queue()
    for i in range(5):
        inbox.put_nowait(trajectory(f"t{i}"))
    task = asyncio.create_task(service.serve(inbox))
    try:
        first = await asyncio.wait_for(service.outbox.get(), 5)  # the first reply, however soon it comes
    finally:
        await cancelled([task])
    assert [first, *sent(service)] == [("a", Ack([f"t{i}" for i in range(5)]))]


async def test_held_acks_go_out_before_a_reject_and_never_beyond_ack_batch():
    service = make_service()
    await service.handle(trajectory("t0"), more=True)
    await service.handle(trajectory("bad", score=2.0), more=True)  # invalid: acked (held), then refused
    out = sent(service)
    assert out[0] == ("a", Ack(["t0", "bad"])) and isinstance(out[1][1], Reject) and len(out) == 2
    for i in range(ACK_BATCH + 1):
        await service.handle(trajectory(f"u{i}"), more=True)
    out = sent(service)
    assert out == [("a", Ack([f"u{i}" for i in range(ACK_BATCH)]))]  # the last one is still held
    await service.handle(trajectory("v"))
    assert sent(service) == [("a", Ack([f"u{ACK_BATCH}", "v"]))]
    assert service.state.totals["acked"] == ACK_BATCH + 4


async def test_trajectories_arriving_one_at_a_time_share_one_ack_sent_after_the_delay():
    service = make_service(ack_delay_s=1.0)
    await service.handle(trajectory("t0"))  # each one the whole of its burst
    await service.handle(trajectory("t1"))
    assert sent(service) == []  # both held for the delay
    first = await asyncio.wait_for(service.outbox.get(), 5)
    assert [first, *sent(service)] == [("a", Ack(["t0", "t1"]))]
    await service.handle(trajectory("t2"))  # a later one waits for its own delay
    assert sent(service) == []
    assert await asyncio.wait_for(service.outbox.get(), 5) == ("a", Ack(["t2"]))
    assert service.state.totals["acked"] == 3


async def test_a_delayed_ack_is_sent_at_once_when_a_reject_follows():
    service = make_service(ack_delay_s=30.0)
    await service.handle(trajectory("t0"))
    await service.handle(trajectory("bad", score=2.0))
    out = sent(service)
    assert out[0] == ("a", Ack(["t0", "bad"])) and isinstance(out[1][1], Reject) and len(out) == 2


async def test_held_acks_go_out_before_the_shutdown_that_ends_the_run():
    """An actor stops waiting for its last trajectories when it gets Shutdown: their Acks must come first."""
    service = make_service(ack_delay_s=30.0)
    await service.handle(trajectory("t0"))
    await service.shutdown_actors("training finished")
    assert sent(service) == [("a", Ack(["t0"])), ("a", Shutdown("training finished"))]
