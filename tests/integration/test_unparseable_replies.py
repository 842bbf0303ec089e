"""An unparseable or empty reply can never win an infeasible task (issue 50 item 3), on a real desktop.

The task: the built-in grid4-red app with OSWorld's ``infeasible`` evaluator, so the agent wins only by saying FAIL
(UI-TARS ``call_user()``). On main, the reply "I am not sure what to do." ended the episode as FAIL and scored 1.0.
Each episode is the real EpisodeRunner with a real async callable policy (actors.policy.as_policy) on one real
desktop, reset in place between episodes; then the same through DesktopEnv, the embedding API.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from actors import DesktopEnv, EpisodeRunner
from actors.uitars.actions import ActionParseError
from arpo_async.config import ActorConfig
from arpo_async.messages import Outcome
from arpo_async.model.inputs import PromptEncoder
from arpo_async.tasks import Task, load_tasks

pytestmark = pytest.mark.docker

GARBAGE = "I am not sure what to do."
CALL_USER = "Thought: there is no purple button\nAction: call_user()"


def infeasible_task() -> Task:
    grid = {t.id: t for t in load_tasks()}["grid4-red"]
    return Task.from_dict({"id": "infeasible-purple", "instruction": "Click the Purple button.",
                           "config": grid.raw["config"], "evaluator": {"func": "infeasible"}})


def script(*replies: str):
    """An async policy answering ``replies`` in order, the last one again once they run out; ``asked`` counts."""
    async def policy(*, input_ids, images, sampling_params, rid, episode_id):
        policy.asked += 1
        return replies[min(policy.asked, len(replies)) - 1]
    policy.asked = 0
    return policy


async def test_unparseable_and_empty_replies_score_zero_and_only_call_user_wins(tiny_model, desktop_image):
    task, encoder = infeasible_task(), PromptEncoder(tiny_model)
    config = ActorConfig(image=desktop_image, max_steps=3, temperature=0.0, reply_retries=2)
    async with DesktopEnv(config) as env:
        async def episode(policy, **changes):
            runner = EpisodeRunner(encoder, policy, dataclasses.replace(config, **changes))
            return await runner.run_task(await env.reset_desktop(), task, desktop=env.desktop.name)

        garbage = script(GARBAGE, "", GARBAGE)  # `arpo eval`'s rule: 3 tries, none parses
        traj = await episode(garbage)
        assert (traj.outcome, traj.score, traj.format_ok, garbage.asked) == (Outcome.POLICY_ERROR, 0.0, False, 3)
        assert len(traj.steps) == 1 and traj.steps[0].text == GARBAGE and traj.steps[0].action == ""
        assert "ActionParseError" in traj.error and "try 3 of 3" in traj.error, traj.error

        empty = script("")  # training's rule (no re-ask): an empty reply ends the episode at once
        traj = await episode(empty, reply_retries=0)
        assert (traj.outcome, traj.score, traj.format_ok, empty.asked) == (Outcome.POLICY_ERROR, 0.0, False, 1)

        slip = script(GARBAGE, CALL_USER)  # one slip, then the agent says FAIL: that wins, and is well formed
        traj = await episode(slip)
        assert (traj.outcome, traj.score, traj.format_ok, slip.asked) == (Outcome.SUCCESS, 1.0, True, 2)
        assert [s.text for s in traj.steps] == [CALL_USER] and traj.steps[0].action == "fail()"

        # DesktopEnv: a reply that does not parse is refused, ends nothing and wins nothing; call_user() wins
        await env.reset(task)
        for reply in (GARBAGE, ""):
            with pytest.raises(ActionParseError):
                await env.step(reply)
        assert await env.evaluate() == 0.0
        assert (await env.step("call_user()")).done and await env.evaluate() == 1.0


async def test_arpo_eval_asks_three_times_and_scores_an_unreadable_agent_zero(tiny_model, desktop_image, tmp_path):
    from actors.eval import evaluate
    from actors.eval.results import read_records
    from arpo_async.config import load_config

    (tmp_path / "tasks" / "probe").mkdir(parents=True)
    (tmp_path / "tasks" / "probe" / "infeasible-purple.json").write_text(json.dumps(infeasible_task().raw))
    config = load_config(None, [f"model={str(tiny_model)!r}", f"actors.image={desktop_image!r}"])
    garbage = script(GARBAGE)
    await evaluate(garbage, str(tmp_path / "tasks"), desktops=1, max_steps=3, config=config, out=tmp_path / "out")
    assert garbage.asked == 3  # `arpo eval`'s default: OSWorld's UI-TARS agent's 3 tries
    (record,) = read_records(tmp_path / "out").values()
    assert (record.task_id, record.outcome, record.score, record.steps) == ("infeasible-purple", "POLICY_ERROR", 0.0, 1)
