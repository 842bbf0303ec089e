"""`arpo eval` and actors.eval.evaluate on real desktops: an oracle scores 1.0 on every built-in task and a
quitter 0.0 on one task of each family; errored tasks stay in the denominator with their reason; an interrupted
evaluation resumes to the report of an uninterrupted one; the command's Ctrl-C writes a report and --resume
finishes it; `arpo view` shows the episodes.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from actors.eval import evaluate
from actors.eval.results import read_records
from actors.oracle import OraclePolicy
from arpo_async.config import ConfigError, load_config
from arpo_async.model.inputs import PromptEncoder
from arpo_async.task_sets import load_task_set, runnable_tasks
from arpo_async.tasks import BUILTIN_DIR
from arpo_cli.cli import main as arpo_main
from tests.osworld_results import leaderboard_sum, show_result
from tests.support import until_sync

pytestmark = pytest.mark.docker

MAX_STEPS = 8
"""Enough for the longest oracle plan (form-contact: 5 actions, then finished)."""


async def finished_only(**_kw):
    """A policy that gives up at once: ``finished`` on the first step of every episode."""
    return "Thought: done\nAction: finished(content='done')"


@pytest.fixture(scope="module")
def eval_config(tiny_model, desktop_image):
    return load_config(None, [f"model={str(tiny_model)!r}", f"actors.image={desktop_image!r}"])


@pytest.fixture(scope="module")
def encoder(tiny_model):
    return PromptEncoder(tiny_model)


def _running(proc: subprocess.Popen) -> None:
    """Fail at once when ``proc`` exited (instead of waiting for the deadline)."""
    if proc.poll() is not None:
        raise AssertionError(f"arpo eval exited with {proc.returncode} before it was interrupted:\n"
                             f"{proc.stdout.read().decode()[-3000:]}")


def _comparable(report: dict) -> dict:
    """A report without what differs between two evaluations of the same episodes (timings, folder, and the
    provenance's sessions: their dates differ, and a resumed one has a session per run)."""
    kept = {k: v for k, v in report.items() if k not in ("throughput", "out", "provenance")}
    provenance = {k: v for k, v in report["provenance"].items() if k not in ("date", "sessions")}
    return {**kept, "provenance": provenance}


async def test_oracle_scores_one_on_every_builtin_task_and_a_quitter_zero(eval_config, encoder, tmp_path):
    builtin = runnable_tasks(load_task_set(None))
    oracle = await evaluate(OraclePolicy(builtin, encoder), None, desktops=2, max_steps=MAX_STEPS,
                            out=tmp_path / "oracle", config=eval_config, encoder=encoder)
    assert oracle["overall"]["episodes"] == len(list(BUILTIN_DIR.glob("*.json"))) == len(builtin)
    assert oracle["errors"] == []
    assert {name: s["success_rate"] for name, s in oracle["tasks_detail"].items()} == {
        f"{t.family}/{t.id}": 1.0 for t in builtin}
    # The quitter on one task of each family (test_desktop.py scores every built-in task 0.0 when "DONE" is said
    # on its untouched desktop): what an episode that ends at once writes, not each evaluator again.
    families = sorted({t.family for t in builtin})
    sample = [next(t for t in builtin if t.family == family) for family in families]
    split = tmp_path / "quit-split.json"
    split.write_text(json.dumps({t.family: [t.id] for t in sample}))
    quitter = await evaluate(finished_only, None, split=split, desktops=2, out=tmp_path / "quit",
                             config=eval_config, encoder=encoder)
    assert quitter["overall"]["episodes"] == len(sample) == len(families) and quitter["overall"]["successes"] == 0
    assert quitter["errors"] == [] and quitter["overall"]["mean_steps"] == 1.0
    # OSWorld's number: the mean score over every planned episode (the built-in evaluators score 0 or 1)
    assert (oracle["overall"]["score_sum"], oracle["overall"]["score_total"]) == (len(builtin), len(builtin))
    assert oracle["overall"]["score_mean"] == oracle["overall"]["ran_mean"] == 1.0
    assert (quitter["overall"]["score_mean"], quitter["overall"]["harness_errors"]) == (0.0, 0)
    # OSWorld's layout: a result.txt per episode, OUT/<domain>/<task id>/result.txt
    results = sorted((tmp_path / "quit").glob("*/*/result.txt"))
    assert len(results) == len(sample) and {p.read_text() for p in results} == {"0.0\n"}


async def test_interrupted_evaluation_resumes_to_the_uninterrupted_report(eval_config, encoder, tmp_path):
    tasks = runnable_tasks(load_task_set("grid4"))[:4]
    kwargs = dict(tasks=None, split=None, desktops=2, repeats=2, max_steps=MAX_STEPS, config=eval_config,
                  encoder=encoder)
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"grid4": [t.id for t in tasks]}))
    kwargs["split"] = split
    whole = await evaluate(OraclePolicy(tasks, encoder), out=tmp_path / "whole", **kwargs)
    assert whole["overall"]["episodes"] == 8

    halfway = asyncio.Event()
    run = asyncio.create_task(evaluate(OraclePolicy(tasks, encoder), out=tmp_path / "cut", progress=lambda p:
                                       halfway.set() if p.done >= 3 else None, **kwargs))
    await halfway.wait()
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    cut = json.loads((tmp_path / "cut" / "report.json").read_text())
    assert 3 <= cut["finished"] < 8 and not cut["complete"]
    finished_before = read_records(tmp_path / "cut")
    with pytest.raises(FileExistsError, match="resume"):
        await evaluate(OraclePolicy(tasks, encoder), out=tmp_path / "cut", **kwargs)

    ran: list[str] = []
    policy = OraclePolicy(tasks, encoder)
    original = policy.generate

    async def counting(**kw):
        ran.append(kw["episode_id"])
        return await original(**kw)

    policy.generate = counting
    resumed = await evaluate(policy, out=tmp_path / "cut", resume=True, **kwargs)
    assert len(set(ran)) == 8 - len(finished_before)  # only the missing episodes ran
    assert _comparable(resumed) == _comparable(whole)
    first, *later = resumed["provenance"]["sessions"]  # the cut session's date stays first; the resume appends
    assert resumed["provenance"]["date"] == first["date"] == cut["provenance"]["date"] and len(later) == 1
    for key, record in finished_before.items():  # the episodes from before the cut were kept, not re-run
        assert read_records(tmp_path / "cut")[key] == record


def test_command_counts_failed_setup_and_unloadable_tasks_and_view_shows_them(tiny_model, desktop_image, tmp_path):
    """... and writes OSWorld's layout under --osworld-prefix, which OSWorld's own show_result.py (vendored
    unchanged) and the leaderboard's rule read to the numbers of report.json (issue 50 item 2)."""
    tasks = tmp_path / "tasks" / "mixed"
    tasks.mkdir(parents=True)
    green = json.loads((BUILTIN_DIR / "grid4-green.json").read_text())
    (tasks / "ok.json").write_text(json.dumps({**green, "id": "ok"}))
    broken_setup = {**green, "id": "setup-fails",
                    "config": [{"type": "execute", "parameters": {"command": ["false"], "shell": False,
                                                                   "until": {"returncode": 0}}}]}
    (tasks / "setup-fails.json").write_text(json.dumps(broken_setup))
    (tasks / "unloadable.json").write_text(json.dumps({**green, "id": "unloadable", "evaluator": {**green["evaluator"], "func": "no_such_metric"}}))
    out = tmp_path / "out"
    argv = ["eval", "--model", str(tiny_model), "--tasks", str(tasks.parent), "--desktops", "2", "--max-steps", "1",
            "--out", str(out), "--set", f"actors.image={desktop_image!r}", "--set", "actors.setup_timeout_s=20",
            "--osworld-prefix", "pyautogui/screenshot/tiny"]
    code = arpo_main(argv)
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["planned"] == report["finished"] == report["overall"]["episodes"] == 3
    errors = {e["task_id"]: e for e in report["errors"]}
    assert set(errors) == {"setup-fails", "unloadable"}
    assert errors["setup-fails"]["outcome"] == "ENV_ERROR" and "TaskSetupError" in errors["setup-fails"]["error"]
    assert errors["unloadable"]["outcome"] == "TASK_ERROR" and "no_such_metric" in errors["unloadable"]["error"]
    root = out / "pyautogui" / "screenshot" / "tiny"  # OSWorld's results/<action_space>/<observation>/<model>/
    assert (root / "mixed" / "ok" / "result.txt").is_file()
    for task_id in ("setup-fails", "unloadable"):  # as OSWorld's run.py leaves an example that raised
        assert not (root / "mixed" / task_id / "result.txt").exists()
        last = (root / "mixed" / task_id / "traj.jsonl").read_text().splitlines()[-1]
        assert "Error" in json.loads(last)
    steps = [json.loads(line) for line in (root / "mixed" / "ok" / "traj.jsonl").read_text().splitlines()]
    assert [s["step_num"] for s in steps] == [1]
    assert re.fullmatch(r"\d{8}@\d{12}", steps[0]["action_timestamp"])
    assert steps[0]["screenshot_file"] == f"step_1_{steps[0]['action_timestamp']}.png"
    assert (root / "mixed" / "ok" / steps[0]["screenshot_file"]).is_file()  # the screen after the action
    shown = show_result(out, ("pyautogui", "screenshot", "tiny"))
    total, count = leaderboard_sum(root, {"mixed": ["ok", "setup-fails", "unloadable"]})
    overall = report["overall"]
    assert shown["ran"] == overall["ran_episodes"] == 1  # show_result.py leaves the errored two out
    assert shown["sum"] == pytest.approx(overall["ran_mean"] * overall["ran_episodes"], abs=0.006)
    assert shown["mean_pct"] == pytest.approx(100 * overall["ran_mean"], abs=0.006)
    assert count == 3 and (overall["score_sum"], overall["score_total"]) == (pytest.approx(total), count)
    assert overall["score_mean"] == pytest.approx(total / count)
    assert report["policy"]["weight_version"] == 0 and report["command"] == "arpo " + shlex.join(argv)
    md = (out / "report.md").read_text()
    assert "setup-fails" in md and "TaskSetupError" in md
    assert arpo_main(["view", str(out)]) == 0
    page = (out / "view.html").read_text()
    assert page.count("<img") >= 1 and "Click the Green button." in page


def _sigint_as_a_shell_gives_it() -> None:
    """In the child before exec: SIGINT unblocked and at its default disposition, as a shell starts a command. In a
    full suite run the child inherited SIGINT ignored or blocked from the test process (something earlier in the
    suite left it so), and `arpo eval` never saw either Ctrl-C."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_command_ctrl_c_writes_the_report_and_resume_runs_only_the_rest(tiny_model, desktop_image, tmp_path):
    out = tmp_path / "out"
    args = [sys.executable, "-m", "arpo_cli", "eval", "--model", str(tiny_model), "--tasks", "grid4",
            "--repeats", "2", "--desktops", "1", "--max-steps", "1", "--temperature", "1", "--out", str(out),
            "--set", f"actors.image={desktop_image!r}"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2],
                            preexec_fn=_sigint_as_a_shell_gives_it)
    try:
        until_sync(lambda: len(list(out.glob("*/*/*/episode.json"))) >= 2, 240, "two finished episodes",
                   check=lambda: _running(proc))
        proc.send_signal(signal.SIGINT)
        try:  # 16 episodes: the 14 left take ~11 s on a quiet machine, so a lost Ctrl-C is sent again in time
            output = proc.communicate(timeout=5)[0].decode()
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # as a user presses Ctrl-C again; the report is still written
            output = proc.communicate(timeout=120)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output
    assert "interrupted" in output
    cut = json.loads((out / "report.json").read_text())
    planned = cut["planned"]
    assert 2 <= cut["finished"] < planned and not cut["complete"]
    before = {key: (out / f"repeat-{key[2] + 1}/{key[0]}/{key[1]}/episode.json").stat().st_mtime_ns
              for key in read_records(out)}
    done = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).parents[2], env={**os.environ})
    assert done.returncode == 0, done.stderr[-2000:]
    final = json.loads((out / "report.json").read_text())
    assert final["complete"] and final["finished"] == planned
    for key, mtime in before.items():  # kept, not re-run
        assert (out / f"repeat-{key[2] + 1}/{key[0]}/{key[1]}/episode.json").stat().st_mtime_ns == mtime
    assert "| **overall** |" in done.stdout


def test_python_api_example_runs_as_a_user_runs_it(tmp_path):
    root = Path(__file__).parents[2]
    proc = subprocess.run([sys.executable, str(root / "examples" / "evaluate_policy.py"), "--desktops", "2",
                           "--out", str(tmp_path / "out")], cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    test_split = json.loads((root / "arpo_async" / "splits" / "grid4-test.json").read_text())
    assert {name.split("/", 1)[1] for name in report["tasks_detail"]} == set(test_split["grid4"])
    assert "| **overall** |" in proc.stdout and report["complete"]


def test_command_scores_an_openai_compatible_endpoint_end_to_end(tiny_serve, tiny_model, desktop_image, tmp_path):
    """`arpo eval --openai-url`: the real arpo-serve's /v1/chat/completions (screenshots as image parts, the
    grammar as SGLang's regex field) drives real desktops; every episode ends with a result and no error."""
    out = tmp_path / "out"
    code = arpo_main(["eval", "--openai-url", f"{tiny_serve.url}/v1", "--openai-model", "tiny", "--openai-regex",
                      "--tokenizer", str(tiny_model), "--tasks", "grid4", "--desktops", "2", "--max-steps", "1",
                      "--temperature", "1", "--out", str(out), "--set", f"actors.image={desktop_image!r}",
                      "--set", 'actors.grammar_actions=["click"]', "--set", "actors.max_thought_chars=1"])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["policy"]["kind"] == "openai" and report["policy"]["name"] == "tiny"
    assert report["planned"] == report["finished"] == 8 and report["errors"] == []
    outcomes = {json.loads(p.read_text())["outcome"] for p in out.glob("*/*/episode.json")}
    assert outcomes <= {"SUCCESS", "TRUNCATED"}  # every reply parsed as a click, was performed and scored
    steps = [json.loads(line) for p in out.glob("*/*/traj.jsonl") for line in p.read_text().splitlines()]
    assert len(steps) == 8 and all(s["action"].startswith("click(") and s["screenshot_file"] for s in steps)


def test_command_scores_a_running_server_by_url(tiny_serve, tiny_model, desktop_image, tmp_path):
    """`arpo eval --url`: a server that is already running (its /generate, as SGLang's) is scored and left
    running; the report names the weight version the server's replies carried."""
    out = tmp_path / "out"
    code = arpo_main(["eval", "--url", tiny_serve.url, "--tokenizer", str(tiny_model), "--tasks", "grid4-green",
                      "--repeats", "2", "--desktops", "2", "--max-steps", "1", "--temperature", "1", "--out",
                      str(out), "--set", f"actors.image={desktop_image!r}", "--set", 'actors.grammar_actions=["click"]'])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["policy"]["kind"] == "url" and report["finished"] == 2 and report["errors"] == []
    assert report["overall"]["policy_versions"] == [0]
    assert set(report["overall"]["pass_at_k"]) == {"1", "2"}
    assert tiny_serve.proc.poll() is None  # not ours to stop


def test_oracle_records_demonstrations_the_learner_takes(tiny_model, desktop_image, tmp_path):
    from arpo_async.demos import load_demonstrations
    from learner.algo.replay import make_replay
    from learner.main import seed_demonstrations

    out = tmp_path / "demos"
    argv = ["eval", "--oracle", "--tokenizer", str(tiny_model), "--tasks", "settings-sound-mute", "--repeats", "2",
            "--desktops", "2", "--out", str(out), "--set", f"actors.image={desktop_image!r}"]
    assert arpo_main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["policy"]["kind"] == "oracle" and report["overall"]["success_rate"] == 1.0
    config = load_config(None, [f"model={str(tiny_model)!r}", f"learner.replay_demos={str(out)!r}"])
    ac = config.actors
    demos = load_demonstrations(out, PromptEncoder(tiny_model), screen_size=ac.screen_size,
                                history_images=ac.history_images, prompt_style=ac.prompt_style)
    assert [len(d.steps) for d in demos["settings-sound-mute"]] == [3, 3]  # Sound, Mute, finished
    assert "click(start_box=" in demos["settings-sound-mute"][0].steps[0].text
    replay = make_replay("arpo")
    assert seed_demonstrations(config, replay, ["settings-sound-mute"]) == 2
    assert replay.stats()["stored"] == 2
    off = load_config(None, [f"model={str(tiny_model)!r}", f"learner.replay_demos={str(out)!r}",
                             "learner.replay=false"])
    with pytest.raises(ConfigError, match="needs the success replay"):
        seed_demonstrations(off, make_replay("off"), ["settings-sound-mute"])


def test_command_runs_a_task_listed_twice_in_a_split_once_and_names_its_step_budget(tiny_model, desktop_image,
                                                                                   tmp_path):
    """A split listing a built-in task twice under its domain and again under another domain plans one episode of
    it, under its first domain, and says so once on stderr and in report.json; --max-steps 15 is recorded as the
    leaderboard's 15-step budget."""
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"grid4": ["grid4-green", "grid4-green"], "menu": ["grid4-green"]}))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "arpo_cli", "eval", "--oracle", "--tokenizer", str(tiny_model),
                           "--split", str(split), "--desktops", "2", "--max-steps", "15", "--out", str(out),
                           "--set", f"actors.image={desktop_image!r}"],
                          cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["planned"] == report["finished"] == report["overall"]["episodes"] == 1
    assert list(report["tasks_detail"]) == ["grid4/grid4-green"]
    assert report["overall"]["success_rate"] == 1.0  # the oracle's episode ran and scored
    assert report["deduplicated"] == [{"task_id": "grid4-green", "domain": "grid4",
                                       "also_listed_as": ["grid4", "menu"]}]
    assert report["step_budget"] == {"max_steps": 15, "preset": "OSWorld 15-step"}
    assert proc.stderr.count("listed more than once") == 1
    assert (out / "grid4" / "grid4-green").is_dir() and not (out / "menu").exists()
