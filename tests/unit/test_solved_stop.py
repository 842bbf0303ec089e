"""A run that has solved every task stops by itself (issue 49 item 1): the training loop's async schedule
(learner.train.loop.TrainingLoop.run_async) with a real LearnerService, TaskSelector, Batcher and collect stage;
groups arrive as the service hands them on (the selector records each, then the loop's queue takes it). Groups
without a reward difference are counted for the progress line; the stop is one line, and only with every task
solved by the evaluator's score (never by the reward) and learner.stop_when_solved on. A run with [eval] that stops
as solved after a step of its own evaluates its final weights as a run at learner.steps does (a real Trainer on the
tiny policy takes the step): the round is handed out in the final evaluation after the loop stops
(TrainingLoop.evaluate_final_weights, as learner.run.Run calls it), and its result follows the last batch's record as
the evaluation record."""

from __future__ import annotations

import asyncio

import json

from arpo_async.config import EvalConfig, load_config
from arpo_async.messages import Step, Trajectory
from arpo_async.metrics import MetricsWriter, is_training_record, read_metrics, training_records
from arpo_async.model.inputs import PromptEncoder
from arpo_async.transport import Outbox
from learner.algo.batcher import Batcher
from learner.algo.replay import make_replay
from learner.algo.task_selection import TaskSelector, trainable_scores
from learner.rollouts.evaluation_rounds import RESULT_KEYS, EvaluationRounds
from learner.rollouts.scheduler import Group, GroupScheduler
from learner.rollouts.service import LearnerService
from learner.rollouts.staleness import StalenessManager
from learner.state import RunState
from learner.train.checkpoint import Checkpointer, checkpoint_folders
from learner.train.loop import TrainingLoop
from learner.train.publisher import WeightPublisher
from learner.train.trainer import Trainer
from tests.rank_driver import screenshot
from tests.support import cancelled, hello, until
from tests.unit.test_eval_rounds import HELD_A, ask, trajectory
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
    loop.service.control.selector.record_group(g.task.id, trainable_scores(g))
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
    assert loop.service.report.status()["solved"] == [TASK.id]
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
        assert not failing.solved and failing.service.control.selector.retired == []
        assert going.service.control.selector.solved and not going.solved  # solved, but told to keep going
        assert failing.stopped == going.stopped == ""
    finally:
        for task in collectors + runs:
            task.cancel()
        await asyncio.gather(*collectors, *runs, return_exceptions=True)


def evaluating(tmp_path, tiny_model) -> TrainingLoop:
    """A loop that trains for real (the tiny policy on the CPU, one optimizer step per group with a reward
    difference, weights published to disk, a checkpoint every step, records to metrics.jsonl) and evaluates HELD_A
    twice a round, waiting at most 60 s for the final round."""
    lc = load_config(None, ["learner.steps=80", "learner.groups_per_step=1", "learner.updates_per_batch=1",
                            "learner.checkpoint_every=1"]).learner
    state = RunState()
    selector = TaskSelector([TASK], window=lc.task_solved_groups, solved_rate=lc.task_solved_rate,
                            retire=lc.task_retire)
    evaluation = EvaluationRounds([HELD_A], EvalConfig(tasks="x", repeats=2, final_timeout_s=60.0),
                                  final_step=lc.steps, id_prefix="L-", state=state)
    service = LearnerService(Outbox(routed=True), GroupScheduler([TASK], 2, pick_task=selector.pick_task),
                             StalenessManager(8, 1), state=state, selector=selector, evaluation=evaluation,
                             ack_delay_s=0.0)
    batcher = Batcher(make_replay("off"), max_staleness=1, groups_per_step=1, drops=state.drops)
    loop = TrainingLoop(service, service.groups, batcher, state, Trainer(tiny_model, lc),
                        WeightPublisher([], tmp_path / "weights"), Checkpointer(tmp_path / "ck"), lc,
                        final_eval_timeout_s=evaluation.config.final_timeout_s)
    loop.metrics = MetricsWriter(tmp_path / "metrics.jsonl")
    return loop


def real_group(encoder: PromptEncoder, group_id: str, scores: list[float]) -> Group:
    """A complete group of TASK whose trajectories the trainer can take: one step each, the screenshot and prompt
    tokens of a real episode, a short reply sampled at version 0."""
    prompt = encoder.encode([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "click red"}]}],
                            [(320, 180)])
    reply = encoder.tokenize("Thought: r\nAction: click(start_box='(100,100)')<|im_end|>")
    results = {k: Trajectory(f"{group_id}-{k}", "a", TASK.id, group_id, k, "SUCCESS" if score > 0.1 else "FAILURE",
                             score, True, [Step(prompt, [0], reply, [-1.0] * len(reply), [0] * len(reply), "r",
                                                "click(100,100)")], [screenshot("red")])
               for k, score in enumerate(scores)}
    return Group(group_id, TASK, len(scores), results=results)


async def test_a_run_that_stops_as_solved_evaluates_its_final_weights_in_a_record_after_the_last(tmp_path,
                                                                                                 tiny_model):
    loop = evaluating(tmp_path, tiny_model)
    service, evaluation = loop.service, loop.service.evaluation
    encoder = PromptEncoder(tiny_model)
    tasks = [asyncio.create_task(loop.collect())]

    async def train_then_evaluate() -> None:  # training, then the final evaluation, as learner.run.Run runs them
        await loop.run_async()
        await loop.evaluate_final_weights()

    run = asyncio.create_task(train_then_evaluate())
    try:
        await hello(service, "a", 8)
        g = real_group(encoder, "g0", [1.0, 0.0])  # a reward difference: one optimizer step, version 1
        service.control.selector.record_group(g.task.id, trainable_scores(g))
        loop.groups.put_nowait(g)
        await until(lambda: loop.state.published_version == 1
                    and len(read_metrics(tmp_path / "metrics.jsonl")) == 1, 120,
                    "the first optimizer step and its record")
        assert evaluation.round is None and not run.done()
        for n in range(4):  # every rollout of the task's last 4 groups succeeds: solved
            hand_on(loop, f"s{n}", [1.0, 1.0])
        final = await until(lambda: evaluation.round, 30, "the round on the final weights")
        assert (final.step, final.version) == (1, 1) and not run.done()  # the final evaluation waits for it
        handed = await ask(service, 3)  # the actors still get work: the round's 2 episodes first
        assert [(a.evaluation, a.policy_version, a.task["id"]) for a in handed[:2]] == [(True, 1, HELD_A.id)] * 2
        for a, outcome in zip(handed[:2], ["SUCCESS", "FAILURE"]):
            await service.handle(trajectory(service, a, outcome, version=1))
        await asyncio.wait_for(run, 30)
    finally:
        await cancelled([*tasks, run])
        loop.metrics.close()
    assert loop.stopped == SOLVED_LINE and loop.state.step == 1
    records = read_metrics(tmp_path / "metrics.jsonl")
    trained, last = records[0], records[-1]
    assert len(records) == 2 and is_training_record(trained) and training_records(records) == [trained]
    assert set(last) == {"step", "policy_version", "wall_s", *RESULT_KEYS} and not is_training_record(last)
    assert (last["step"], last["policy_version"]) == (trained["step"], trained["policy_version"]) == (1, 1)
    assert (last["eval_step"], last["eval_policy_version"], last["eval_episodes"]) == (1, 1, 2)
    assert last["eval_success"] == 0.5 and last["wall_s"] >= trained["wall_s"]
    newest = checkpoint_folders(tmp_path / "ck")[-1]  # checkpointed again with the solved windows
    assert json.loads((newest / "meta.json").read_text())["step"] == 1
    assert service.state.totals["eval_rounds"] == 1 and "eval_rounds_abandoned" not in service.state.totals
