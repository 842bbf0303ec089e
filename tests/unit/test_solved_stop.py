"""A run that has solved every task stops by itself (issue 49 item 1): the training loop's async schedule
(learner.train.loop.TrainingLoop.run_async) with a real LearnerService, TaskSelector, Batcher and collect stage;
groups arrive as the service hands them on (the selector records each, then the loop's queue takes it). Groups
without a reward difference are counted for the progress line; the stop is one line, and only with every task
solved by the evaluator's score (never by the reward) and learner.stop_when_solved on."""

from __future__ import annotations

import asyncio

from arpo_async.config import load_config
from arpo_async.transport import Outbox
from learner.algo.batcher import Batcher
from learner.algo.replay import make_replay
from learner.algo.task_selection import TaskSelector, trainable_scores
from learner.rollouts.scheduler import GroupScheduler
from learner.rollouts.service import LearnerService
from learner.rollouts.staleness import StalenessManager
from learner.state import RunState
from learner.train.checkpoint import Checkpointer
from learner.train.loop import TrainingLoop
from tests.unit.test_loop_collect import TASK, group

SOLVED_LINE = ("every task is solved in its last 4 groups: training stops (learner.stop_when_solved = false keeps "
               "it going)")


def training(tmp_path, *overrides: str) -> TrainingLoop:
    """A loop over one task whose stages run for real; nothing trains (no group has a reward difference here)."""
    lc = load_config(None, list(overrides)).learner
    state = RunState()
    selector = TaskSelector([TASK], window=lc.task_solved_groups, solved_rate=lc.task_solved_rate,
                            retire=lc.task_retire)
    service = LearnerService(Outbox(routed=True), GroupScheduler([TASK], 4), StalenessManager(8, 1), state=state,
                             selector=selector)
    batcher = Batcher(make_replay("off"), max_staleness=1, groups_per_step=2, drops=state.drops)
    return TrainingLoop(service, service.groups, batcher, state, None, None, Checkpointer(tmp_path / "ck"), lc)


def hand_on(loop: TrainingLoop, group_id: str, scores: list[float]) -> None:
    """What LearnerService does with a complete training group: record it in the selector, queue it."""
    g = group(group_id, scores)
    loop.service.selector.record_group(g.task.id, trainable_scores(g))
    loop.groups.put_nowait(g)


async def test_the_loop_stops_once_every_task_is_solved_and_says_so_in_one_line(tmp_path):
    loop = training(tmp_path)
    collector = asyncio.create_task(loop.collect())
    run = asyncio.create_task(loop.run_async())
    try:
        for n in range(3):
            hand_on(loop, f"g{n}", [1.0] * 4)
        await asyncio.wait_for(loop._ready(lambda: loop.state.totals["groups"] == 3), 10)
        assert not run.done() and not loop.solved  # 3 of 4 groups: not yet solved
        hand_on(loop, "g3", [1.0] * 4)
        await asyncio.wait_for(run, 10)  # the fourth all-success group ends the loop (no step: nothing to learn)
    finally:
        collector.cancel()
    assert loop.stopped == SOLVED_LINE and loop.state.step == 0
    assert loop.state.totals["groups"] == 4 and loop.state.drops["zero_variance"] == 4
    assert loop.service.stats.zero_variance_since_step == 4
    assert loop.service.status()["solved"] == [TASK.id]
    assert not (tmp_path / "ck").exists()  # no step taken: nothing to checkpoint


async def test_all_failing_groups_never_stop_the_run_and_neither_does_a_solved_task_with_the_stop_off(tmp_path):
    """Groups that all fail (a policy that never solves the task, or one trained against it by an inverted
    reward) have no reward difference either, but never make the task solved; with stop_when_solved = false a
    solved task keeps the run going."""
    failing = training(tmp_path)
    going = training(tmp_path, "learner.stop_when_solved=false")
    collectors = [asyncio.create_task(failing.collect()), asyncio.create_task(going.collect())]
    runs = [asyncio.create_task(failing.run_async()), asyncio.create_task(going.run_async())]
    try:
        for n in range(8):
            hand_on(failing, f"f{n}", [0.0] * 4)
            hand_on(going, f"s{n}", [1.0] * 4)
        await asyncio.wait_for(failing._ready(lambda: failing.state.totals["groups"] == 8), 10)
        await asyncio.wait_for(going._ready(lambda: going.state.totals["groups"] == 8), 10)
        assert not any(run.done() for run in runs)
        assert not failing.solved and failing.service.selector.retired == []
        assert going.service.selector.solved and not going.solved  # solved, but told to keep going
        assert failing.stopped == going.stopped == ""
    finally:
        for task in collectors + runs:
            task.cancel()
        await asyncio.gather(*collectors, *runs, return_exceptions=True)
