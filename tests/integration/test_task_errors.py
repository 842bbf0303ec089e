"""A task's fault stays in its episode (issue 24 item 1): the real EpisodeRunner and ControllerClient against a
real desktop, and against a real HTTP server that answers every route with hostile JSON.

Every case must end with a trajectory, never an exception out of ``EpisodeRunner.run``: the named ones from the
issue (an ``execute`` whose command is 5, ``exact_match`` with an option it does not take, a controller answering
``{"status": "error", "message": 5}``) as TASK_ERROR or ENV_ERROR carrying the error's type and message (a
parameter of the wrong type is refused when the task loads in the actor, a TaskFormatError), and a seeded fuzz of
a few hundred setup, getter, metric and controller-answer variations with zero escapes.
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
import secrets
from pathlib import Path

import pytest
from aiohttp import web

from actors import ActorConfig, EpisodeRunner, load_task
from actors.desktop.controller_client import ControllerClient
from arpo_async import codec
from arpo_async.inference_client import PolicyClient, RetryPolicy
from arpo_async.messages import Assignment, Outcome
from arpo_async.model.inputs import PromptEncoder
from tests.support import start_http

HOSTILE_VALUES = [5, -1, 1e308, None, True, [], {}, [5], {"a": 5}, "", "x" * 5000, [None, 1], {"o": 5}]
"""Values a careless task author or a broken controller might put where another type belongs."""

SETUP_BASES = [
    {"type": "execute", "parameters": {"command": ["true"], "shell": False}},
    {"type": "execute", "parameters": {"command": "true", "shell": True, "until": {"returncode": 0}, "timeout": 2}},
    {"type": "command", "parameters": {"command": ["true"]}},
    {"type": "launch", "parameters": {"command": ["true"], "shell": False}},
    {"type": "activate_window", "parameters": {"window_name": "nothing", "strict": False, "by_class": False}},
    {"type": "close_window", "parameters": {"window_name": "nothing", "strict": False, "by_class": False}},
    {"type": "download", "parameters": {"files": [{"url": "not a url", "path": "/tmp/f"}]}},
    {"type": "update_browse_history", "parameters": {"history": [{"url": "http://a", "title": "a",
                                                                  "visit_time_from_now_in_seconds": 5}]}},
]
RESULT_BASES = [
    {"type": "vm_command_line", "command": "echo hi", "shell": True},
    {"type": "vm_file", "path": "/tmp/none", "dest": "none"},
    {"type": "rule", "rules": {"expected": "hi"}},
    {"type": "list_directory", "path": "/tmp"},
]


def _mutations(base: dict, rng: random.Random, n: int) -> list[dict]:
    """``n`` copies of ``base``, each with one (possibly nested) value replaced by a hostile one."""
    paths: list[list] = []

    def walk(node, path):
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            if key != "type":
                paths.append([*path, key])
                walk(value, [*path, key])

    walk(base, [])
    out = []
    for _ in range(n):
        case, path = copy.deepcopy(base), rng.choice(paths)
        node = case
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = copy.deepcopy(rng.choice(HOSTILE_VALUES))
        out.append(case)
    return out


def fuzz_tasks(seed: int = 0, per_base: int = 14) -> list[dict]:
    """Seeded variations of the built-in grid4-green task: hostile setup steps, result getters and metric
    options (about 200). The getter and metric variations keep only the task's first setup step (removing the
    app's result and layout files): nothing clicks in these episodes, so the getters read what they would with
    the app open, without starting one more app (and waiting for its window) per variation."""
    rng, green = random.Random(seed), load_task("grid4-green").to_dict()
    no_app = {**green, "config": green["config"][:1]}
    tasks = []
    for base in SETUP_BASES:
        tasks += [{**green, "config": [step]} for step in _mutations(base, rng, per_base)]
    for base in RESULT_BASES:
        tasks += [{**no_app, "evaluator": {**green["evaluator"], "result": getter}}
                  for getter in _mutations(base, rng, per_base)]
    for value in HOSTILE_VALUES:
        tasks.append({**no_app, "evaluator": {**green["evaluator"], "options": value}})
        tasks.append({**no_app, "evaluator": {**green["evaluator"], "expected": {"type": "rule", "rules": value}}})
    return tasks


async def finish(**_kw) -> str:
    """A policy that says it is done at once, so the evaluator's getters and metric always run."""
    return "Action: finished(content='')"


FUZZ_SETUP_TIMEOUT_S = 2.0
"""The fuzz's deadline for a setup and for an evaluation: a window that never shows and an ``until`` never met
(about a dozen variations) end there as they would at the named cases' 5 s (their own waits are 30 s and 9.3 s),
in a fraction of the time; the other variations end on their own well before it."""


def runner(tiny_model: Path, setup_timeout_s: float = 5.0) -> EpisodeRunner:
    return EpisodeRunner(PromptEncoder(tiny_model), finish, ActorConfig(max_steps=1, setup_timeout_s=setup_timeout_s))


async def run_all(run: EpisodeRunner, controller: ControllerClient, tasks: list[dict]) -> list:
    """Each task's trajectory, or the exception that escaped ``run`` for it (there must be none)."""
    results = []
    for i, task in enumerate(tasks):
        try:
            results.append(await run.run(controller, Assignment(f"r{i}", task, f"g{i}", 0, 0), "fuzz"))
        except Exception as escaped:  # noqa: BLE001 - collected for the assertion
            results.append(escaped)
    return results


@pytest.mark.docker
async def test_named_task_faults_end_as_task_error_and_the_fuzz_has_no_escape(fleet, tiny_model):
    green = load_task("grid4-green").to_dict()
    named = [
        {**green, "config": [{"type": "execute", "parameters": {"command": 5}}]},
        {**green, "evaluator": {**green["evaluator"], "options": {"o": 5}}},
        {**green, "config": [{"type": "launch", "parameters": {"command": 5}}]},
        {**green, "evaluator": {**green["evaluator"], "expected": {"type": "rule", "rules": [1, 2]}}},
        {**green, "config": [{"type": "execute", "parameters": {"command": "true", "until": 5}}]},
    ]
    desktop = await fleet.start()
    try:
        run = runner(tiny_model)
        results = await run_all(run, desktop.controller, named)
        assert all(not isinstance(r, BaseException) for r in results), results
        assert [r.outcome for r in results[:2]] == [Outcome.TASK_ERROR] * 2, [(r.outcome, r.error) for r in results]
        assert results[0].error.startswith("TaskFormatError") and "parameters.command" in results[0].error  # at load
        assert results[1].error.startswith("TypeError") and "'o'" in results[1].error  # in the metric
        assert all(not r.outcome.trainable and r.error for r in results)
        fuzz = fuzz_tasks()
        assert len(fuzz) >= 150
        fuzz_run = runner(tiny_model, FUZZ_SETUP_TIMEOUT_S)
        escaped = [(t, r) for t, r in zip(fuzz, await run_all(fuzz_run, desktop.controller, fuzz))
                   if isinstance(r, BaseException)]
        assert escaped == []
        after = await run.run(desktop.controller, Assignment("ok", green, "g", 0, 0), "fuzz")
        assert after.outcome == Outcome.FAILURE, (after.outcome, after.error)  # the desktop and runner go on
    finally:
        await fleet.remove(desktop)


HOSTILE_ANSWERS = [
    {"status": "error", "message": 5}, {"status": "error"}, {"output": 5, "returncode": "a"}, [], "x", 5, None,
    {"output": None, "error": None, "returncode": None}, {"width": "a", "height": None}, {"status": 5},
    {"status": "error", "message": "\ud800"}, {"output": "\udfff", "returncode": 0}, {"\ud800": "\ud800"},
]
"""The last three spell lone surrogates in JSON (issue 39 item 1): the trajectory must still encode."""


async def test_a_controller_answering_hostile_json_never_kills_the_episode(tmp_path, tiny_model):
    """Every route of a real HTTP server on a Unix socket answers one of HOSTILE_ANSWERS (or a non-JSON body, or
    a 500): every episode ends with a non-trainable outcome carrying the error, none raises."""
    answers = [*HOSTILE_ANSWERS, b"\xff not json", b"[" * 100_000, (500, {"status": "error", "message": 5})]
    chosen: dict[str, object] = {}

    async def answer(_request: web.Request) -> web.Response:
        body = chosen["answer"]
        status, body = body if isinstance(body, tuple) else (200, body)
        if isinstance(body, bytes):
            return web.Response(status=status, body=body, content_type="application/json")
        return web.Response(status=status, text=json.dumps(body), content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    web_runner = web.AppRunner(app)
    await web_runner.setup()
    socket_path = str(tmp_path / f"c-{secrets.token_hex(3)}.sock")
    await web.UnixSite(web_runner, socket_path).start()
    controller = ControllerClient(socket_path, timeout=5.0)
    try:
        run, green = runner(tiny_model), load_task("grid4-green").to_dict()
        for i, body in enumerate(answers):
            chosen["answer"] = body
            try:
                traj = await asyncio.wait_for(run.run(controller, Assignment(f"r{i}", green, "g", 0, 0), "x"), 60)
            except Exception as escaped:  # noqa: BLE001
                pytest.fail(f"answer {body!r}: {type(escaped).__name__}: {escaped} escaped the episode")
            assert not traj.outcome.trainable and traj.error, (body, traj.outcome, traj.error)
            codec.encode(traj)  # every text it carries can travel (a WireError here fails the test)
    finally:
        await controller.close()
        await web_runner.cleanup()


@pytest.mark.docker
async def test_a_reply_with_lone_surrogates_still_makes_a_trajectory_that_encodes(fleet, tiny_model):
    """Issue 39 item 1: an inference server's reply text with lone surrogates (as a /generate body may spell
    them) is kept in the step, escaped, and the trajectory encodes; the episode ends as the reply says."""
    async def odd(**_kw) -> str:
        return "Thought: \ud800\udfff\nAction: finished(content='\ud800')"

    desktop = await fleet.start()
    try:
        run = EpisodeRunner(PromptEncoder(tiny_model), odd, ActorConfig(max_steps=1, setup_timeout_s=5.0))
        traj = await run.run(desktop.controller, Assignment("r", load_task("grid4-green").to_dict(), "g", 0, 0), "x")
        assert traj.outcome == Outcome.FAILURE, (traj.outcome, traj.error)
        assert "\\ud800" in traj.steps[0].text
        codec.decode(codec.encode(traj), max_bytes=1 << 26)
    finally:
        await fleet.remove(desktop)


SERVER_FAULTS = {
    "infinite-logprob": b'{"text": "x", "meta_info": {"weight_version": "0", "prompt_tokens": 5, "finish_reason": '
                        b'{"type": "stop"}, "output_token_logprobs": [[Infinity, 5, null]]}}',
    "huge-version": b'{"text": "x", "meta_info": {"weight_version": 1e400, "prompt_tokens": 5, "finish_reason": '
                    b'{"type": "stop"}, "output_token_logprobs": [[-0.1, 5, null]]}}',
    "huge-token": b'{"text": "x", "meta_info": {"weight_version": "0", "prompt_tokens": 5, "finish_reason": '
                  b'{"type": "stop"}, "output_token_logprobs": [[-0.1, 1e400, null]]}}',
    "huge-int-token": b'{"text": "x", "meta_info": {"weight_version": "0", "prompt_tokens": 5, "finish_reason": '
                      b'{"type": "stop"}, "output_token_logprobs": [[-0.1, ' + b"9" * 30 + b', null]]}}',
    "not-utf8": b'{"text": "\xff\xfe", "meta_info": \xff}',
    "deep": b"[" * 100_000 + b"]" * 100_000,
}
"""/generate answers an inference server should never give (issue 39 item 9): each is the server's fault."""


@pytest.mark.docker
async def test_an_inference_servers_bad_answers_abort_the_episode_and_are_counted_against_it(fleet, tiny_model):
    """Issue 39 item 9: a /generate answer with Infinity, 1e400 or 10^30 where numbers belong, a body that is not
    UTF-8, or JSON nested 100,000 deep ends the episode ABORTED (the server's fault: never counted toward the
    task's task_error_limit), and the client counts it against that server."""
    async def answer(request: web.Request) -> web.Response:
        return web.Response(body=SERVER_FAULTS[request.match_info["kind"]], content_type="application/json")

    app = web.Application()
    app.router.add_post("/{kind}/generate", answer)
    web_runner, base = await start_http(app)
    desktop = await fleet.start()
    green = load_task("grid4-green").to_dict()
    try:
        for kind in SERVER_FAULTS:
            url = f"{base}/{kind}"
            async with PolicyClient([url], retry=RetryPolicy(attempts=1)) as client:
                run = EpisodeRunner(PromptEncoder(tiny_model), client, ActorConfig(max_steps=1, setup_timeout_s=5.0))
                traj = await run.run(desktop.controller, Assignment(f"r-{kind}", green, "g", 0, 0), "x")
                assert traj.outcome == Outcome.ABORTED, (kind, traj.outcome, traj.error)
                assert "PolicyRequestError" in traj.error and url in traj.error, (kind, traj.error)
                assert client.server_faults == {url: 1}
                codec.encode(traj)
    finally:
        await fleet.remove(desktop)
        await web_runner.cleanup()


@pytest.mark.docker
async def test_a_program_the_image_lacks_is_the_tasks_fault_and_the_desktop_stays(fleet, tiny_model):
    """A vs_code task in an image without VS Code ended ENV_ERROR ('not installed in this desktop image'): each
    rollout was handed out again learner.rollout_retries times on a fresh desktop and never counted towards
    learner.task_error_limit, though every episode of the task fails alike. A setup step (launch, execute) or a
    postconfig step whose program the image lacks (TaskSetupError kind app_missing) is now TASK_ERROR; a setup
    step that fails otherwise stays ENV_ERROR, and the desktop serves the next episode."""
    green = load_task("grid4-green").to_dict()
    tasks = [{**green, "config": [{"type": "launch", "parameters": {"command": ["no-such-app-arpo", "/tmp"]}}]},
             {**green, "config": [{"type": "execute", "parameters": {"command": ["no-such-app-arpo", "--x"]}}]},
             {**green, "evaluator": {**green["evaluator"], "postconfig": [
                 {"type": "execute", "parameters": {"command": ["no-such-app-arpo"]}}]}},
             {**green, "config": [{"type": "execute", "parameters": {"command": "exit 3", "shell": True,
                                                                     "until": {"returncode": 0}}}]},
             green]
    desktop = await fleet.start()
    results = await run_all(runner(tiny_model), desktop.controller, tasks)
    got = [(r.outcome, r.error) for r in results]
    assert [r.outcome for r in results] == [Outcome.TASK_ERROR] * 3 + [Outcome.ENV_ERROR, Outcome.FAILURE], got
    assert all("TaskSetupError" in r.error and "no-such-app-arpo" in r.error for r in results[:3]), got
