"""Task-set coverage (actors.task_check): load-time reasons per task and the per-domain table."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.task_check import check_load, domain_table, format_report, setup_failure_kind, task_files
from actors.osworld.setup import TaskSetupError

GOOD = {"id": "t-ok", "instruction": "x", "config": [{"type": "execute", "parameters": {"command": "true"}}],
        "evaluator": {"func": "exact_match", "result": {"type": "vm_command_line", "command": "echo hi"},
                      "expected": {"type": "rule", "rules": {"expected": "hi"}}}}


def _write(folder: Path, domain: str, name: str, content: str | dict) -> Path:
    path = folder / domain / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_each_file_gets_a_reason_kind_and_the_table_counts_by_domain(tmp_path):
    _write(tmp_path, "os", "ok", GOOD)
    _write(tmp_path, "os", "broken", "{not json")
    _write(tmp_path, "chrome", "drive", {**GOOD, "id": "t-drive",
                                         "config": [{"type": "teleport", "parameters": {}}]})
    _write(tmp_path, "chrome", "metric", {**GOOD, "id": "t-metric",
                                          "evaluator": {**GOOD["evaluator"], "func": "no_such_metric"}})
    _write(tmp_path, "vlc", "getter", {**GOOD, "id": "t-getter",
                                       "evaluator": {**GOOD["evaluator"], "result": {"type": "no_such_getter"}}})
    reports, tasks = check_load(task_files(tmp_path))
    by_id = {r.task_id: r for r in reports}
    assert set(by_id) == {"t-ok", "broken", "t-drive", "t-metric", "t-getter"}
    assert by_id["t-ok"].loaded and by_id["t-ok"].reason is None and str(tmp_path / "os" / "ok.json") in tasks
    assert (by_id["broken"].reason, by_id["t-drive"].reason, by_id["t-metric"].reason,
            by_id["t-getter"].reason) == ("format", "setup_type", "metric", "getter")
    assert "teleport" in by_id["t-drive"].detail and "no_such_metric" in by_id["t-metric"].detail
    table = {row["domain"]: row for row in domain_table(reports, ran_desktops=False)}
    assert table["os"] == {"domain": "os", "tasks": 2, "load": 1}
    assert table["chrome"]["load"] == 0 and table["all"] == {"domain": "all", "tasks": 5, "load": 1}
    text = format_report(reports, ran_desktops=False)
    assert "chrome/t-drive: load: setup_type" in text and "reasons:" in text


def test_setup_failures_keep_the_kind_the_setup_step_gave():
    assert setup_failure_kind(TaskSetupError("x", kind="needs_network")) == "needs_network"
    assert setup_failure_kind(TaskSetupError("launch: vlc not installed", kind="app_missing")) == "app_missing"
    assert setup_failure_kind(TaskSetupError("step 2 exited 1")) == "setup_failed"


def test_missing_or_empty_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        task_files(tmp_path / "nope")
    with pytest.raises(ValueError, match="no \\*.json"):
        task_files(tmp_path)


def test_a_deeply_nested_or_huge_file_is_one_refused_report_and_the_folder_goes_on(tmp_path):
    """Issue 24 item 2: the check parses each file with the loader's own bounded parse, so a file nested past
    Python's recursion limit, or one far over the size cap, is refused with a reason and never read whole or
    re-parsed with plain json.loads (which raised RecursionError and aborted the folder)."""
    _write(tmp_path, "os", "a-nested", "[" * 200_000 + "]" * 200_000)
    huge = _write(tmp_path, "os", "b-huge", GOOD)
    with huge.open("a") as fh:  # 60 MB of trailing spaces: valid JSON, far over the cap
        fh.truncate(60 * 1024 * 1024)
    _write(tmp_path, "os", "c-ok", GOOD)
    reports, tasks = check_load(task_files(tmp_path))
    by_path = {Path(r.path).stem: r for r in reports}
    assert [r.reason for r in reports] == ["format", "format", None]
    assert "nested too deeply" in by_path["a-nested"].detail
    assert "more than the cap" in by_path["b-huge"].detail and by_path["b-huge"].task_id == "b-huge"
    assert by_path["c-ok"].task_id == "t-ok" and list(tasks) == [str(tmp_path / "os" / "c-ok.json")]


def test_a_refused_file_is_still_named_by_its_id(tmp_path):
    _write(tmp_path, "os", "file-name", {**GOOD, "id": "the-id", "evaluator": {**GOOD["evaluator"], "func": "nope"}})
    (report,), _ = check_load(task_files(tmp_path))
    assert (report.task_id, report.reason) == ("the-id", "metric")


def test_a_task_id_that_walks_out_or_an_upload_from_outside_its_folder_is_refused_at_load(tmp_path):
    """Issue 24 item 7: an id with '/' or '..' (it names files in the download cache and the OSWorld mirror) and
    an upload_file whose local_path lies outside the task file's folder (here the host's /etc/passwd, or a
    symlink next to the task that points there) are refused when the file loads, naming the field."""
    _write(tmp_path, "os", "walks", {**GOOD, "id": "../../etc"})
    steps = lambda local: [{"type": "upload_file", "parameters": {"files": [{"local_path": local, "path": "/tmp/x"}]}}]  # noqa: E731
    _write(tmp_path, "os", "absolute", {**GOOD, "id": "t-abs", "config": steps("/etc/passwd")})
    _write(tmp_path, "os", "dotdot", {**GOOD, "id": "t-dotdot", "config": steps("../../../etc/passwd")})
    (tmp_path / "os" / "link").symlink_to("/etc/passwd")
    _write(tmp_path, "os", "symlink", {**GOOD, "id": "t-link", "config": steps("link")})
    _write(tmp_path, "os", "nul", {**GOOD, "id": "t-nul", "config": steps("notes\u0000.txt")})  # was a ValueError
    (tmp_path / "os" / "notes.txt").write_text("next to the task")
    _write(tmp_path, "os", "inside", {**GOOD, "id": "t-inside", "config": steps("notes.txt")})
    reports, tasks = check_load(task_files(tmp_path))
    by_id = {r.task_id: r for r in reports}
    assert "field 'id'" in by_id["../../etc"].detail and by_id["../../etc"].reason == "format"
    for refused in ("t-abs", "t-dotdot", "t-link"):
        assert "lies outside the task's folder" in by_id[refused].detail, by_id[refused]
    assert "without NUL" in by_id["t-nul"].detail
    assert by_id["t-inside"].loaded and list(tasks) == [str(tmp_path / "os" / "inside.json")]


def test_parameter_types_and_metric_options_are_caught_before_any_episode(tmp_path):
    """Issue 24 item 1: a setup parameter of the wrong type (``"command": 5``) is refused when the file loads,
    naming the parameter, and an option our own metric does not take (exact_match with ``o``) is reported by the
    check as ``metric_options``. (OSWorld's own 369 Ubuntu task files trip neither: `arpo tasks check` on them
    gives the same reasons as before these checks.)"""
    _write(tmp_path, "os", "command", {**GOOD, "id": "t-command",
                                       "config": [{"type": "execute", "parameters": {"command": 5}}]})
    _write(tmp_path, "os", "sleep", {**GOOD, "id": "t-sleep", "config": [{"type": "sleep", "parameters": {"seconds": 1e308}}]})
    _write(tmp_path, "os", "option", {**GOOD, "id": "t-option", "evaluator": {**GOOD["evaluator"], "options": {"o": 5}}})
    reports, tasks = check_load(task_files(tmp_path))
    by_id = {r.task_id: r for r in reports}
    assert by_id["t-command"].reason == "format" and "config[0].parameters.command" in by_id["t-command"].detail
    assert "must be a string or a list of strings, got 5" in by_id["t-command"].detail
    assert by_id["t-sleep"].reason == "format" and "parameters.seconds" in by_id["t-sleep"].detail
    assert by_id["t-option"].reason == "metric_options" and "unexpected keyword argument 'o'" in by_id["t-option"].detail
    assert tasks == {}


def test_one_task_file_is_checked_alone_and_a_missing_path_is_named(tmp_path):
    good = _write(tmp_path, "os", "ok", GOOD)
    _write(tmp_path, "os", "broken", "{not json")
    assert task_files(good) == [good]
    (report,), tasks = check_load(task_files(good))
    assert report.loaded and report.domain == "os" and list(tasks) == [str(good)]
    with pytest.raises(FileNotFoundError, match="nope.json: no such file or folder"):
        task_files(tmp_path / "nope.json")


def test_arpo_tasks_check_exits_non_zero_when_a_task_fails_to_load(tmp_path, capsys):
    """The command, run in-process on a file and on folders: 0 only when every task loaded; 1 with the count on
    stderr when any did not, and for a path that does not exist."""
    from arpo_cli.cli import main

    good = _write(tmp_path / "good", "os", "ok", GOOD)
    _write(tmp_path / "mixed", "os", "ok", GOOD)
    broken = _write(tmp_path / "mixed", "os", "broken", "{not json")
    settings = ["--set", f"run_dir={tmp_path / 'run'}"]
    assert main(["tasks", "check", str(good), *settings]) == 0
    assert main(["tasks", "check", str(tmp_path / "good"), *settings]) == 0
    capsys.readouterr()
    assert main(["tasks", "check", str(broken), *settings]) == 1
    assert "1 of 1 task(s) failed to load" in capsys.readouterr().err
    assert main(["tasks", "check", str(tmp_path / "mixed"), *settings]) == 1
    out, err = capsys.readouterr()
    assert "os/broken: load: format" in out and "1 of 2 task(s) failed to load" in err
    assert main(["tasks", "check", str(tmp_path / "nope"), *settings]) == 2
    assert "no such task file or folder" in capsys.readouterr().err


def test_the_builtin_tasks_all_load():
    from arpo_async.tasks import BUILTIN_DIR

    reports, tasks = check_load(task_files(BUILTIN_DIR))
    assert reports and all(r.loaded for r in reports) and len(tasks) == len(reports)


def _download(url: str) -> list[dict]:
    return [{"type": "download", "parameters": {"files": [{"url": url, "path": "/home/user/profile.tar.gz"}]}}]


async def test_a_task_repeating_anothers_id_finds_its_own_file_in_the_stand_in_mirror(tmp_path):
    """OSWorld's thunderbird/3f28fe4f-... carries chrome/6766f2b8-...'s id (11 thunderbird files repeat chrome
    ids). Training and the mirror generators name such a task by its file (arpo_async.task_sets.unique_ids) and put
    its files under thunderbird/<file name>/; the coverage check named it by the repeated id, so its download
    looked under */<chrome id>/ and missed the mirror (4 of ARPO's 128 set up as needs_network), or, had the
    chrome task named a file of the same name, took the chrome task's file. The check now names it as training
    does, and its setup gets its own file from the mirror."""
    from actors.osworld.downloads import DownloadCache
    from actors.osworld.stand_in_mirror import write_mirror
    from actors.osworld.task_files import scan_task_files
    from actors.task_check import check_folder
    from arpo_async.task_sets import load_task_set

    folder = tmp_path / "examples"
    _write(folder, "chrome", "c-1", {**GOOD, "id": "c-1", "config": _download("https://files.example/chrome")})
    _write(folder, "thunderbird", "t-2", {**GOOD, "id": "c-1", "config": _download("https://files.example/tb")})
    _write(folder, "os", "ok", GOOD)
    files, problems = scan_task_files(load_task_set(folder))
    assert problems == [] and sorted(f.relpath.as_posix() for f in files) == [
        "chrome/c-1/profile.tar.gz", "thunderbird/t-2/profile.tar.gz"]
    write_mirror(files, tmp_path / "mirror")
    cache = DownloadCache(cache_dir=tmp_path / "cache", mirror=tmp_path / "mirror")
    for keep in (None, {str(folder / "thunderbird" / "t-2.json")}):  # the whole folder, or a split of one task
        reports = await check_folder(folder, keep=keep)
        by_path = {Path(r.path).relative_to(folder).as_posix(): r for r in reports}
        assert by_path["thunderbird/t-2.json"].task_id == "t-2"
        if keep is None:
            assert (by_path["chrome/c-1.json"].task_id, by_path["os/ok.json"].task_id) == ("c-1", "t-ok")
    _, tasks = check_load(task_files(folder), frozenset({"c-1"}))
    tb = tasks[str(folder / "thunderbird" / "t-2.json")]
    assert (tb.id, tb.raw["id"], tasks[str(folder / "chrome" / "c-1.json")].id) == ("t-2", "t-2", "c-1")
    got = await cache.fetch("https://files.example/tb", "profile.tar.gz", tb.id)
    assert got == tmp_path / "mirror" / "thunderbird" / "t-2" / "profile.tar.gz"
