"""The results folder in OSWorld's layout (issue 50 item 2, actors.eval.results): OSWorld's own show_result.py,
vendored unchanged, reads it; traj.jsonl carries OSWorld's fields with OSWorld's meanings (the screen AFTER each
action, the action's wall-clock timestamp); an errored episode leaves no result.txt, as OSWorld's run.py leaves an
example that raised; repeats go to parallel roots that each read the same way; --osworld-prefix is checked.

On main 485c8d8 each of these failed: show_result.py printed "New experiment, no result yet." (the repeat level
broke its walk), step_<i>.png was the screen before action i with an empty action_timestamp, and an errored
episode wrote result.txt "0.0", which show_result.py counted.
"""
from __future__ import annotations

import datetime
import hashlib
import io
import json
import re
from pathlib import Path

import pytest
from PIL import Image

from actors.eval.folder import ResultsFolder, ResultsFolderError
from actors.eval.report import build_report
from actors.eval.results import (SINGLE, Layout, EpisodeRecord, action_timestamp, parse_prefix, read_records,
                                 record_problem, write_episode)
from actors.eval.runner import EvalSettings, claim_results, policy_identity
from arpo_async.config import RunConfig
from arpo_async.messages import Outcome, Step, Trajectory
from arpo_cli.cli import main as arpo_main
from tests.osworld_results import SHOW_RESULT, leaderboard_sum, show_result

T0 = datetime.datetime(2025, 3, 4, 5, 6, 7, 891011).timestamp()
"""The wall-clock time the first action of every test episode is taken."""
STAMP = re.compile(r"^\d{8}@\d{12}$")


def png(colour: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(out, format="PNG")
    return out.getvalue()


def episode(actions: list[str], *, final: str | None = None, outcome=Outcome.TRUNCATED, score=0.0) -> Trajectory:
    """A trajectory as actors.episode records it: step i saw screen i (colours[i]); a step that acted changes the
    screen; ``final`` is the settled screen after the last action (kept as ``final_screenshot``)."""
    colours = ["white", "red", "green", "blue", "yellow", "black"]
    shots = [png(c) for c in colours[:len(actions)]]
    steps = [Step(prompt_ids=[1], image_indices=[i], output_ids=[2], logprobs=[-0.5], versions=[0],
                  text=f"Thought: step {i + 1}\nAction: {a}", action=a, acted_at=T0 + 1.5 * i)
             for i, a in enumerate(actions)]
    traj = Trajectory("t", "eval", "task", "g", 0, outcome, score, True, steps, shots)
    if final is not None:
        traj.screenshots.append(png(final))
        traj.final_screenshot = len(traj.screenshots) - 1
    return traj


def record(task_id: str, score: float, *, domain="os", repeat=0, error="", steps=2) -> EpisodeRecord:
    outcome = "ENV_ERROR" if error else ("SUCCESS" if score > 0.1 else "FAILURE")
    return EpisodeRecord(domain, task_id, repeat, 0.0 if error else score, outcome == "SUCCESS", outcome,
                         error=f"ENV_ERROR: {error}" if error else "", steps=steps)


def lines(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "traj.jsonl").read_text().splitlines()]


def test_the_vendored_show_result_is_osworlds_code_unchanged():
    text = SHOW_RESULT.read_text()
    code = text.split("# " + "-" * 112 + "\n", 1)[1]
    assert hashlib.md5(code.encode()).hexdigest() == "5992c439aa7ebe25c036f09378c7104a"
    assert "Apache License" in text and "github.com/xlang-ai/OSWorld" in text


def test_traj_jsonl_has_osworlds_fields_and_the_screen_after_each_action(tmp_path):
    traj = episode(["click(10,10)", "type('x')", "scroll('down')"], final="black")
    folder = write_episode(tmp_path, record("t", 0.0, steps=3), traj)
    steps = lines(folder)
    assert [s["step_num"] for s in steps] == [1, 2, 3]
    for n, step in enumerate(steps, start=1):
        assert set(step) == {"step_num", "action_timestamp", "action", "response", "reward", "done", "info",
                             "screenshot_file", "observation_file"}
        assert STAMP.match(step["action_timestamp"])
        assert step["action_timestamp"] == datetime.datetime.fromtimestamp(T0 + 1.5 * (n - 1)).strftime(
            "%Y%m%d@%H%M%S%f")
        assert step["screenshot_file"] == f"step_{n}_{step['action_timestamp']}.png"
        assert (step["reward"], step["done"], step["info"]) == (0, False, {})  # env.step's, for a plain action
        assert step["action"] == traj.steps[n - 1].action and step["response"] == traj.steps[n - 1].text
    assert steps[0]["action_timestamp"] == "20250304@050607891011"
    after = [(folder / s["screenshot_file"]).read_bytes() for s in steps]
    assert after == [png("red"), png("green"), png("black")]  # the next screen; the settled final one last
    seen = [(folder / s["observation_file"]).read_bytes() for s in steps]
    assert seen == [png("white"), png("red"), png("green")]
    assert steps[0]["observation_file"] == "step_0.png"
    assert (folder / "result.txt").read_text() == "0.0\n"


@pytest.mark.parametrize("terminal, info", [("finished('done')", {"done": True}), ("fail()", {"fail": True}),
                                            ("", {})])
def test_a_step_that_ends_the_episode_without_acting_has_the_screen_it_saw(tmp_path, terminal, info):
    traj = episode(["click(1,1)", terminal])  # no final screenshot: nothing acted after step 2
    folder = write_episode(tmp_path, record("t", 1.0 if terminal.startswith("finished") else 0.0), traj)
    last = lines(folder)[-1]
    assert (folder / last["screenshot_file"]).read_bytes() == png("red") == (folder / last["observation_file"]
                                                                             ).read_bytes()
    assert last["done"] == bool(info) and last["info"] == info  # DONE / FAIL as OSWorld's env.step; unparsed: none


def test_an_errored_episode_has_osworlds_error_line_and_no_result(tmp_path):
    traj = episode(["click(1,1)", "click(2,2)"])  # the desktop died after the second action: no final screen
    err = record("t", 0.0, error="DesktopError: container gone")
    folder = write_episode(tmp_path, err, traj)
    steps = lines(folder)
    assert not (folder / "result.txt").exists()  # as OSWorld's run.py leaves an example that raised
    assert steps[-1] == {"Error": "os/t: ENV_ERROR: DesktopError: container gone"}
    assert steps[1]["screenshot_file"] == ""  # its after-screen was never taken
    assert record_problem(err, folder, success_threshold=0.1, max_steps=5) is None
    (folder / "result.txt").write_text("0.0\n")  # a result.txt would put it in show_result.py's mean
    assert "errored episode with a result.txt" in record_problem(err, folder, success_threshold=0.1, max_steps=5)
    assert json.loads((folder / "episode.json").read_text())["error"].startswith("ENV_ERROR:")


PLANNED = {"os": ["a", "b", "c", "d", "e"]}
SCORES = {"a": 0.5, "b": 0.2, "c": 0.0, "d": 1.0}
"""Partial credit; task e errors (the harness could not run it)."""


def write_set(root: Path, repeat: int = 0, layout: Layout = SINGLE) -> list[EpisodeRecord]:
    records = [record(t, s, repeat=repeat) for t, s in SCORES.items()] + [record("e", 0.0, repeat=repeat,
                                                                                 error="TaskSetupError: no network")]
    for r in records:
        write_episode(root, r, episode(["click(1,1)", "finished('ok')"]), layout)
    return records


def test_show_result_and_the_leaderboard_rule_read_the_same_numbers_as_the_report(tmp_path):
    out = tmp_path / "out"
    records = write_set(out)
    report = build_report(records, repeats=1, planned=5, meta={}, tasks=[("os", t) for t in PLANNED["os"]])
    overall = report["overall"]
    shown = show_result(out)
    assert "New experiment, no result yet." not in shown["stdout"]
    assert shown["ran"] == 4 and shown["sum"] == pytest.approx(1.7)  # the errored task is left out
    assert shown["mean_pct"] == pytest.approx(100 * 1.7 / 4, abs=0.006)
    assert "Domain: os Runned: 4 Success Rate: 42.5 %" in shown["stdout"]
    total, count = leaderboard_sum(out, PLANNED)
    assert (total, count) == (pytest.approx(1.7), 5)
    # the report's fields (actors.eval.report): OSWorld's show_result.py number and the leaderboard's
    assert overall["ran_mean"] == pytest.approx(shown["mean_pct"] / 100, abs=1e-4)
    assert overall["ran_episodes"] == shown["ran"]
    assert overall["score_sum"] == pytest.approx(total) and overall["score_total"] == count
    assert overall["score_mean"] == pytest.approx(total / count)


@pytest.mark.parametrize("prefix", ["", "pyautogui/screenshot/ui-tars-1.5-7b"])
def test_repeats_go_to_parallel_roots_that_each_read_the_same_way(tmp_path, prefix):
    out, layout = tmp_path / "out", Layout(3, parse_prefix(prefix))
    assert layout.rel("os", "a", 0) == "/".join(["repeat-1", *layout.prefix, "os", "a"])
    assert layout.rel("os", "a", 2).startswith("repeat-3/")
    with pytest.raises(ValueError):
        layout.rel("os", "a", 3)
    assert Layout(1, parse_prefix(prefix)).rel("os", "a", 0) == "/".join([*layout.prefix, "os", "a"])
    every = [r for repeat in range(3) for r in write_set(out, repeat, layout)]
    names = tuple(layout.prefix) or ("", "", "")
    for repeat in range(3):
        shown = show_result(out / f"repeat-{repeat + 1}", names)
        assert shown["ran"] == 4 and shown["sum"] == pytest.approx(1.7)
        assert leaderboard_sum(out.joinpath(f"repeat-{repeat + 1}", *layout.prefix), PLANNED) == (
            pytest.approx(1.7), 5)
    assert read_records(out) == {r.key: r for r in every}
    assert show_result(out, names)["ran"] is None  # the top holds roots, not domains: no result there
    report = build_report(every, repeats=3, planned=15, meta={}, tasks=[("os", t) for t in PLANNED["os"]])
    assert report["overall"]["score_sum"] == pytest.approx(3 * 1.7) and report["overall"]["score_total"] == 15


HOSTILE_PREFIXES = ["/abs/b/c", "../b/c", "a/../c", "a/b", "a/b/c/d", "a//c", "./b/c", "a/b/c/", "repeat-1/b/c",
                    "a/b\\c/d", "a/\0/c", "a/\n/c", "a/" + "x" * 300 + "/c"]


@pytest.mark.parametrize("prefix", HOSTILE_PREFIXES)
def test_a_bad_osworld_prefix_is_refused_with_one_line_before_anything_is_written(tmp_path, capsys, prefix):
    with pytest.raises(ValueError) as refused:
        parse_prefix(prefix)
    assert "--osworld-prefix" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(ValueError):
        EvalSettings("grid4-green", results_prefix=prefix)
    out = tmp_path / "out"
    assert arpo_main(["eval", "--oracle", "--tasks", "grid4-green", "--out", str(out), "--osworld-prefix",
                      prefix]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--osworld-prefix" in err[0] and not out.exists()


def test_a_resume_with_another_prefix_is_refused_and_a_listed_prefix_folder_is_trusted(tmp_path):
    out = tmp_path / "out"
    settings = EvalSettings("grid4-green", repeats=2, results_prefix="pyautogui/screenshot/tiny")
    folder = claim_results(out, policy_identity(print), settings, RunConfig(), resume=False)
    written = folder.write_episode(record("grid4-green", 1.0, domain="grid4", repeat=1, steps=1), None)
    assert written == out / "repeat-2/pyautogui/screenshot/tiny/grid4/grid4-green"
    shown = show_result(out / "repeat-2", ("pyautogui", "screenshot", "tiny"))
    assert shown["ran"] == 1 and (written.parents[1] / "all_result.json").is_file()  # it writes into the folder
    resumed = claim_results(out, policy_identity(print), settings, RunConfig(), resume=True)  # which stays ours
    assert list(resumed.finished(max_steps=5)) == [("grid4", "grid4-green", 1)]
    with pytest.raises(ResultsFolderError, match="results prefix 'pyautogui/screenshot/tiny', this run asks ''"):
        claim_results(out, policy_identity(print), EvalSettings("grid4-green", repeats=2), RunConfig(),
                      resume=True)
    (written / "result.txt").unlink()  # a finished (not errored) episode without its result: runs again
    assert ResultsFolder.claim(out, resumed._manifest["params"], resume=True).finished(max_steps=5) == {}


def test_read_records_takes_a_record_only_where_a_layout_puts_it(tmp_path):
    good = write_episode(tmp_path, record("a", 1.0, repeat=0), None)
    assert list(read_records(tmp_path)) == [("os", "a", 0)]
    stray = tmp_path / "repeat-5" / "os" / "a"  # repeat 0's record under repeat 5's root: not where it belongs
    stray.mkdir(parents=True)
    (stray / "episode.json").write_text((good / "episode.json").read_text())
    nested = tmp_path / "os" / "a" / "copy"
    nested.mkdir()
    (nested / "episode.json").write_text((good / "episode.json").read_text())
    assert list(read_records(tmp_path)) == [("os", "a", 0)]
    assert action_timestamp(T0) == "20250304@050607891011"


@pytest.mark.parametrize("field, value, reason", [("final_screenshot", 9, "image_indices"),
                                                  ("final_screenshot", -2, "image_indices"),
                                                  ("acted_at", float("nan"), "timings"),
                                                  ("acted_at", -1.0, "timings"), ("acted_at", 1e300, "timings")])
def test_the_learner_refuses_a_trajectory_whose_new_fields_are_out_of_range(field, value, reason):
    """Step.acted_at and Trajectory.final_screenshot travel to the learner (a few bytes; training keeps no final
    screenshot): a peer's forged value is refused as any bad field is (arpo_async.validation)."""
    from arpo_async.validation import InvalidMessage, check_trajectory

    traj = episode(["click(1,1)", "click(2,2)"], final="black")
    check_trajectory(traj, vocab_size=None, version=None)  # as the actors send it
    if field == "acted_at":
        traj.steps[1].acted_at = value
    else:
        traj.final_screenshot = value
    with pytest.raises(InvalidMessage) as refused:
        check_trajectory(traj, vocab_size=None, version=None)
    assert refused.value.reason == reason and field in refused.value.detail
