"""The embedding API against real desktops: DesktopEnv step by step, EpisodeRunner with a custom policy into
list and JSONL sinks, the scripted example run as a user runs it, and the embedding guide's code as written.

GUIDE_FILE (environment variable ARPO_EMBEDDING_GUIDE, default docs/guides/embedding.md) is the page whose section
"Using the desktops and actors from your own agent" is run.
"""
from __future__ import annotations

import asyncio
import inspect
import io
import json
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import aiodocker
import pytest
from PIL import Image

import actors
from actors import (ActorConfig, DesktopEnv, EpisodeRunner, JsonlSink, ListSink, Outcome, Policy, PolicyClient,
                    RetryPolicy)
from actors.desktop.controller_client import DesktopError
from actors.desktop.fleet import DesktopFleet
from actors.desktop.pool import DesktopPool
from actors.env_actor import EnvActor
from actors.policy import CallablePolicy, text_generation
from actors.uitars.actions import Action, ActionParseError
from arpo_async.messages import Assignment
from arpo_async.model.inputs import PromptEncoder
from arpo_async.tasks import TaskFormatError
from tests.support import labelled

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[2]
GUIDE_FILE = Path(os.environ.get("ARPO_EMBEDDING_GUIDE", ROOT / "docs" / "guides" / "embedding.md"))
SECTION = "## Using the desktops and actors from your own agent"
LAYOUT = "/tmp/arpo/layout.json"
RUN_DEADLINE_S = 300


async def button_centre(env: DesktopEnv, label: str) -> tuple[int, int]:
    """Screen centre of a button of the built-in button-grid app (its layout file, written before setup ends)."""
    layout = json.loads(await env.controller.get_file(LAYOUT))
    return layout[label]["cx"], layout[label]["cy"]


def png_size(data: bytes) -> tuple[int, int]:
    assert data.startswith(b"\x89PNG"), data[:8]
    return Image.open(io.BytesIO(data)).size


async def desktop_runs() -> set[str]:
    """The arpo.run labels of every desktop container on the engine."""
    async with aiodocker.Docker() as docker:
        found = await docker.containers.list(all="true", filters=json.dumps({"label": ["arpo.role=desktop"]}))
    return {(c["Labels"] or {}).get("arpo.run", "") for c in found}


# ---- defaults and exports -------------------------------------------------------------------------------

def test_library_defaults_are_the_run_config_defaults():
    cfg = ActorConfig()
    pool = inspect.signature(DesktopPool).parameters
    assert pool["max_episodes"].default == cfg.desktop_max_episodes
    assert pool["warm_spares"].default == cfg.warm_spares
    assert pool["start_attempts"].default == cfg.desktop_start_attempts
    assert inspect.signature(DesktopFleet).parameters["max_concurrent_starts"].default == cfg.max_concurrent_starts
    assert pool["health_interval_s"].default == cfg.desktop_health_interval_s
    assert RetryPolicy().attempts == cfg.policy_attempts and RetryPolicy().max_delay_s == cfg.policy_max_wait_s
    assert set(actors.__all__) <= set(dir(actors))
    for name in actors.__all__:
        assert getattr(actors, name) is not None
    assert isinstance(PolicyClient(["http://127.0.0.1:1"]), Policy)


async def test_callable_policy_adapts_async_functions_and_refuses_the_rest():
    async def replies(**kw):
        return "Action: finished()"

    gen = await CallablePolicy(replies).generate(input_ids=[1, 2, 3], images=[], sampling_params={}, rid="r",
                                                 episode_id="e")
    assert gen.text == "Action: finished()" and gen.output_ids == [] and gen.prompt_tokens == 0  # no server counted

    async def generation(**kw):
        return text_generation("Action: wait()")

    assert (await CallablePolicy(generation).generate(input_ids=[], images=[], sampling_params={}, rid="r",
                                                      episode_id="e")).text == "Action: wait()"

    async def number(**kw):
        return 42

    with pytest.raises(TypeError, match="returned int"):
        await CallablePolicy(number).generate(input_ids=[], images=[], sampling_params={}, rid="r", episode_id="e")
    with pytest.raises(TypeError, match="async function"):
        CallablePolicy(lambda **kw: "Action: finished()")


# ---- DesktopEnv -----------------------------------------------------------------------------------------

async def test_desktop_env_reset_step_evaluate_and_removes_its_container():
    run_id = f"test-env-{secrets.token_hex(3)}"
    async with DesktopEnv(run_id=run_id) as env:
        assert len(await labelled(run_id)) == 1
        with pytest.raises(RuntimeError, match="reset"):
            await env.step("finished()")
        obs = await env.reset("grid4-green")
        assert obs.instruction == "Click the Green button." and obs.step == 0 and not obs.done
        assert obs.screen_size == (1280, 720) and png_size(obs.screenshot) == (1280, 720)
        assert await env.evaluate() == 0.0

        red, green = await button_centre(env, "Red"), await button_centre(env, "Green")
        obs = await env.step(Action("click", point=(float(red[0]), float(red[1]))))  # a structured action
        assert obs.step == 1 and not obs.done and obs.screenshot != b""
        assert await env.evaluate() == 0.0  # Red was clicked: the evaluator reads the app's result file
        with pytest.raises(ActionParseError):
            await env.step("click(nowhere)")
        obs = await env.step(f"click(start_box='({green[0]},{green[1]})')")  # a UI-TARS string, screen pixels
        assert await env.evaluate() == 1.0
        obs = await env.step("Thought: done.\nAction: finished(content='clicked')")
        assert obs.done and obs.step == 3
        with pytest.raises(RuntimeError, match="episode is over"):
            await env.step("wait()")
        assert await env.evaluate() == 1.0

        obs = await env.reset({**actors.load_task("grid4-red").to_dict()})  # a task dict; the desktop is reset
        assert obs.instruction == "Click the Red button." and obs.step == 0 and not obs.done
        assert await env.evaluate() == 0.0
        with pytest.raises(TaskFormatError, match="built-in"):
            await env.reset("no-such-task")
        assert len(await labelled(run_id)) == 1  # the in-place reset kept the container
    assert await labelled(run_id) == []


async def test_desktop_env_removes_its_container_when_the_block_raises():
    run_id = f"test-env-{secrets.token_hex(3)}"
    with pytest.raises(ZeroDivisionError):
        async with DesktopEnv(run_id=run_id) as env:
            await env.reset("grid4-blue")
            assert len(await labelled(run_id)) == 1
            1 / 0
    assert await labelled(run_id) == []
    with pytest.raises(DesktopError, match="arpo desktop build"):
        async with DesktopEnv(ActorConfig(image="arpo-desktop:no-such-tag")):
            pass


async def test_relative_coordinates_are_read_as_the_policy_writes_them():
    async with DesktopEnv(coordinates="relative1000") as env:
        await env.reset("grid4-yellow")
        x, y = await button_centre(env, "Yellow")
        await env.step(f"click(start_box='({x * 1000 // 1280},{y * 1000 // 720})')")
        assert await env.evaluate() == 1.0


# ---- EpisodeRunner without a learner ----------------------------------------------------------------------

async def test_custom_policy_drives_episode_runner_into_list_and_jsonl_sinks(tiny_model, tmp_path):
    config = ActorConfig(max_steps=4)  # relative1000 coordinates, constrained grammar: as the run config
    steps: dict[str, int] = {}

    async with DesktopEnv(config) as env:
        async def policy(*, input_ids, images, sampling_params, rid, episode_id):
            """Clicks the green button (read from the app's layout file), then says finished."""
            assert input_ids and images[-1].startswith(b"\x89PNG") and "regex" in sampling_params
            step = steps[episode_id] = steps.get(episode_id, -1) + 1
            if step > 0:
                return "Thought: done\nAction: finished()"
            x, y = await button_centre(env, "Green")
            return f"Thought: green\nAction: click(start_box='({x * 1000 // 1280},{y * 1000 // 720})')"

        runner = EpisodeRunner(PromptEncoder(tiny_model), policy, config)
        listed = ListSink()
        jsonl = JsonlSink(tmp_path / "out" / "trajectories.jsonl")
        for sink in (listed, listed, jsonl):
            traj = await runner.run_task(await env.reset_desktop(), "grid4-green", sink, desktop=env.desktop.name)
            assert traj.outcome == Outcome.SUCCESS.value and traj.score == 1.0, (traj.outcome, traj.error, traj.steps)
    assert len(listed) == 2 and len({t.trajectory_id for t in listed}) == 2
    for t in listed:
        assert [s.action.split("(")[0] for s in t.steps] == ["click", "finished"]
        assert t.task_id == "grid4-green" and t.group_id == "grid4-green" and t.screenshots
        assert all(len(s.output_ids) == 0 and s.text for s in t.steps)
        assert {"setup_s", "evaluate_s", "episode_s"} <= set(t.timings)
    (line,) = (tmp_path / "out" / "trajectories.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert record["outcome"] == "SUCCESS" and record["score"] == 1.0 and len(record["steps"]) == 2
    # the step's packed arrays are JSON lists (traj is the trajectory the JSONL sink took)
    assert record["steps"][0]["prompt_ids"] == traj.steps[0].prompt_ids.tolist() != []
    assert record["steps"][0]["output_ids"] == record["steps"][0]["logprobs"] == []
    assert record["screenshot_count"] == len(record["screenshots"]) >= 1
    for rel in record["screenshots"]:
        assert png_size((tmp_path / "out" / rel).read_bytes()) == (1280, 720)
    assert jsonl.count == 1


class QueueWork(ListSink):
    """A WorkSource without a learner: hands out the given assignments, then None; keeps what is submitted."""

    def __init__(self, assignments: list[Assignment]) -> None:
        super().__init__()
        self.actor_id, self.running, self._todo = "local", 0, list(assignments)

    async def request_work(self) -> Assignment | None:
        return self._todo.pop(0) if self._todo else None


async def test_env_actor_runs_from_a_work_source_without_a_learner(tiny_model, fleet):
    async def give_up(**kw):
        return "Action: call_user()"

    task = actors.load_task("grid4-red").to_dict()
    work = QueueWork([Assignment(f"r{i}", task, "g0", i, 0) for i in range(2)])
    runner = EpisodeRunner(PromptEncoder(tiny_model), give_up, ActorConfig(max_steps=2))
    async with DesktopPool(fleet, warm_spares=0) as pool:
        await EnvActor(0, work, pool, runner).run()
    assert [(t.rollout_index, t.outcome, t.score) for t in work] == [(0, "FAILURE", 0.0), (1, "FAILURE", 0.0)]
    assert work.running == 0 and all(t.actor_id == "local/0" and t.desktop for t in work)


# ---- as a user runs them -----------------------------------------------------------------------------------

def test_scripted_agent_example_solves_its_task():
    before = {r for r in _runs() if r.startswith("env-")}
    proc = subprocess.run([sys.executable, "examples/scripted_agent.py"], cwd=ROOT, capture_output=True,
                          text=True, timeout=RUN_DEADLINE_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "score 1.0" in proc.stdout, proc.stdout
    assert {r for r in _runs() if r.startswith("env-")} <= before  # its desktop is gone


def _runs() -> set[str]:
    return asyncio.run(desktop_runs())


def guide_blocks() -> list[str]:
    """The python code blocks of the embedding guide's section, in order."""
    text = GUIDE_FILE.read_text()
    if SECTION not in text:
        pytest.fail(f"{GUIDE_FILE} has no section {SECTION!r}")
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


def test_embedding_guide_runs_as_written(tiny_model, tmp_path):
    blocks = guide_blocks()
    assert len(blocks) == 2, blocks
    env_code, runner_code = blocks
    first = subprocess.run([sys.executable, "-c", env_code], cwd=tmp_path, capture_output=True, text=True,
                           timeout=RUN_DEADLINE_S, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert first.returncode == 0, first.stderr
    assert "Click the Green button." in first.stdout and first.stdout.strip().endswith("score 1.0"), first.stdout
    assert "runs/tiny-model" in runner_code
    second = subprocess.run([sys.executable, "-c", runner_code.replace("runs/tiny-model", str(tiny_model))],
                            cwd=tmp_path, capture_output=True, text=True, timeout=RUN_DEADLINE_S,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert second.returncode == 0, second.stderr
    assert second.stdout.splitlines() == ["SUCCESS 1.0 ['click(960,168)', 'finished()']"] * 2, second.stdout
    (line,) = (tmp_path / "out" / "trajectories.jsonl").read_text().splitlines()
    assert json.loads(line)["outcome"] == "SUCCESS"
