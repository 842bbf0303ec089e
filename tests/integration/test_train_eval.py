"""Evaluation during training, end to end: a short `arpo run` (real arpo-serve, learner, actors, ZeroMQ and
desktops) trains on grid4-green and evaluates a held-out split of two other grid4 tasks before the first optimizer
step, at every 2 steps and on the final weights, on either schedule. metrics.jsonl and TensorBoard carry the
rounds; no evaluation episode reaches training's statistics."""

import json
import re
import subprocess
import sys

import pytest

from actors import ActorConfig, DesktopEnv, EpisodeRunner, load_task
from arpo_async.inference_client import Generation
from arpo_async.messages import Assignment
from arpo_async.metrics import read_metrics
from arpo_async.model.inputs import PromptEncoder
from learner.run import PHASES
from tests.integration.test_run import run_containers
from tests.unit.test_tensorboard_metrics import read_tensorboard

pytestmark = pytest.mark.docker

HELD_OUT = ["grid4-blue", "grid4-yellow"]
REPEATS = 2


@pytest.mark.parametrize("schedule", ["async", "lockstep"])
def test_a_run_evaluates_its_initial_and_final_weights_on_a_held_out_split(tmp_path, desktop_image, tiny_model,
                                                                           schedule):
    split = tmp_path / "held-out.json"
    split.write_text(json.dumps({"grid4": HELD_OUT}))
    run_dir = tmp_path / "evaluated"
    proc = subprocess.run(
        [sys.executable, "-m", "arpo_cli.cli", "run", "--out", str(run_dir), "--model", str(tiny_model),
         "--set", "serve.port=31797", "--set", 'actors.inference_urls=["http://127.0.0.1:31797"]',
         "--set", "transport.endpoint=tcp://127.0.0.1:31798", "--set", "actors.actors=4",
         "--set", 'learner.task_ids=["grid4-green"]', "--set", "learner.steps=4",
         "--set", f"learner.schedule={schedule}",
         "--set", 'actors.grammar_actions=["click"]', "--set", "actors.max_steps=1",
         "--set", "actors.max_thought_chars=1", "--set", f'eval.split="{split}"', "--set", "eval.every_steps=2",
         "--set", f"eval.repeats={REPEATS}", "--set", "eval.temperature=1.0", "--set", "eval.max_steps=1"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    rounds = [r for r in records if "eval_success" in r]
    episodes = REPEATS * len(HELD_OUT)
    initial = [r for r in rounds if r["eval_step"] == 0]
    assert initial and initial[0]["eval_policy_version"] == 0 and initial[0]["eval_episodes"] == episodes
    final = records[-1]  # the last record waits for the round on the final weights
    assert (final["eval_step"], final["eval_policy_version"], final["eval_episodes"]) == (4, 4, episodes)
    for r in rounds:
        assert 0.0 <= r["eval_success"] <= 1.0 and set(r["eval_task_success"]) == set(HELD_OUT)
        assert r["eval_errors"] == 0  # the desktops stayed up
    for r in records:  # evaluation episodes never reach training's statistics
        assert set(r["task_trajectories"]) == {"grid4-green"} and set(r["task_success"]) == {"grid4-green"}
    status = json.loads((run_dir / "status.json").read_text())
    assert status["totals"]["eval_trajectories"] >= 2 * episodes
    assert status["totals"]["trajectories"] == sum(status["outcomes"].values())  # training's only
    scalars = read_tensorboard(run_dir / "tb")
    assert scalars["eval_success"] and scalars["eval_policy_version"][4] == 4.0
    assert all(f"eval_task_success/{task}" in scalars for task in HELD_OUT)
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert "waiting up to 600 s for the evaluation round of step 4" in learner_log
    # the final evaluation is a phase of its own, after training, timed in the log and in status.json
    logged = re.findall(r"\bphase (\w+): [0-9.]+ s$", learner_log, re.MULTILINE)
    assert logged == list(PHASES), logged
    assert list(status["phase_s"]) == list(PHASES[:len(status["phase_s"])]) and "final_evaluation" in status["phase_s"]
    assert run_containers(run_dir) == []


async def test_an_episode_runs_with_its_assignments_step_budget_and_temperature(tiny_model):
    """An evaluation Assignment's max_steps and temperature override the actor's own; a training one (their
    defaults) keeps them. The policy waits at every step, so each episode runs to its step budget."""
    config = ActorConfig(max_steps=1, temperature=1.0, constrained=True, grammar_actions=("click", "wait"))
    encoder = PromptEncoder(tiny_model)
    calls: list[dict] = []

    async def policy(*, input_ids, images, sampling_params, rid, episode_id):
        calls.append(dict(sampling_params))
        reply = "Thought: x\nAction: wait()"
        output_ids = encoder.tokenize(reply) + [encoder.eos_token_ids[0]]
        return Generation(text=reply, output_ids=output_ids, logprobs=[-0.5] * len(output_ids), weight_version=0,
                          token_versions=[0] * len(output_ids), finish_reason="stop", prompt_tokens=0, latency_s=0.0)

    runner = EpisodeRunner(encoder, policy, config)
    task = load_task("grid4-red").to_dict()
    async with DesktopEnv(config) as env:
        held_out = await runner.run(await env.reset_desktop(), Assignment(
            "r0", task, "L-e0-0-grid4-red", 0, 0, evaluation=True, max_steps=3, temperature=0.0), "a")
        evaluated = calls[:]
        calls.clear()
        trained = await runner.run(await env.reset_desktop(), Assignment("r1", task, "L-g0-grid4-red", 0, 0), "a")
    assert len(held_out.steps) == 3 and held_out.outcome == "TRUNCATED", (held_out.outcome, held_out.error)
    assert [c["temperature"] for c in evaluated] == [0.0] * 3 and all(c["regex"] for c in evaluated)
    assert len(trained.steps) == 1 and [c["temperature"] for c in calls] == [1.0]
    assert runner.sampling_params["temperature"] == 1.0  # the runner's own settings are untouched
