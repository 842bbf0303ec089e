"""A mistyped `arpo` command line, as a user meets it: the real command in a subprocess (issue 49 item 5).

- a mistyped subcommand or choice gets the closest one ("did you mean 'run'?");
- an unknown flag of a subcommand is reported with that subcommand's usage, not the top-level one;
- a usage error and a bad config exit 2 from every command (argparse's status), with one line naming the key and
  nothing made;
- `arpo desktop clean` without --run-id or --all removes nothing (tests/integration/test_desktop_clean.py shows a
  real container left alone).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOP_USAGE = "usage: arpo [-h]"


def arpo(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "arpo_cli.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=None)


@pytest.mark.parametrize("argv, suggestion, usage", [
    (["rnu"], "did you mean 'run'?", TOP_USAGE),
    (["evla", "--oracle"], "did you mean 'eval'?", TOP_USAGE),
    (["config", "shwo"], "did you mean 'show'?", "usage: arpo config [-h]"),
    (["desktop", "claen"], "did you mean 'clean'?", "usage: arpo desktop [-h]"),
    (["config", "show", "--section", "lerner"], "did you mean 'learner'?", "usage: arpo config show [-h]"),
    (["run", "--stesp", "3"], "unrecognized arguments: --stesp 3; did you mean --steps?", "usage: arpo run [-h]"),
    (["eval", "--oracle", "--tmperature", "1"], "did you mean --temperature?", "usage: arpo eval [-h]"),
    (["config", "show", "--sectoin", "learner"], "did you mean --section?", "usage: arpo config show [-h]"),
    (["desktop", "clean", "--run-di", "x"], "did you mean --run-id?", "usage: arpo desktop clean [-h]"),
    (["export", "runs/x", "--out", "x", "--stpe", "3"], "did you mean --step?", "usage: arpo export [-h]"),
])
def test_a_mistyped_command_line_gets_the_closest_word_and_its_own_usage(argv, suggestion, usage):
    proc = arpo(*argv)
    assert proc.returncode == 2, proc.stderr
    assert suggestion in proc.stderr and proc.stderr.startswith(usage), proc.stderr
    if usage != TOP_USAGE:
        assert TOP_USAGE not in proc.stderr  # the subcommand's usage only
    assert proc.stdout == ""


def test_a_word_near_nothing_gets_no_suggestion():
    proc = arpo("xyzzy")
    assert proc.returncode == 2 and "invalid choice: 'xyzzy' (choose from" in proc.stderr
    assert "did you mean" not in proc.stderr


@pytest.mark.parametrize("argv", [
    ["run", "--out", "{tmp}/run"],
    ["launch", "--address", "127.0.0.1:1", "--out", "{tmp}/run"],
    ["config", "show"],
    ["eval", "--oracle", "--out", "{tmp}/eval"],
    ["tasks", "check", "arpo_async/tasks_builtin"],
])
@pytest.mark.parametrize("bad, says", [
    (["--set", "learner.lr=fast"], "learner.lr: must be float, got 'fast'"),
    (["--set", "learner.no_such_key=1"], "learner.no_such_key"),
    (["--config", "{tmp}/missing.toml"], "missing.toml"),
])
def test_a_bad_config_exits_2_from_every_command_with_one_line(argv, bad, says, tmp_path):
    """Before issue 49, `arpo run` and `arpo launch` exited 1 for what `arpo config show` and `arpo eval` exit 2."""
    proc = arpo(*[a.format(tmp=tmp_path) for a in argv + bad])
    assert proc.returncode == 2, (argv, bad, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"arpo {argv[0]}") and says in lines[0], proc.stderr
    assert list(tmp_path.iterdir()) == []  # no run or results folder made


@pytest.mark.parametrize("argv, says", [
    (["run", "--out", "{tmp}/held"], "already holds a run"),  # a run folder in use
    (["run", "--out", "{tmp}/fresh", "--resume"], "has no checkpoint to resume from"),
    (["run", "--out", "{tmp}/fresh", "--set", 'learner.tasks="{tmp}/no-such-tasks"'], "no such task file"),
    (["tasks", "check", "{tmp}/no-such-tasks"], "no such task file or folder"),
])
def test_a_run_folder_or_task_set_that_does_not_fit_exits_2_before_anything_starts(argv, says, tmp_path):
    held = tmp_path / "held"
    held.mkdir()
    (held / "metrics.jsonl").write_text("")
    proc = arpo(*[a.format(tmp=tmp_path) for a in argv])
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["held"] and [p.name for p in held.iterdir()] == [
        "metrics.jsonl"]


@pytest.mark.parametrize("argv", [[], ["--run-id", ""], ["--run-id", "  "]])
def test_desktop_clean_needs_a_run_id_or_all(argv):
    proc = arpo("desktop", "clean", *argv)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == ("arpo desktop clean: give --run-id RUN_ID (that run's desktops) or --all (every arpo "
                           "desktop on this host, other users' runs included); nothing removed\n")
    assert proc.stdout == ""


def test_desktop_clean_takes_one_of_run_id_and_all():
    proc = arpo("desktop", "clean", "--all", "--run-id", "x")
    assert proc.returncode == 2 and "argument --run-id: not allowed with argument --all" in proc.stderr


def test_the_exit_statuses_are_in_the_help_and_the_cli_reference():
    from arpo_cli.cli import EXIT_STATUS

    help_text = " ".join(arpo("--help").stdout.split())
    assert " ".join(EXIT_STATUS.split()) in help_text
    assert "2 a usage or config error" in (ROOT / "docs" / "reference" / "cli.md").read_text()
