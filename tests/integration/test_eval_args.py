"""`arpo eval` checks every argument before it starts anything (issue 49 item 4).

Each hostile command line runs the real command in a subprocess. It must exit 2 with one line naming what is wrong,
start no arpo-serve (no ``OUT/logs/serve.log``, no process left naming the model), and leave ``OUT`` as it was:
absent when it was absent, untouched when it existed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import processes_mentioning

ROOT = Path(__file__).resolve().parents[2]

CASES = {  # name -> (extra flags, what the line must say); {model}, {tmp} and {out} are filled in
    "unknown split": (["--model", "{model}", "--split", "no-such-split"], "no-such-split: no such split file"),
    "split not JSON": (["--model", "{model}", "--split", "{tmp}/split.json"], "split.json"),
    "unknown tasks": (["--model", "{model}", "--tasks", "no-such-family"], "no-such-family: no such task folder"),
    "out under a file": (["--model", "{model}", "--out", "{tmp}/a-file/results"], "a-file is not a folder"),
    "out is a file": (["--model", "{model}", "--out", "{tmp}/a-file"], "a-file is not a folder"),
    "out is a dangling link": (["--model", "{model}", "--out", "{tmp}/dangling"], "dangling is not a folder"),
    "out is someone's folder": (["--model", "{model}", "--out", "{tmp}/theirs"], "is not empty and not an arpo"),
    "resume a new folder": (["--model", "{model}", "--resume", "--out", "{out}"], "is not an arpo eval results"),
    "no such model": (["--model", "{tmp}/nothing-here", "--out", "{out}"], "--model"),
    "no such tokenizer": (["--url", "http://127.0.0.1:9", "--tokenizer", "{tmp}/nothing-here", "--out", "{out}"],
                          "--tokenizer"),
    "not a URL": (["--url", "ftp://127.0.0.1:9", "--out", "{out}"], "--url ftp://127.0.0.1:9: not an http"),
    "port out of range": (["--openai-url", "http://127.0.0.1:70000/v1", "--openai-model", "m", "--out", "{out}"],
                          "--openai-url"),
    "temperature NaN": (["--model", "{model}", "--temperature", "nan", "--out", "{out}"], "--temperature"),
    "negative seed": (["--model", "{model}", "--seed", "-1", "--out", "{out}"], "--seed"),
    "too many reply retries": (["--model", "{model}", "--reply-retries", "11", "--out", "{out}"], "--reply-retries"),
    "negative actors.reply_retries": (["--model", "{model}", "--set", "actors.reply_retries=-1", "--out", "{out}"],
                                      "reply_retries"),
    "unknown config key": (["--model", "{model}", "--set", "actors.no_such_key=1", "--out", "{out}"],
                           "no_such_key"),
}



@pytest.fixture(scope="module")
def model(tiny_model, tmp_path_factory) -> Path:
    """A copy of the tiny policy under a unique path, so that a process naming it can only be this test's."""
    import shutil

    copy = tmp_path_factory.mktemp("eval-args") / "policy-for-eval-args"
    shutil.copytree(tiny_model, copy)
    return copy


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_argument_exits_2_with_one_line_before_anything_starts(case, model, tmp_path):
    flags, said = CASES[case]
    (tmp_path / "split.json").write_text("{not json")
    (tmp_path / "a-file").write_text("mine")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("theirs")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    out = tmp_path / "results"
    argv = [f.format(model=model, tmp=tmp_path, out=out) for f in flags]
    if "--out" not in argv:
        argv += ["--out", str(out)]
    proc = subprocess.run([sys.executable, "-m", "arpo_cli.cli", "eval", "--desktops", "1", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, (case, proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("arpo eval: ") and said in lines[0], (case, proc.stderr)
    assert "arpo-serve ready" not in proc.stderr and proc.stdout == ""
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before  # nothing made or removed
    assert (tmp_path / "a-file").read_text() == "mine" and (tmp_path / "theirs" / "notes.txt").read_text() == "theirs"
    assert processes_mentioning(str(model)) == []  # no arpo-serve was left (none was started: no serve.log)
