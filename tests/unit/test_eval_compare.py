"""`arpo eval --compare A B` (issue 50 item 4) on reports written by the real report code: the rows, the
difference, whether it exceeds the intervals, the provenance that differs, the fallback for an older report; and
hostile inputs (a FIFO, a huge file, a link, not JSON, wrong types...), each one line and exit 2, nothing hangs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors.eval.provenance import build_provenance
from actors.eval.report import build_report, write_report
from actors.eval.results import EpisodeRecord
from arpo_cli.cli import main as arpo_main
from arpo_cli.eval_compare import MAX_REPORT_BYTES

ROOT = Path(__file__).resolve().parents[2]
HEAD = "| task | A | A 95% interval | B | B 95% interval | B - A (points) | beyond intervals |"


def arpo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "arpo_cli.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def write(folder: Path, scores: dict[str, list[float]], *, commit: str, image_id: str, max_steps: int,
          hashes: dict[str, str]) -> Path:
    """A results folder's report.json and report.md as arpo eval writes them, for episodes of these scores."""
    records = [EpisodeRecord("d", task, repeat, score, score > 0.1, "success" if score > 0.1 else "failure")
               for task, runs in scores.items() for repeat, score in enumerate(runs)]
    session = {"date": "2025-01-01T00:00:00+00:00", "commit": commit, "dirty": False, "version": "0.1.0",
               "image": "arpo-desktop:x", "image_id": image_id}
    provenance = build_provenance([session], {"kind": "oracle", "name": "oracle", "weight_version": None},
                                  {"repeats": 4, "actors.max_steps": max_steps}, hashes)
    report = build_report(records, repeats=4, planned=len(records), meta={"provenance": provenance})
    write_report(folder, report)
    return folder / "report.json"


@pytest.fixture
def two_reports(tmp_path):
    a = write(tmp_path / "A", {"t1": [0.0] * 4, "t2": [0.5] * 4, "t3": [1.0] * 4}, commit="a" * 40,
              image_id="sha256:" + "1" * 64, max_steps=15, hashes={"d/t1": "h1", "d/t2": "h2", "d/t3": "h3"})
    b = write(tmp_path / "B", {"t1": [1.0] * 4, "t2": [0.5, 0.5, 0.0, 1.0], "t3": [1.0] * 4, "t4": [1.0] * 4},
              commit="b" * 40, image_id="sha256:" + "2" * 64, max_steps=50,
              hashes={"d/t1": "h1-edited", "d/t2": "h2", "d/t3": "h3", "d/t4": "h4"})
    return a, b


def rows(stdout: str) -> dict[str, list[str]]:
    return {cells[0]: cells[1:] for line in stdout.splitlines() if line.startswith("| ")
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}


def test_compare_prints_each_task_the_difference_whether_it_exceeds_the_intervals_and_the_provenance(two_reports):
    a, b = two_reports
    proc = arpo("eval", "--compare", str(a.parent), str(b))  # a folder and a report.json
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    out = proc.stdout
    assert HEAD in out and "compared: mean score (OSWorld's" in out
    table = rows(out)
    # t1: 0/4 against 4/4, Wilson intervals [0, 0.49] and [0.51, 1] do not overlap
    assert table["d/t1"][0] == "0.0%" and table["d/t1"][2] == "100.0%" and table["d/t1"][4:] == ["+100.0", "yes"]
    assert table["d/t2"][0] == table["d/t2"][2] == "50.0%" and table["d/t2"][4:] == ["+0.0", "no"]
    assert table["d/t3"][4:] == ["+0.0", "no"]
    assert table["d/t4"][:2] == ["-", "-"] and table["d/t4"][2] == "100.0%" and table["d/t4"][5] == "only in B"
    ra, rb = json.loads(a.read_text())["overall"], json.loads(b.read_text())["overall"]
    assert (ra["score_mean"], rb["score_mean"]) == (0.5, 0.875)
    beyond = "yes" if ra["score_ci95"][1] < rb["score_ci95"][0] or rb["score_ci95"][1] < ra["score_ci95"][0] else "no"
    assert table["**overall**"] == ["50.0%", f"{100 * ra['score_ci95'][0]:.1f}%-{100 * ra['score_ci95'][1]:.1f}%",
                                    "87.5%", f"{100 * rb['score_ci95'][0]:.1f}%-{100 * rb['score_ci95'][1]:.1f}%",
                                    "+37.5", beyond]
    assert list(table)[-1] == "**overall**"
    assert f"- commit: A {'a' * 40}, B {'b' * 40}" in out
    assert f"- desktop image id: A sha256:{'1' * 64}, B sha256:{'2' * 64}" in out
    assert "- tasks whose task files differ (1): d/t1" in out and "- tasks only in B (1): d/t4" in out
    assert "- settings that differ: actors.max_steps A 15, B 50" in out

    same = arpo("eval", "--compare", str(a), str(a))
    assert same.returncode == 0 and "- commit: same, " + "a" * 40 in same.stdout
    assert "- settings: same" in same.stdout and "- task set: same (3 tasks" in same.stdout
    assert {r[4] for name, r in rows(same.stdout).items() if name != "task" and not name.startswith("-")} == {"+0.0"}


def test_an_older_report_without_the_mean_score_or_provenance_is_compared_by_success_rate_and_says_so(two_reports,
                                                                                                       tmp_path,
                                                                                                       capsys):
    a, b = two_reports
    old = json.loads(b.read_text())
    for summary in [old["overall"], *old["tasks_detail"].values()]:
        del summary["score_mean"], summary["score_ci95"]
    del old["provenance"]
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "report.json").write_text(json.dumps(old))
    assert arpo_main(["eval", "--compare", str(a), str(tmp_path / "old")]) == 0
    out = capsys.readouterr().out
    assert "compared: success rate, with its 95% interval: B has no mean score" in out
    table = rows(out)
    assert table["d/t1"][0] == "0.0%" and table["d/t1"][2] == "100.0%" and table["d/t1"][5] == "yes"
    assert table["d/t2"][2] == "75.0%"  # B's success rate (3 of 4 above 0.1), not its mean score (50%)
    assert "- B has no provenance (written before arpo eval recorded it)" in out


def _hostile(tmp_path: Path, valid: Path) -> list[tuple[str, Path, str]]:
    """(case, path given as B, words the one error line must hold)."""
    cases = []

    def file(name: str, content: bytes | str) -> Path:
        path = tmp_path / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return path

    good = json.loads(valid.read_text())
    cases.append(("missing", tmp_path / "nowhere" / "report.json", "cannot be read (No such file"))
    (tmp_path / "empty-folder").mkdir()
    cases.append(("folder without a report", tmp_path / "empty-folder", "cannot be read (No such file"))
    os.symlink(valid, tmp_path / "link.json")
    cases.append(("symbolic link", tmp_path / "link.json", "is a symbolic link"))
    cases.append(("not JSON", file("text.json", "report: yes\n"), "not JSON"))
    cases.append(("not UTF-8", file("latin.json", b'{"a": "\xe9"}'), "not UTF-8"))
    cases.append(("nested too deeply", file("deep.json", "[" * 200_000 + "]" * 200_000), "nested too deeply"))
    cases.append(("a JSON list", file("list.json", "[1, 2]"), "not an arpo eval report.json"))
    cases.append(("tasks_detail a list", file("shape.json", json.dumps({**good, "tasks_detail": []})),
                  "not an arpo eval report.json"))
    wrong = json.loads(valid.read_text())
    wrong["tasks_detail"]["d/t2"]["score_mean"] = "0.5"
    cases.append(("a mean as text", file("text-mean.json", json.dumps(wrong)),
                  "tasks_detail['d/t2'].score_mean is '0.5', not a number"))
    wrong = json.loads(valid.read_text())
    wrong["overall"]["score_ci95"] = [0.1]
    cases.append(("an interval of one number", file("ci.json", json.dumps(wrong)), "overall.score_ci95 is [0.1]"))
    nan = valid.read_text().replace('"score_mean": 0.5,', '"score_mean": NaN,', 1)
    cases.append(("NaN", file("nan.json", nan), "score_mean is nan, not a number"))
    cases.append(("provenance a string", file("prov.json", json.dumps({**good, "provenance": "x"})),
                  "provenance is not an object"))
    (tmp_path / "dir-report" / "report.json").mkdir(parents=True)
    cases.append(("report.json a folder", tmp_path / "dir-report", "report.json: cannot be read (Is a directory)"))
    return cases


def test_hostile_reports_are_refused_with_one_line_naming_the_file(two_reports, tmp_path, capsys):
    a, _ = two_reports
    (tmp_path / "h").mkdir()
    cases = _hostile(tmp_path / "h", a)
    assert len(cases) == 13
    for case, path, words in cases:
        assert arpo_main(["eval", "--compare", str(a), str(path)]) == 2, case
        captured = capsys.readouterr()
        assert captured.out == "", case
        lines = captured.err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("arpo eval --compare: ") and words in lines[0], (case, lines)
        assert str(path if path.suffix == ".json" else path / "report.json") in lines[0], (case, lines)
    # damage the tool does not need is tolerated: sessions and warnings of the wrong type
    odd = json.loads(a.read_text())
    odd["provenance"].update(sessions=5, warnings=7, task_sha256=[], settings="x")
    (tmp_path / "odd.json").write_text(json.dumps(odd))
    assert arpo_main(["eval", "--compare", str(a), str(tmp_path / "odd.json")]) == 0
    assert "- commit: same, " in capsys.readouterr().out
    # --compare runs nothing: a policy flag beside it is a usage error
    assert arpo_main(["eval", "--compare", str(a), str(a), "--oracle"]) == 2
    assert "--compare compares two reports and runs nothing" in capsys.readouterr().err


def test_a_fifo_and_a_huge_file_are_refused_by_the_real_command_without_hanging(two_reports, tmp_path):
    a, _ = two_reports
    fifo = tmp_path / "fifo" / "report.json"
    fifo.parent.mkdir()
    os.mkfifo(fifo)  # nobody ever writes: a reader that opened it blocking would wait forever
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:
        f.truncate(MAX_REPORT_BYTES + 1)  # sparse: costs no disk
    for path, words in ((fifo.parent, "is not a regular file"), (huge, f"is larger than {MAX_REPORT_BYTES} bytes")):
        proc = arpo("eval", "--compare", str(a), str(path))
        assert proc.returncode == 2 and proc.stdout == "", proc
        assert proc.stderr.splitlines() == [f"arpo eval --compare: {path if path == huge else fifo} {words}"]
