"""Per-task and per-family success in metrics records: trajectories go through a real LearnerService (its outcome
window counts them by task), then learner.train.records.step_record turns the window into task_success,
task_trajectories and family_success."""

import itertools

import pytest

from arpo_async.messages import Assignment, Step, Trajectory, WorkRequest
from arpo_async.tasks import Task
from arpo_async.transport import Envelope, Outbox
from learner.algo.batcher import ScoredGroup
from learner.rollouts.scheduler import GroupScheduler
from learner.rollouts.service import LearnerService
from learner.rollouts.staleness import StalenessManager
from learner.train.records import step_record
from tests.support import hello, loop_counters


def task(task_id: str, **extra) -> Task:
    return Task.from_dict({"id": task_id, "instruction": f"do {task_id}", "config": [],
                           "evaluator": {"func": "exact_match", "result": {"type": "vm_file", "path": "/r"},
                                         "expected": {"type": "rule", "rules": {"expected": "x"}}}, **extra})


OUTCOMES = {  # task -> the outcome of rollout 0 and 1 of its group
    "grid4-red": ("SUCCESS", "SUCCESS"),
    "grid4-blue": ("FAILURE", "TASK_ERROR"),  # the TASK_ERROR is not trainable: 0 of 1
    "grid4-green": ("ENV_ERROR", "ABORTED"),  # nothing trainable: left out
    "ok-button": ("SUCCESS", "TRUNCATED"),  # family "dialogs" from its task file
}
TASKS = [task("grid4-red"), task("grid4-blue"), task("grid4-green"), task("ok-button", family="dialogs")]


@pytest.fixture
async def service():
    order = itertools.cycle(TASKS)
    scheduler = GroupScheduler(TASKS, group_size=2, pick_task=lambda: next(order))
    yield LearnerService(Outbox(routed=True), scheduler, StalenessManager(8, 0))


async def assignments(service: LearnerService, count: int) -> list[Assignment]:
    session = await hello(service, "peer", 64)
    for i in range(count):
        await service.handle(Envelope(WorkRequest(f"r{i}", "actor", session=session), "peer"))
    sent = [service.outbox.get_nowait()[1] for _ in range(service.outbox.qsize())]
    return [m for m in sent if isinstance(m, Assignment)]


def trajectory(a: Assignment, outcome: str) -> Trajectory:
    step = Step([1, 2], [0], [5], [-1.0], [0], "t", "wait()")
    return Trajectory(f"t-{a.group_id}-{a.rollout_index}", "actor", a.task["id"], a.group_id, a.rollout_index,
                      outcome, float(outcome == "SUCCESS"), True, [step], [b"png"])


async def test_step_record_has_success_per_task_and_family(service):
    handed = await assignments(service, 8)
    assert sorted(a.task["id"] for a in handed) == sorted(2 * list(OUTCOMES))
    for a in handed:
        outcome = OUTCOMES[a.task["id"]][a.rollout_index]
        traj = trajectory(a, outcome)
        traj.session = service.peers.sessions.latest("peer")
        await service.handle(Envelope(traj, "peer"))

    batch = [ScoredGroup("grid4-red", [], [1.0, 0.0], [1.0, -1.0], False, 0.5, [0, 0])]
    record = step_record(1, 1, batch, {"loss": 0.1}, service.stats.window.take(), loop_counters(service), 0.0, 12.0)

    assert record["task_success"] == {"grid4-red": 1.0, "grid4-blue": 0.0, "ok-button": 0.5}
    assert record["task_trajectories"] == {"grid4-red": 2, "grid4-blue": 1, "ok-button": 2}
    assert record["family_success"] == {"grid4": pytest.approx(2 / 3), "dialogs": 0.5}
    assert record["success_rate"] == pytest.approx(3 / 5)  # the existing keys are unchanged
    assert record["outcomes"] == {"SUCCESS": 3, "FAILURE": 1, "TRUNCATED": 1, "ENV_ERROR": 1, "TASK_ERROR": 1,
                                  "ABORTED": 1}
    assert record["task_errors"] == {"grid4-blue": 1}

    empty = step_record(2, 2, batch, {"loss": 0.1}, service.stats.window.take(), loop_counters(service), 0.0, 13.0)
    assert empty["task_success"] == empty["task_trajectories"] == empty["family_success"] == {}
    assert empty["task_errors"] == {}
    assert empty["success_rate"] == 0.0 and empty["outcomes"] == {}


async def test_step_record_counts_injected_demonstrations(service):
    from arpo_async.demos import DEMONSTRATION_ACTOR

    step = Step([1, 2], [0], [5], [0.0], [0], "t", "")
    demo = Trajectory("demo:x", DEMONSTRATION_ACTOR, "grid4-red", "demo:x", 0, "SUCCESS", 1.0, True, [step], [b"png"])
    own = Trajectory("t-own", "actor", "grid4-red", "g", 0, "SUCCESS", 1.0, True, [step], [b"png"])
    failed = Trajectory("t-f", "actor", "grid4-red", "g", 1, "FAILURE", 0.0, True, [step], [b"png"])
    batch = [ScoredGroup("grid4-red", [demo, failed], [1.0, 0.0], [1.0, -1.0], True, 0.0, [0, 0], [True, False]),
             ScoredGroup("grid4-red", [own, failed], [1.0, 0.0], [1.0, -1.0], True, 0.0, [0, 0], [True, False]),
             ScoredGroup("grid4-red", [demo, failed], [1.0, 0.0], [1.0, -1.0], False, 0.5, [0, 0], [])]
    record = step_record(1, 1, batch, {"loss": 0.1}, service.stats.window.take(), loop_counters(service), 0.0, 1.0)
    assert (record["replay_injections"], record["demo_injections"]) == (2, 1)
