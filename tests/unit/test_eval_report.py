"""The evaluation's statistics and report against hand-computed values; the results layout's path safety;
task sets cut by splits without dropping anything."""
from __future__ import annotations

import json
import math

import pytest

from actors.eval.report import build_report, render_markdown, task_table
from actors.eval.results import EpisodeRecord, episode_dir, read_records, safe_name, write_episode
from actors.eval.stats import pass_at_k, wilson_interval
from arpo_async.task_sets import load_task_set, runnable_tasks
from arpo_async.tasks import BUILTIN_DIR, TaskFormatError


def test_wilson_interval_matches_hand_computed_values():
    # 1 of 4, z = 1.96: centre (0.25 + 1.96^2/8) / (1 + 1.96^2/4), half-width from Wilson (1927)
    z = 1.959963984540054
    p, n = 0.25, 4
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert wilson_interval(1, 4) == pytest.approx((centre - half, centre + half))
    assert wilson_interval(1, 4) == pytest.approx((0.0456, 0.6994), abs=1e-4)  # the table value
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_interval(5, 4)


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(3, 2, 2) == 1.0  # n - c < k: any k draws include a success
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def _record(domain, task, repeat, success, *, error="", steps=1):
    return EpisodeRecord(domain=domain, task_id=task, repeat=repeat, score=float(success), success=success,
                         outcome="success" if success else ("env_error" if error else "failure"), error=error,
                         steps=steps, policy_version=3)


def test_report_counts_errors_in_the_denominator_and_aggregates_per_domain_and_task():
    records = [_record("a", "t1", 0, True, steps=2), _record("a", "t1", 1, False, steps=4),
               _record("a", "t2", 0, False, error="env_error: TaskSetupError: boom"), _record("a", "t2", 1, False),
               _record("b", "t3", 0, True), _record("b", "t3", 1, True)]
    report = build_report(records, repeats=2, planned=6, meta={"policy": {"kind": "model", "name": "m"},
                                                               "command": "arpo eval", "tasks": "x"})
    overall = report["overall"]
    assert (overall["episodes"], overall["successes"], overall["errors"]) == (6, 3, 1)
    assert overall["success_rate"] == pytest.approx(0.5)
    assert overall["ci95"] == pytest.approx(list(wilson_interval(3, 6)))
    # pass@1 = mean over tasks of c/n = (1/2 + 0 + 1) / 3; pass@2 = (1 + 0 + 1) / 3
    assert overall["pass_at_k"]["1"] == pytest.approx(0.5)
    assert overall["pass_at_k"]["2"] == pytest.approx(2 / 3)
    assert overall["mean_steps"] == pytest.approx(10 / 6)
    assert report["domains"]["a"]["success_rate"] == pytest.approx(0.25)
    assert report["tasks_detail"]["b/t3"]["success_rate"] == 1.0
    assert report["complete"] and report["errors"] == [
        {"domain": "a", "task_id": "t2", "repeat": 0, "outcome": "env_error",
         "error": "env_error: TaskSetupError: boom", "cause": "harness"}]
    md = render_markdown(report)
    # the score leads: 3 of 6 planned episodes scored 1.0; then the success rate at the threshold, 3 of 6
    assert "TaskSetupError: boom" in md and "| **overall** | 3/6 | 50.0% |" in md and "| 3/6 | 50.0% |" in md
    assert "pass@2" in md and "(the harness could not run it)" in md
    partial = build_report(records[:3], repeats=2, planned=6, meta={})
    assert not partial["complete"] and "INCOMPLETE" in render_markdown({**partial, "policy": {}})
    assert "a/t1" in task_table(report)


def test_safe_name_keeps_task_ids_inside_the_results_folder(tmp_path):
    assert safe_name("grid4-green") == "grid4-green"
    for hostile in ("..", ".", "../../etc", "a/b", "x\0y", ""):
        name = safe_name(hostile)
        assert "/" not in name and name not in (".", "..", "")
    record = EpisodeRecord(domain="../up", task_id="../../etc/passwd", repeat=0, score=0.0, success=False,
                           outcome="failure")
    folder = write_episode(tmp_path / "out", record, None)
    assert folder.resolve().is_relative_to((tmp_path / "out").resolve())
    assert folder == episode_dir(tmp_path / "out", "../up", "../../etc/passwd", 0)
    assert (folder / "result.txt").read_text() == "0.0\n"
    assert read_records(tmp_path / "out") == {record.key: record}


def test_split_keeps_unloadable_and_missing_tasks_as_errors(tmp_path):
    tasks = tmp_path / "tasks"
    (tasks / "apps").mkdir(parents=True)
    good = json.loads((BUILTIN_DIR / "grid4-green.json").read_text())
    (tasks / "apps" / "good.json").write_text(json.dumps({**good, "id": "good"}))
    (tasks / "apps" / "broken.json").write_text("{not json")
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"apps": ["good", "broken", "absent"]}))
    entries = load_task_set(tasks, split)
    assert [(e.domain, e.task_id, e.task is not None) for e in entries] == [
        ("apps", "good", True), ("apps", "broken", False), ("apps", "absent", False)]
    assert "invalid JSON" in entries[1].error and "not in" in entries[2].error
    with pytest.raises(TaskFormatError, match="broken"):
        runnable_tasks(entries)
    family = {e.task_id for e in load_task_set("grid4")}  # a built-in family by name: train and held-out tasks
    assert family == {e.task_id for split in ("grid4-train", "grid4-test") for e in load_task_set(None, split)}
    assert [e.task_id for e in load_task_set("grid4-g")] == ["grid4-green"]  # else an id prefix
    with pytest.raises(TaskFormatError, match="no such"):
        load_task_set("no-such-family")
    bad_split = tmp_path / "bad.json"
    bad_split.write_text(json.dumps(["x"]))
    with pytest.raises(TaskFormatError, match="split"):
        load_task_set(tasks, bad_split)


def test_a_record_with_fields_of_the_wrong_type_is_not_a_finished_episode(tmp_path):
    record = EpisodeRecord(domain="d", task_id="t", repeat=0, score=1.0, success=True, outcome="SUCCESS")
    folder = write_episode(tmp_path, record, None)
    assert read_records(tmp_path) == {record.key: record}
    data = json.loads((folder / "episode.json").read_text())
    for field, bad in (("score", "1.0"), ("repeat", "0"), ("success", 1), ("domain", None)):
        (folder / "episode.json").write_text(json.dumps({**data, field: bad}))
        assert read_records(tmp_path) == {}, field  # runs again on --resume instead of breaking the report
