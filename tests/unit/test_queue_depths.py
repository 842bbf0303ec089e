"""Queue depths and their peaks in the learner's metrics: a real LearnerService with a real admission rule, real
ZeroMQ-free envelopes on a real inbox, and the records through the real MetricsWriter and TensorBoard's reader."""

import asyncio
import itertools

from arpo_async.messages import Assignment, Heartbeat, Step, Trajectory, WorkRequest
from arpo_async.metrics import MetricsWriter, read_metrics
from arpo_async.tasks import Task
from arpo_async.transport import Envelope, Outbox
from learner.algo.batcher import ScoredGroup
from learner.rollouts.scheduler import GroupScheduler
from learner.rollouts.service import LearnerService
from learner.rollouts.staleness import StalenessManager
from learner.train.records import step_record
from tests.support import hello, loop_counters, trained
from tests.unit.test_tensorboard_metrics import read_tensorboard

TASK = Task.from_dict({"id": "grid4-red", "instruction": "click red", "config": [],
                       "evaluator": {"func": "exact_match", "result": {"type": "vm_file", "path": "/r"},
                                     "expected": {"type": "rule", "rules": {"expected": "x"}}}})


def make_service() -> LearnerService:
    """Groups of 2, batches of 2 trajectories, eta 0: at most 2 rollouts run at version 0."""
    order = itertools.cycle([TASK])
    scheduler = GroupScheduler([TASK], group_size=2, pick_task=lambda: next(order))
    return LearnerService(Outbox(routed=True), scheduler, StalenessManager(2, 0),
                          message_counts=lambda: {"received": {"trajectory": 3}, "sent": {"ack": 3}})


def sent(service: LearnerService) -> list:
    return [service.outbox.get_nowait()[1] for _ in range(service.outbox.qsize())]


async def until(condition, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


async def test_per_peer_request_queues_and_actor_outboxes_are_gauged():
    service = make_service()
    sessions = {peer: await hello(service, peer, 8) for peer in ("a", "b")}
    for i in range(5):
        await service.handle(Envelope(WorkRequest(f"a-r{i}", "a", session=sessions["a"]), "a"))
    for i in range(2):
        await service.handle(Envelope(WorkRequest(f"b-r{i}", "b", session=sessions["b"]), "b"))
    await service.handle(Envelope(Heartbeat("a", running=2, waiting=3, unacked=0, outbox=7), "a"))
    await service.handle(Envelope(Heartbeat("b", running=0, waiting=2, unacked=1, outbox=3), "b"))
    depths = service.report.queue_depths()
    assert depths["running"] == 2  # the admission rule's capacity: (eta + version + 1) x B = 2
    assert depths["waiting_requests"] == 5 and depths["waiting_max_peer"] == 3  # a: 3 waiting, b: 2
    assert depths["actor_outbox"] == 10 and depths["actor_outbox_max"] == 7
    assert depths["inbox"] == 0  # serve() not started: no inbox yet


async def test_peaks_outlive_the_queue_and_each_record_takes_its_window():
    service = make_service()
    session = await hello(service, "a", 8)
    watcher = asyncio.create_task(service.stats.watch_depths(service.report.queue_depths, period_s=0.005))
    try:
        for i in range(6):
            await service.handle(Envelope(WorkRequest(f"r{i}", "a", session=session), "a"))
        await until(lambda: service.stats.peak_depths["waiting_requests"] == 4)
        handed = [m for m in sent(service) if isinstance(m, Assignment)]
        while handed:  # return every rollout: each group's return admits the next ones, until none waits
            for a in handed:
                step = Step([1, 2], [0], [5], [-1.0], [0], "t", "wait()")
                await service.handle(Envelope(Trajectory(f"t-{a.group_id}-{a.rollout_index}", "a", a.task["id"],
                                                         a.group_id, a.rollout_index, "FAILURE", 0.0, True, [step],
                                                         [b"png"], session=session), "a"))
            while not service.groups.empty():  # the training loop takes the complete groups
                service.groups.get_nowait()
            await trained(service, service.state.step + 1, service.state.published_version + 1)  # a new version admits more
            handed = [m for m in sent(service) if isinstance(m, Assignment)]
        await until(lambda: service.report.queue_depths()["waiting_requests"] == 0)
        counters = service.report.counters()
    finally:
        watcher.cancel()
    assert counters["queues"]["waiting_requests"] == 0
    assert counters["queues_max"]["waiting_requests"] == 4  # 6 requests, 2 admitted at once
    assert counters["queues_max"]["waiting_max_peer"] == 4
    assert counters["queues_max"]["running"] == 2
    assert counters["messages"] == {"received": {"trajectory": 3}, "sent": {"ack": 3}}
    assert set(counters["loop_lag_ms"]) == {"p50", "p99", "max", "samples"}
    assert service.stats.take_peaks().get("waiting_requests", 0) == 0  # the next window starts from now
    assert service.report.status()["queues_max"]["waiting_requests"] == 4  # the run-wide peak stays


async def test_the_inbox_depth_is_gauged_while_serve_works_through_it():
    service = make_service()
    inbox: asyncio.Queue[Envelope] = asyncio.Queue(16)
    server = asyncio.create_task(service.serve(inbox))
    try:
        await asyncio.sleep(0)  # serve() now waits on the inbox
        for i in range(3):
            inbox.put_nowait(Envelope(Heartbeat("a", 0, 0, 0), "a"))
        assert service.report.queue_depths()["inbox"] == 3
        await until(lambda: inbox.empty())
        assert service.report.queue_depths()["inbox"] == 0
    finally:
        server.cancel()


async def test_lag_and_peaks_are_tensorboard_scalars(tmp_path):
    service = make_service()
    service.stats.lag.record(3.0)
    service.stats.lag.record(70.0)
    service.stats.note_depths({"waiting_requests": 9, "outbox": 2})
    batch = [ScoredGroup("grid4-red", [], [1.0, 0.0], [1.0, -1.0], False, 0.5, [0, 1])]
    with MetricsWriter(tmp_path / "metrics.jsonl", tensorboard=tmp_path / "tb") as writer:
        writer.write(step_record(1, 1, batch, {"loss": 0.1}, service.stats.window.take(), loop_counters(service),
                                 0.0, 1.0))
    record = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert record["loop_lag_ms"]["max"] == 70.0 and record["loop_lag_ms"]["samples"] == 2
    assert record["queues_max"]["waiting_requests"] == 9
    scalars = read_tensorboard(tmp_path / "tb")
    assert scalars["loop_lag_ms/p99"][1] > 60
    assert scalars["queues_max/waiting_requests"] == {1: 9.0}
    assert scalars["messages/received/trajectory"] == {1: 3.0}
