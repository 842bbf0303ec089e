"""Replies the agent cannot parse (issue 50 item 3): how many times a step asks again, what it keeps, how the
episode ends and how it is scored.

The policy is a real async callable (actors.policy.as_policy) that answers a script and records every request; the
runner is the real EpisodeRunner on the tiny policy's real prompt encoder. No desktop here: the episodes on a
desktop are in tests/integration/test_unparseable_replies.py.
"""

from __future__ import annotations

import pytest

from actors.desktop.controller_client import ControllerClient
from actors.episode import REASK_TEMPERATURE, EpisodeRunner, episode_outcome, reask_params
from actors.evaluation import FAIL_ACTION, PARSE_ERROR_ACTION, evaluate
from actors.eval.runner import DEFAULT_REPLY_RETRIES, EvalSettings
from arpo_async.config import ActorConfig, ConfigError, RunConfig, load_config
from arpo_async.messages import Outcome, Trajectory
from arpo_async.model.inputs import PromptEncoder
from arpo_async.tasks import Task

GARBAGE = "I am not sure what to do."
CALL_USER = "Thought: impossible\nAction: call_user()"


class Script:
    """An async policy answering ``replies`` in order (the last one again when they run out); keeps each request's
    sampling params and rid."""

    def __init__(self, *replies: str) -> None:
        self.replies, self.requests = list(replies), []

    async def __call__(self, *, input_ids, images, sampling_params, rid, episode_id):
        self.requests.append((dict(sampling_params), rid))
        return self.replies[min(len(self.requests), len(self.replies)) - 1]


@pytest.fixture(scope="module")
def encoder(tiny_model) -> PromptEncoder:
    return PromptEncoder(tiny_model)


def trajectory() -> Trajectory:
    return Trajectory("t1", "local", "task", "g", 0, Outcome.ABORTED, 0.0, True, [], [])


async def ask(encoder: PromptEncoder, policy: Script, retries: int, temperature: float = 0.0):
    runner = EpisodeRunner(encoder, policy, ActorConfig(reply_retries=retries, temperature=temperature,
                                                        constrained=False))
    traj = trajectory()
    gen, parsed = await runner._ask(traj, [1, 2, 3], [b"png"], runner.sampling_params)
    return traj, gen, parsed


@pytest.mark.parametrize("retries", [0, 1, 2, 5])
async def test_a_reply_that_never_parses_is_asked_retries_plus_one_times_then_ends_the_step(encoder, retries):
    policy = Script(GARBAGE, "", "Action: click(start_box='(5000')", GARBAGE)
    traj, gen, parsed = await ask(encoder, policy, retries)
    assert parsed is None and len(policy.requests) == retries + 1
    assert traj.format_ok is False and traj.error.startswith("ActionParseError: ")
    assert gen.text == policy.replies[min(retries, len(policy.replies) - 1)]  # the last try is the one kept
    assert (f"try {retries + 1} of {retries + 1}" in traj.error) == (retries > 0)
    assert len({rid for _, rid in policy.requests}) == retries + 1  # every try is a request of its own
    # the first try samples as the step does (greedy here); each re-ask at OSWorld's temperature 1
    assert [p["temperature"] for p, _ in policy.requests] == [0.0] + [REASK_TEMPERATURE] * retries
    assert ("reask_s" in traj.timings) == (retries > 0) and traj.steps == []


@pytest.mark.parametrize("first", [GARBAGE, "", "   \n", "Thought: hm\nAction: fly(to='moon')"])
async def test_the_first_reply_that_parses_is_kept_and_the_episode_stays_well_formed(encoder, first):
    policy = Script(first, CALL_USER)
    traj, gen, parsed = await ask(encoder, policy, retries=2)
    assert len(policy.requests) == 2 and gen.text == CALL_USER and parsed.action.kind == "fail"
    assert traj.format_ok is True and traj.error == "" and traj.timings["reask_s"] >= 0.0


async def test_a_reply_that_parses_at_once_asks_nothing_more(encoder):
    policy = Script(CALL_USER, GARBAGE)
    traj, gen, parsed = await ask(encoder, policy, retries=2)
    assert len(policy.requests) == 1 and parsed.action.kind == "fail" and "reask_s" not in traj.timings


async def test_training_default_asks_once_and_reasks_keep_a_hotter_temperature(encoder):
    assert ActorConfig().reply_retries == 0  # ARPO's rule: the first unparseable reply ends the episode
    policy = Script("")
    traj, _, parsed = await ask(encoder, policy, ActorConfig().reply_retries, temperature=1.0)
    assert parsed is None and len(policy.requests) == 1 and traj.format_ok is False
    assert reask_params({"temperature": 1.5, "regex": "x"}) == {"temperature": 1.5, "regex": "x"}
    assert reask_params({"max_new_tokens": 8}) == {"max_new_tokens": 8, "temperature": 1.0}


def test_arpo_eval_asks_three_times_in_all_and_refuses_a_bad_count():
    assert DEFAULT_REPLY_RETRIES == 2 and EvalSettings().reply_retries == 2
    assert EvalSettings().apply(RunConfig()).actors.reply_retries == 2
    assert EvalSettings(reply_retries=0).apply(RunConfig()).actors.reply_retries == 0
    for bad in (-1, 11):
        with pytest.raises(ValueError, match="reply_retries"):
            EvalSettings(reply_retries=bad)
        with pytest.raises(ConfigError, match="reply_retries"):
            load_config(None, [f"actors.reply_retries={bad}"])


@pytest.fixture
async def nowhere():
    client = ControllerClient("/nonexistent/arpo/controller.sock", timeout=2)
    yield client
    await client.close()


async def test_an_unparseable_end_scores_zero_on_every_task_and_only_fail_wins_an_infeasible_one(nowhere):
    infeasible = Task.from_dict({"id": "i", "instruction": "x", "config": [], "evaluator": {"func": "infeasible"}})
    feasible = Task.from_dict({"id": "f", "instruction": "x", "config": [], "evaluator": {
        "func": "exact_match", "result": {"type": "rule", "rules": "Red"},
        "expected": {"type": "rule", "rules": {"expected": "Red"}}}})
    assert await evaluate(nowhere, infeasible, PARSE_ERROR_ACTION) == 0.0
    assert await evaluate(nowhere, infeasible, FAIL_ACTION) == 1.0
    assert await evaluate(nowhere, feasible, "DONE") == 1.0  # the metric would pass ...
    assert await evaluate(nowhere, feasible, PARSE_ERROR_ACTION) == 0.0  # ... but nobody said done
    assert episode_outcome(0.0, False, PARSE_ERROR_ACTION) is Outcome.POLICY_ERROR
