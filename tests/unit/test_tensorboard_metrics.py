"""metrics.jsonl and its TensorBoard mirror: trajectories with stage timings go through a real LearnerService,
learner.train.records.step_record builds the records, the real MetricsWriter writes them, and TensorBoard's own reader
(EventAccumulator) must find exactly the numbers of metrics.jsonl, including the stage-timing aggregates and
queue depths."""

import itertools
import json
import math

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from arpo_async.messages import Assignment, Heartbeat, Step, Trajectory, WorkRequest
from arpo_async.metrics import MetricsWriter, flatten_numbers, read_metrics
from arpo_async.stage_timings import StageTimings, percentile
from arpo_async.tasks import Task
from arpo_async.transport import Envelope, Outbox
from learner.algo.batcher import Batcher, ScoredGroup
from learner.algo.replay import SuccessReplay
from learner.rollouts.scheduler import GroupScheduler
from learner.rollouts.service import LearnerService
from learner.rollouts.staleness import StalenessManager
from learner.train.records import step_record
from tests.support import hello, loop_counters

TASK = Task.from_dict({"id": "grid4-red", "instruction": "click red", "config": [],
                       "evaluator": {"func": "exact_match", "result": {"type": "vm_file", "path": "/r"},
                                     "expected": {"type": "rule", "rules": {"expected": "x"}}}})


def read_tensorboard(folder) -> dict[str, dict[int, float]]:
    """Every scalar in the event files of ``folder``: tag -> {step: value}, read by TensorBoard's reader."""
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def step(generate_s: float, act_s: float, observe_s: float, settle_s: float = 0.0,
         settle_timed_out: bool = False) -> Step:
    return Step([1, 2], [0], [5], [-1.0], [0], "t", "click(1,2)", generate_s=generate_s, act_s=act_s,
                observe_s=observe_s, settle_s=settle_s, settle_timed_out=settle_timed_out)


def test_percentile_matches_numpy_and_hand_computed_values():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5  # (1,2,3,4): halfway between 2 and 3
    assert percentile([1.0, 2.0, 3.0, 4.0], 95) == pytest.approx(3.85)  # position 2.85: 3 + 0.85 * (4 - 3)
    assert percentile([7.0], 95) == 7.0
    values = list(np.random.default_rng(0).exponential(size=37))
    for q in (0, 5, 50, 95, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="outside"):
        percentile([1.0], 101)


def test_stage_timings_maps_trajectory_and_step_fields_and_skips_unmeasured_ones():
    traj = Trajectory("t", "a", "grid4-red", "g", 0, "SUCCESS", 1.0, True,
                      [step(0.2, 0.05, 0.01), step(0.4, 0.0, 0.03)],  # the second step "finished": no action ran
                      [b"png"], timings={"reset_s": 1.5, "setup_s": 0.5, "evaluate_s": 0.25, "episode_s": 2.0,
                                         "unknown_s": 9.0})
    stages = StageTimings()
    stages.add(traj)
    summary = stages.summary()
    assert set(summary) == {"reset", "setup", "evaluate", "episode", "screenshot", "generate", "execute"}
    assert summary["generate"] == {"p50": pytest.approx(0.3), "p95": pytest.approx(0.39), "count": 2}
    assert summary["execute"] == {"p50": 0.05, "p95": 0.05, "count": 1}
    assert summary["reset"]["count"] == 1 and summary["reset"]["p95"] == 1.5
    assert StageTimings().summary() == {}


def test_settle_stage_gives_p50_p95_and_the_share_of_waits_that_hit_the_timeout():
    """Each executed action's settle wait is one sample (Step.settle_s, 0.0 = none); ``timeout_share`` counts the
    samples whose Step.settle_timed_out is True. Hostile values (NaN, infinite, negative, a bool) are skipped, and
    so is their timed_out flag."""
    waits = [(0.2, False), (0.3, False), (2.05, True), (0.1, False), (0.0, True),  # 0.0: no action settled
             (math.nan, True), (math.inf, True), (-1.0, True), (True, True)]
    steps = []
    for seconds, timed_out in waits:
        s = step(0.5, 0.01, 0.02)
        s.settle_s, s.settle_timed_out = seconds, timed_out
        steps.append(s)
    traj = Trajectory("t", "a", "grid4-red", "g", 0, "SUCCESS", 1.0, True, steps, [b"png"])
    stages = StageTimings()
    stages.add(traj)
    settle = stages.summary()["settle"]
    # 0.1, 0.2, 0.3, 2.05: median halfway between 0.2 and 0.3; p95 at position 2.85: 0.3 + 0.85 * 1.75
    assert settle == {"p50": pytest.approx(0.25), "p95": pytest.approx(1.7875), "count": 4, "timeout_share": 0.25}
    assert "timeout_share" not in stages.summary()["screenshot"]  # the share is the settle stage's alone
    assert "settle" not in StageTimings().summary()


def test_flatten_numbers_keeps_finite_numbers_only():
    record = {"step": 3, "loss": 0.5, "nan": float("nan"), "none": None, "name": "x", "ok": True, "ids": [1, 2],
              "drops": {"stale": 2, "zero_variance": 1}, "stage_s": {"reset": {"p50": 1.0, "count": 4}}}
    assert flatten_numbers(record) == {"step": 3.0, "loss": 0.5, "drops/stale": 2.0, "drops/zero_variance": 1.0,
                                       "stage_s/reset/p50": 1.0, "stage_s/reset/count": 4.0}


@pytest.fixture
async def service():
    order = itertools.cycle([TASK])
    scheduler = GroupScheduler([TASK], group_size=2, pick_task=lambda: next(order))
    yield LearnerService(Outbox(routed=True), scheduler, StalenessManager(8, 0))


async def one_window(service: LearnerService, window: int, scale: float) -> None:
    """Two rollouts handed out and returned; stage timings scaled by ``scale``. Window 1's group has two failures
    (no reward difference, and no success to replay yet: dropped as zero_variance); window 2's a success and a
    failure, whose settle wait hit the timeout."""
    session = service.peers.sessions.latest("peer")
    for i in range(2):
        await service.handle(Envelope(WorkRequest(f"w{window}-r{i}", "actor", session=session), "peer"))
    sent = [service.outbox.get_nowait()[1] for _ in range(service.outbox.qsize())]
    for a in [m for m in sent if isinstance(m, Assignment)]:
        traj = Trajectory(f"t{window}-{a.rollout_index}", "actor", a.task["id"], a.group_id, a.rollout_index,
                          *(("SUCCESS", 1.0) if window == 2 and a.rollout_index == 0 else ("FAILURE", 0.0)), True,
                          [step(scale * (a.rollout_index + 1), scale / 10, scale / 100, scale / 5,
                                settle_timed_out=window == 2 and a.rollout_index == 1)], [b"png"],
                          timings={"reset_s": scale, "setup_s": scale / 2, "evaluate_s": scale / 4,
                                   "episode_s": 2 * scale}, session=session)
        await service.handle(Envelope(traj, "peer"))


async def test_tensorboard_holds_every_number_of_metrics_jsonl(service, tmp_path):
    await hello(service, "peer", 4)
    await service.handle(Envelope(Heartbeat("actor", running=3, waiting=1, unacked=2), "peer"))
    writer = MetricsWriter(tmp_path / "metrics.jsonl", tensorboard=tmp_path / "tb")
    batch = [ScoredGroup("grid4-red", [], [1.0, 0.0], [1.0, -1.0], False, 0.5, [0, 1])]
    batcher = Batcher(SuccessReplay(), max_staleness=0, groups_per_step=1, drops=service.state.drops)
    for n, scale in ((1, 1.0), (2, 3.0)):
        await one_window(service, n, scale)
        while not service.groups.empty():  # the training loop's per-group stages (TrainingLoop.collect)
            batcher.add_group(service.groups.get_nowait(), service.state.published_version)
        writer.write(step_record(n, n, batch, {"loss": 0.1 * n, "grad_norm": float("nan")}, service.stats.window.take(),
                                 loop_counters(service), 0.25, 10.0 * n))
    writer.close()

    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    second = records[1]
    assert second["stage_s"]["generate"] == {"p50": 4.5, "p95": pytest.approx(5.85), "count": 2}  # 3 and 6 s
    assert second["stage_s"]["reset"] == {"p50": 3.0, "p95": 3.0, "count": 2}
    assert second["stage_s"]["settle"] == {"p50": 0.6, "p95": 0.6, "count": 2, "timeout_share": 0.5}
    assert records[0]["stage_s"]["settle"]["timeout_share"] == 0  # the window's own share, not the run's
    assert set(second["stage_s"]) == {"reset", "setup", "screenshot", "generate", "execute", "settle", "evaluate",
                                      "episode"}
    assert second["queues"]["actor_running"] == 3 and second["queues"]["actor_unacked"] == 2
    assert set(second["queues"]) >= {"waiting_requests", "running", "ready_groups", "outbox"}

    scalars = read_tensorboard(tmp_path / "tb")
    expected: dict[str, dict[int, float]] = {}
    for record in records:
        for name, value in flatten_numbers(record).items():
            expected.setdefault(name, {})[record["step"]] = value
    assert set(scalars) == set(expected)  # nothing missing, nothing extra
    for name, by_step in expected.items():
        assert scalars[name] == pytest.approx(by_step, rel=1e-6), name  # TensorBoard stores float32
    assert scalars["stage_s/generate/p95"][2] == pytest.approx(5.85, rel=1e-6)
    assert scalars["stage_s/settle/timeout_share"] == {1: 0.0, 2: 0.5}  # what settling cost, per record
    assert scalars["drops/zero_variance"] == {1: 1.0, 2: 1.0}  # drops by reason (a running count)
    assert scalars["totals/trajectories"] == {1: 2.0, 2: 4.0}
    assert scalars["queues/actor_running"] == {1: 3.0, 2: 3.0}
    assert "grad_norm" not in scalars  # NaN: null in metrics.jsonl, no scalar
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["grad_norm"] is None


def test_a_resumed_run_replaces_the_rolled_back_steps_in_tensorboard(tmp_path):
    def record(step: int, loss: float) -> dict:
        return {"step": step, "policy_version": step, "trajectories": 8, "success_rate": 0.5, "reward_mean": 0.1,
                "loss": loss, "replay_injections": 0, "staleness_mean": 0.0, "wall_s": float(step)}

    writer = MetricsWriter(tmp_path / "metrics.jsonl", tensorboard=tmp_path / "tb")
    for n in (1, 2, 3):
        writer.write(record(n, loss=float(n)))
    writer.close()
    # the checkpoint was taken at step 2: learner.train.checkpoint.reconcile_metrics keeps steps 1 and 2
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n")
    writer = MetricsWriter(tmp_path / "metrics.jsonl", tensorboard=tmp_path / "tb")
    writer.write(record(3, loss=30.0))
    writer.write(record(4, loss=40.0))
    writer.close()
    assert read_tensorboard(tmp_path / "tb")["loss"] == {1: 1.0, 2: 2.0, 3: 30.0, 4: 40.0}
