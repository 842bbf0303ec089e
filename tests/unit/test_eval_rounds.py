"""Held-out evaluation rounds in the learner (learner.rollouts.evaluation_rounds): a real LearnerService with a real
scheduler, admission rule, the groups queue for training and task selector, on ZeroMQ-free envelopes. A round of N
episodes completes and is counted with its errors in the denominator; its trajectories are acked and reach nothing that
trains."""

import collections
import json

import pytest

from arpo_async.config import ConfigError, EvalConfig, load_config
from arpo_async.messages import Ack, Assignment, Step, Trajectory, WorkRequest
from arpo_async.tasks import Task
from arpo_async.transport import Envelope, Outbox
from learner.algo.task_selection import TaskSelector
from learner.rollouts.evaluation_rounds import RESULT_KEYS, EvaluationRounds, evaluation_tasks
from learner.rollouts.scheduler import GroupScheduler
from learner.rollouts.service import LearnerService
from learner.rollouts.staleness import LockstepAdmission, StalenessManager
from tests.support import hello, trained


def task(task_id: str) -> Task:
    return Task.from_dict({"id": task_id, "instruction": f"do {task_id}", "config": [],
                           "evaluator": {"func": "exact_match", "result": {"type": "vm_file", "path": "/r"},
                                         "expected": {"type": "rule", "rules": {"expected": "x"}}}})


TRAIN, HELD_A, HELD_B = task("grid4-red"), task("grid4-purple"), task("grid4-green-row")


def make_service(every_steps: int = 0, repeats: int = 2, *, final_step: int = 0, lockstep: bool = False,
                 **eval_keys) -> LearnerService:
    """Training on TRAIN (groups of 2, batches of one group), evaluating HELD_A and HELD_B ``repeats`` times."""
    selector = TaskSelector([TRAIN], seed=0)
    scheduler = GroupScheduler([TRAIN], group_size=2, pick_task=selector.pick_task,
                               group_budget=0 if lockstep else None, id_prefix="L-")
    admission = LockstepAdmission(2) if lockstep else StalenessManager(2, 0)
    evaluation = EvaluationRounds([HELD_A, HELD_B], EvalConfig(tasks="x", every_steps=every_steps, repeats=repeats,
                                                               **eval_keys),
                                  final_step=final_step, id_prefix="L-")
    return LearnerService(Outbox(routed=True), scheduler, admission, selector=selector,
                          rounds=lockstep, evaluation=evaluation, ack_delay_s=0.0)


def sent(service: LearnerService) -> list:
    return [service.outbox.get_nowait()[1] for _ in range(service.outbox.qsize())]


def trajectory(service: LearnerService, a: Assignment, outcome: str, tid: str | None = None,
               version: int = 0) -> Envelope:
    score = 1.0 if outcome == "SUCCESS" else 0.0
    steps = [Step([1, 2], [0], [5], [-1.0], [version], "t", "click(1,1)")] if outcome != "ENV_ERROR" else []
    return Envelope(Trajectory(tid or f"t-{a.group_id}-{a.rollout_index}", "a", a.task["id"], a.group_id,
                               a.rollout_index, outcome, score, True, steps, [b"png"] if steps else [],
                               assigned_version=a.policy_version,
                               session=service.peers.sessions.latest("a")), "a")


async def ask(service: LearnerService, n: int, first: int = 0) -> list[Assignment]:
    """``n`` work requests from peer "a"; the assignments they got."""
    for i in range(first, first + n):
        await service.handle(Envelope(WorkRequest(f"r{i}", "a", session=service.peers.sessions.latest("a")), "a"))
    return [m for m in sent(service) if isinstance(m, Assignment)]


async def test_a_round_completes_counting_errors_as_failures_and_trains_on_nothing():
    service = make_service(max_steps=3, temperature=0.7)
    await hello(service, "a", 16)
    await service.control.begin_evaluation()  # step 0: the round of the initial weights
    handed = await ask(service, 6)
    evaluation = [a for a in handed if a.evaluation]
    assert len(evaluation) == 4 and handed[:4] == evaluation  # evaluation first, then training
    assert {(a.max_steps, a.temperature, a.policy_version) for a in evaluation} == {(3, 0.7, 0)}
    assert sorted(a.task["id"] for a in evaluation) == sorted([HELD_A.id] * 2 + [HELD_B.id] * 2)
    assert [a.task["id"] for a in handed[4:]] == [TRAIN.id, TRAIN.id] and not any(a.evaluation for a in handed[4:])
    assert service.admission.running == 2  # evaluation episodes are outside the admission rule
    selector_before = service.control.selector.stats()

    outcomes = {(HELD_A.id, 0): "SUCCESS", (HELD_A.id, 1): "ENV_ERROR", (HELD_B.id, 0): "TASK_ERROR",
                (HELD_B.id, 1): "FAILURE"}
    for a in evaluation:
        await service.handle(trajectory(service, a, outcomes[(a.task["id"], a.rollout_index)]), more=True)
    await service.handle(trajectory(service, evaluation[0], "SUCCESS"))  # a re-send: a duplicate, counted once
    acks = [m for m in sent(service) if isinstance(m, Ack)]
    assert sorted(tid for ack in acks for tid in ack.trajectory_ids) == sorted(
        [f"t-{a.group_id}-{a.rollout_index}" for a in evaluation] + [f"t-{evaluation[0].group_id}-0"])

    result = service.evaluation.take_result()
    assert set(result) == set(RESULT_KEYS)
    assert result["eval_success"] == 0.25 and result["eval_episodes"] == 4 and result["eval_errors"] == 2
    assert result["eval_task_success"] == {HELD_A.id: 0.5, HELD_B.id: 0.0}
    assert result["eval_policy_version"] == 0 and result["eval_step"] == 0
    assert service.evaluation.take_result() == {}  # one record carries it
    assert service.evaluation.round is None and not service.evaluation.has_work  # no error was handed out again
    # nothing that trains saw them: the window, the scheduler, the groups for training, the selector
    totals = service.state.totals
    assert totals["trajectories"] == 0 and totals["eval_trajectories"] == 4 and totals["duplicates"] == 1
    assert not any(totals[o] for o in ("SUCCESS", "FAILURE", "ENV_ERROR", "TASK_ERROR"))
    assert service.stats.window.take().outcomes == collections.Counter()
    assert set(service.scheduler.task_stats) == {TRAIN.id}
    assert service.groups.empty()
    assert service.control.selector.stats() == selector_before and service.peers.assigned.keys() == {
        (a.group_id, a.rollout_index) for a in handed[4:]}


async def test_rounds_come_due_at_multiples_skip_while_one_runs_and_the_final_one_replaces_it():
    service = make_service(every_steps=4, repeats=1, final_step=12)
    evaluation = service.evaluation
    await hello(service, "a", 16)
    await trained(service, 2, 1)
    assert evaluation.round is None  # 2 crosses no multiple of 4
    await trained(service, 5, 2)  # crosses 4
    first = [a for a in sent(service) if isinstance(a, Assignment)]
    assert first == [] and evaluation.round.step == 5 and evaluation.round.version == 2  # no request waits yet
    handed = await ask(service, 1)
    assert handed[0].evaluation and handed[0].policy_version == 2
    await trained(service, 8, 3)  # due again while the round of step 5 runs: skipped
    assert evaluation.round.step == 5 and service.state.totals["eval_rounds_skipped"] == 1
    await trained(service, 12, 4)  # the final step: an older round gives way to the final one
    assert evaluation.round.step == 12 and evaluation.round.version == 4
    assert service.state.totals["eval_rounds_abandoned"] == 1
    late = handed[0]
    await service.handle(trajectory(service, late, "SUCCESS"))  # its round is gone: acked, counted late, never recorded
    assert service.state.totals["late"] == 1 and evaluation.results == []
    final = [a for a in await ask(service, 4, first=1) if a.evaluation]
    assert len(final) == 2 and {a.policy_version for a in final} == {4}
    assert not await service.control.finish_evaluation(0.01)  # still out: the wait is bounded
    for a in final:
        await service.handle(trajectory(service, a, "SUCCESS", version=4))
    assert await service.control.finish_evaluation(1.0)
    result = evaluation.take_result()
    assert (result["eval_success"], result["eval_step"], result["eval_policy_version"]) == (1.0, 12, 4)


async def test_a_run_stopping_as_solved_makes_the_round_of_its_last_weights_the_final_one():
    """RoundControl.start_final_evaluation (learner.train.loop.TrainingLoop.evaluate_final_weights): a round of
    the final weights starts and goes out to the requests waiting; one of these weights already running or complete
    and not yet recorded is kept; an older one still running gives way; eval.final_timeout_s = 0 starts none."""
    service = make_service(every_steps=4, repeats=1, final_step=80, lockstep=True)  # no training handed out
    evaluation = service.evaluation
    await hello(service, "a", 16)
    await trained(service, 4, 2)  # a round of step 4 starts (due)
    assert await service.control.start_final_evaluation() is False and evaluation.round.step == 4  # these weights: kept
    assert [a.evaluation for a in await ask(service, 3)] == [True, True]  # its 2 episodes; the third request waits
    await trained(service, 6, 3)  # the run stops as solved after step 6: the round of step 4 gives way
    assert await service.control.start_final_evaluation() is True
    assert (evaluation.round.step, evaluation.round.version) == (6, 3)
    assert service.state.totals["eval_rounds_abandoned"] == 1
    handed = [m for m in sent(service) if isinstance(m, Assignment)]
    assert [(a.evaluation, a.policy_version) for a in handed] == [(True, 3)]  # to the request that waited
    handed += await ask(service, 1, first=10)
    for a in handed:
        await service.handle(trajectory(service, a, "SUCCESS", version=3))
    # complete, not yet taken
    assert evaluation.round is None and await service.control.start_final_evaluation() is False
    assert evaluation.take_result()["eval_policy_version"] == 3

    off = make_service(repeats=1, final_timeout_s=0.0)
    await trained(off, 2, 1)
    assert await off.control.start_final_evaluation() is False and off.evaluation.round is None


async def test_an_episode_of_a_silent_actor_is_handed_out_again():
    service = make_service(repeats=1)
    await hello(service, "a", 4)
    await service.control.begin_evaluation()
    first = await ask(service, 2)
    service.peers.actors["a"] -= 3600  # "a" has been silent for an hour
    await service.peers.forget_silent_peers()
    assert len(service.evaluation.round.waiting) == 2 and not service.evaluation.round.running
    await hello(service, "b", 4)
    await service.handle(Envelope(WorkRequest("b-r0", "b", session=service.peers.sessions.latest("b")), "b"))
    again = [m for m in sent(service) if isinstance(m, Assignment)]
    assert again[0].evaluation and (again[0].group_id, again[0].rollout_index) in {
        (a.group_id, a.rollout_index) for a in first}


async def test_lockstep_hands_out_evaluation_episodes_between_rounds():
    service = make_service(repeats=1, lockstep=True)
    await hello(service, "a", 8)
    await service.control.begin_evaluation()
    handed = await ask(service, 3)
    assert [a.evaluation for a in handed] == [True, True]  # no rollout batch is open: training waits
    await service.control.open_round(1)
    handed = [m for m in sent(service) if isinstance(m, Assignment)]
    assert [a.task["id"] for a in handed] == [TRAIN.id]


def test_the_eval_task_set_is_a_folder_a_family_or_a_split_and_a_bad_one_names_the_key(tmp_path):
    split = tmp_path / "held.json"
    split.write_text(json.dumps({"grid4": ["grid4-blue", "grid4-yellow"]}))
    config = load_config(None, [f"eval.split={split}"])
    assert [t.id for t in evaluation_tasks(config)] == ["grid4-blue", "grid4-yellow"]
    assert {t.id for t in evaluation_tasks(load_config(None, ["eval.tasks=grid4"]))} >= {"grid4-red", "grid4-blue"}
    assert evaluation_tasks(load_config()) == []  # no [eval]: no evaluation
    split.write_text(json.dumps({"grid4": ["grid4-blue", "grid4-nonesuch"]}))
    with pytest.raises(ConfigError, match=r"eval\.tasks = '', eval\.split = .*grid4-nonesuch"):
        evaluation_tasks(config)
    with pytest.raises(ConfigError, match="eval.tasks = 'no-such-family'"):
        evaluation_tasks(load_config(None, ["eval.tasks=no-such-family"]))
