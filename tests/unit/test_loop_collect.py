"""The training loop's per-group stages as it runs them (learner.train.loop.TrainingLoop.collect): every complete
group from the service's queue is scored at the current policy version; what the stages drop is reported to the
admission rule; a group that cannot be scored is dropped and counted; a broken advantage function stops the loop."""

from __future__ import annotations

import asyncio

import pytest

from arpo_async.config import load_config
from arpo_async.messages import Step, Trajectory
from arpo_async.tasks import Task
from learner.algo.advantages import AdvantageFunctionError
from learner.algo.batcher import Batcher
from learner.algo.replay import make_replay
from learner.rollouts.scheduler import Group
from learner.rollouts.rounds import ROUND_END, GroupQueue
from learner.state import RunState
from learner.train.checkpoint import Checkpointer
from learner.train.loop import TrainingLoop

TASK = Task.from_dict({"id": "grid4-red", "instruction": "click red", "config": [],
                       "evaluator": {"func": "exact_match", "result": {"type": "vm_file", "path": "/r"},
                                     "expected": {"type": "rule", "rules": {"expected": "red"}}}})


def group(group_id: str, scores: list[float], outcomes: list[str] | None = None) -> Group:
    outcomes = outcomes or ["SUCCESS" if s > 0.1 else "FAILURE" for s in scores]
    results = {k: Trajectory(f"{group_id}-{k}", "a", TASK.id, group_id, k, outcome, score, True,
                             [Step([1, 2], [0], [5, 6], [-1.0, -1.0], [3, 3], "t", "click")], [b"png"])
               for k, (score, outcome) in enumerate(zip(scores, outcomes))}
    return Group(group_id, TASK, len(scores), results=results)


def loop(tmp_path, advantage_function=None) -> tuple[TrainingLoop, list[int]]:
    """A training loop whose collect stage runs for real (nothing here trains or publishes); it reports discards
    into the returned list."""
    state, groups, discarded = RunState(published_version=3), GroupQueue(), []
    kwargs = {"advantage_function": advantage_function} if advantage_function else {}
    batcher = Batcher(make_replay("off"), max_staleness=1, groups_per_step=2, drops=state.drops, **kwargs)
    lc = load_config(None, []).learner
    training = TrainingLoop(None, groups, batcher, state, None, None, Checkpointer(tmp_path / "ck"), lc,
                            on_discard=discarded.append)
    return training, discarded


async def test_groups_are_scored_as_they_arrive_and_drops_reach_the_admission_rule(tmp_path):
    training, discarded = loop(tmp_path)
    collector = asyncio.create_task(training.collect())
    try:
        training.groups.put_nowait(group("g1", [1.0, 0.0, 0.0]))  # kept whole
        training.groups.put_nowait(group("g2", [0.0, 0.0, 0.0]))  # no reward difference: all 3 dropped
        training.groups.put_nowait(group("g3", [1.0, float("nan")]))  # cannot be scored: dropped, counted
        training.groups.put_nowait(group("g4", [1.0, 0.0], ["SUCCESS", "ENV_ERROR"]))  # 1 accepted, too small
        training.groups.put_nowait(ROUND_END)
        await asyncio.wait_for(training._ready(lambda: training._round_ends == 1), 5)
    finally:
        collector.cancel()
    assert [g.task_id for g in training.batcher.ready] == [TASK.id] and training.ready_groups() == 1
    assert training.batcher.ready[0].policy_lag == [0, 0, 0]  # scored at version 3, tokens of version 3
    assert discarded == [0, 3, 2, 1]
    assert dict(training.state.drops) == {"zero_variance": 1, "unscorable": 1, "env_error": 1, "group_too_small": 1}


async def test_a_broken_advantage_function_stops_the_loop(tmp_path):
    training, _ = loop(tmp_path, advantage_function=lambda rewards, task_id: rewards[:1])
    training.groups.put_nowait(group("g1", [1.0, 0.0]))
    with pytest.raises(AdvantageFunctionError, match="must return 2 finite floats"):
        await asyncio.wait_for(training.collect(), 5)
