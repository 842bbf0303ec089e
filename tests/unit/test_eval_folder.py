"""The results folder's rule on real files (actors.eval.folder): `arpo eval` and `evaluate` change only a folder they
made, delete only their own episode folders and never through a symbolic link; a resume trusts only finished
episodes whose files agree and only with the parameters the folder was evaluated with. Every case here is refused
or decided before any desktop starts, so none needs Docker."""
from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import threading
from pathlib import Path

import pytest

from actors.eval import evaluate
from actors.eval.folder import MANIFEST, ResultsFolder, ResultsFolderError, read_manifest
from actors.eval.results import EpisodeRecord, remove_tree_below
from actors.eval.runner import EvalSettings, claim_results, policy_identity
from arpo_async.config import RunConfig, load_config
from arpo_async.tasks import BUILTIN_DIR
from arpo_cli.cli import main as arpo_main


async def quitter(**_kw):
    """A policy that gives up at once (never called here: every case is decided before an episode runs)."""
    return "Thought: done\nAction: finished(content='done')"


def tree(root: Path) -> dict[str, tuple[str, bytes | str, int]]:
    """Every entry below ``root`` (links not followed): kind, content or link target, mtime in ns."""
    entries = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            info = path.lstat()
            if path.is_symlink():
                entries[str(path.relative_to(root))] = ("link", os.readlink(path), info.st_mtime_ns)
            elif path.is_dir():
                entries[str(path.relative_to(root))] = ("dir", b"", info.st_mtime_ns)
            elif not path.is_file():  # a FIFO: never opened
                entries[str(path.relative_to(root))] = ("other", b"", info.st_mtime_ns)
            else:
                entries[str(path.relative_to(root))] = ("file", path.read_bytes(), info.st_mtime_ns)
    return entries


def user_folder(root: Path) -> Path:
    """The issue's folder: photos and source code, whose `<a>/<b>/<digits>` folders look like episode folders."""
    for rel, data in (("photos/2024/01/holiday.jpg", b"\xff\xd8\xffJPEG"), ("src/proj/2/main.c", b"int main;\n"),
                      ("notes.txt", b"mine\n")):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def test_resume_on_a_folder_that_is_not_ours_refuses_with_one_line_and_touches_nothing(tmp_path, capsys):
    home = user_folder(tmp_path / "home")
    before = tree(home)
    argv = ["eval", "--oracle", "--tasks", "grid4-green", "--out", str(home)]
    assert arpo_main(argv + ["--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(home) in err[0] and MANIFEST in err[0], err
    assert arpo_main(argv) == 2  # creating results into it is refused too
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not empty" in err[0] and str(home) in err[0], err
    assert arpo_main(argv + ["--retry-errors"]) == 2  # needs --resume
    assert "--retry-errors needs --resume" in capsys.readouterr().err
    with pytest.raises(ResultsFolderError, match="not an arpo eval results folder"):
        asyncio.run(evaluate(quitter, "grid4-green", out=home, resume=True))
    with pytest.raises(ResultsFolderError, match="not empty"):
        asyncio.run(evaluate(quitter, "grid4-green", out=home))
    missing = tmp_path / "never-made"
    with pytest.raises(ResultsFolderError, match="no arpo-eval.json"):
        asyncio.run(evaluate(quitter, "grid4-green", out=missing, resume=True))
    assert tree(home) == before and not missing.exists()


def ours(out: Path, policy=quitter, tasks="grid4-green", **settings) -> ResultsFolder:
    """A results folder made as `evaluate` makes it (the same parameters as `evaluate(policy, tasks, ...)`)."""
    return claim_results(out, policy_identity(policy), EvalSettings(tasks, **settings), RunConfig(), resume=False)


def write(folder: ResultsFolder, repeat: int, **fields) -> Path:
    record = EpisodeRecord(**{"domain": "grid4", "task_id": "grid4-green", "repeat": repeat, "score": 1.0,
                              "success": True, "outcome": "SUCCESS", "steps": 1, **fields})
    return folder.write_episode(record, None)


def test_a_symlinked_task_folder_inside_ours_is_never_followed(tmp_path, caplog):
    out = tmp_path / "out"
    folder = ours(out, repeats=2)
    write(folder, 0)
    write(folder, 1)
    victim = tmp_path / "elsewhere"
    (victim / "grid4-green").mkdir(parents=True)  # looks like an unfinished episode: no episode.json
    (victim / "grid4-green" / "thesis.tex").write_text("years of work\n")
    finished = tmp_path / "finished-elsewhere"  # looks like a finished one
    finished.mkdir()
    (finished / "episode.json").write_text((out / "repeat-2/grid4/grid4-green/episode.json").read_text())
    (finished / "result.txt").write_text("1.0\n")
    for repeat, target in ((1, victim), (2, finished)):  # a linked domain folder, a linked episode folder
        link = out / f"repeat-{repeat}" / "grid4" / ("" if repeat == 1 else "grid4-green")
        os.rename(link, tmp_path / f"moved-{repeat}")
        os.symlink(target, link)
    before = tree(victim), tree(finished)
    with caplog.at_level(logging.WARNING), pytest.raises(ResultsFolderError, match="symbolic link") as refused:
        asyncio.run(evaluate(quitter, "grid4-green", out=out, resume=True, repeats=2))
    links = (str(out / "repeat-1" / "grid4"), str(out / "repeat-2" / "grid4" / "grid4-green"))
    assert any(link in str(refused.value) for link in links)
    assert caplog.text.count("left alone") == 2 and all(link in caplog.text for link in links)
    assert (tree(victim), tree(finished)) == before
    resumed = ResultsFolder.claim(out, read_manifest(out)["params"], resume=True)
    assert resumed.finished(max_steps=5) == {}  # a record reached through a link is not trusted
    assert (tree(victim), tree(finished)) == before


def test_only_listed_episode_folders_are_deleted_and_a_foreign_one_is_refused(tmp_path):
    out = tmp_path / "out"
    folder = ours(out, repeats=3)
    write(folder, 0)
    (out / "repeat-2/grid4/grid4-green").mkdir(parents=True)  # not listed (someone else's): not deleted, replaced
    (out / "repeat-2/grid4/grid4-green/keep.txt").write_text("mine\n")
    (out / "repeat-1/grid4/other").mkdir(parents=True)  # not listed, not a planned episode
    (out / "repeat-1/grid4/other/keep.txt").write_text("mine\n")
    listed = out / "repeat-3/grid4/grid4-green"  # listed (ours) and cut short: deleted on resume
    folder._listed.add("repeat-3/grid4/grid4-green")
    folder._manifest["episodes"].append("repeat-3/grid4/grid4-green")
    folder._save()
    listed.mkdir(parents=True)
    (listed / "step_1_20250101@000000000000.png").write_bytes(b"partial")
    with pytest.raises(ResultsFolderError, match="not made by this evaluation") as refused:
        asyncio.run(evaluate(quitter, "grid4-green", out=out, resume=True, repeats=3))
    assert str(out / "repeat-2/grid4/grid4-green") in str(refused.value)
    assert (out / "repeat-2/grid4/grid4-green/keep.txt").read_text() == "mine\n"
    assert (out / "repeat-1/grid4/other/keep.txt").read_text() == "mine\n"
    assert not listed.exists()
    assert (out / "repeat-1/grid4/grid4-green/episode.json").is_file()


@pytest.mark.parametrize("manifest", [
    '{"format": 2, "params": {"repeats": 1}, "episodes": ["../../photos/2024/01"]}',
    '{"format": 2, "params": {"repeats": 1}, "episodes": ["grid4/../x"]}',
    '{"format": 2, "params": {"repeats": 1}, "episodes": ["/etc/x"]}',
    '{"format": 2, "params": {"repeats": 1}, "episodes": ["photos"]}',
    '{"format": 2, "params": {"repeats": 1}, "episodes": ["a/b/c/d/e/f/g"]}',
    '{"format": 2, "params": {"repeats": 1}, "episodes": ["a//b"]}',
    '{"format": 2, "params": {"repeats": 1}, "episodes": [7]}',
    '{"format": 2, "params": {"repeats": 0}, "episodes": []}',
    '{"format": 2, "params": {"repeats": true}, "episodes": []}',
    '{"format": 2, "params": {"repeats": 1, "results_prefix": "../x/y"}, "episodes": []}',
    '{"format": 2, "params": {"repeats": 1, "results_prefix": ["a", "b", "c"]}, "episodes": []}',
    '{"format": 2, "params": {}, "episodes": []}',
    '{"format": 1, "params": {}, "episodes": ["grid4/grid4-green/0"]}',
    '{"format": 3, "params": {"repeats": 1}, "episodes": []}',
    "[" * 100_000 + "]" * 100_000,
    "not json",
    "LINK",
    "FIFO",
])
def test_a_damaged_or_forged_manifest_is_refused_with_one_line(tmp_path, manifest):
    out = user_folder(tmp_path / "out")
    path = out / MANIFEST
    if manifest == "LINK":
        (tmp_path / "real.json").write_text('{"format": 1, "params": {}, "episodes": []}')
        os.symlink(tmp_path / "real.json", path)
    elif manifest == "FIFO":
        os.mkfifo(path)  # must not hang
    else:
        path.write_text(manifest)
    before = tree(out)
    with pytest.raises(ResultsFolderError, match=MANIFEST) as refused:
        asyncio.run(evaluate(quitter, "grid4-green", out=out, resume=True))
    assert "\n" not in str(refused.value)
    assert tree(out) == before


def test_resume_refuses_other_parameters_naming_the_difference(tmp_path):
    out = tmp_path / "out"
    write(ours(out, repeats=1, max_steps=8, temperature=0.0), 0)
    assert claim_results(out, policy_identity(quitter), EvalSettings("grid4-green", max_steps=8), RunConfig(),
                         resume=True)  # the same parameters: resumed
    oracle = {"kind": "oracle", "name": "oracle", "weight_version": None}
    same = RunConfig()
    cases = [
        ("policy", oracle, EvalSettings("grid4-green", max_steps=8), same),
        ("max steps 8, this run asks 3", None, EvalSettings("grid4-green", max_steps=3), same),
        ("temperature 0.0, this run asks 1.0", None, EvalSettings("grid4-green", max_steps=8, temperature=1.0), same),
        ("task set of 1 tasks, this run asks", None, EvalSettings("grid4", max_steps=8), same),
        ("repeats 1, this run asks 2", None, EvalSettings("grid4-green", max_steps=8, repeats=2), same),
        ("seed 0, this run asks 5", None, EvalSettings("grid4-green", max_steps=8, seed=5), same),
        ("results prefix '', this run asks 'pyautogui/screenshot/m'", None,
         EvalSettings("grid4-green", max_steps=8, results_prefix="pyautogui/screenshot/m"), same),
        ("success threshold 0.1, this run asks 0.5", None, EvalSettings("grid4-green", max_steps=8),
         load_config(None, ["learner.success_threshold=0.5"])),
        ("actors.prompt_style 'compact', this run asks 'uitars'", None, EvalSettings("grid4-green", max_steps=8),
         load_config(None, ['actors.prompt_style="uitars"'])),
        ("actors.screen_width", None, EvalSettings("grid4-green", max_steps=8),
         load_config(None, ["actors.screen_width=1024"])),
    ]
    for words, policy, settings, config in cases:
        before = (out / MANIFEST).read_bytes()
        with pytest.raises(ResultsFolderError, match=words) as refused:
            claim_results(out, policy or policy_identity(quitter), settings, config, resume=True)
        assert str(out) in str(refused.value) and "\n" not in str(refused.value)
        assert (out / MANIFEST).read_bytes() == before  # nothing changed
    with pytest.raises(ResultsFolderError, match=f"policy python '{quitter.__module__}.quitter', this run asks "
                                                 "oracle 'oracle'"):
        claim_results(out, oracle, EvalSettings("grid4-green", max_steps=8), RunConfig(), resume=True)


def test_a_task_file_changed_since_is_a_different_task_set(tmp_path):
    tasks = tmp_path / "tasks" / "apps"
    tasks.mkdir(parents=True)
    task = json.loads((BUILTIN_DIR / "grid4-green.json").read_text())
    (tasks / "t.json").write_text(json.dumps({**task, "id": "t"}))
    out = tmp_path / "out"
    ours(out, tasks=str(tasks.parent))
    (tasks / "t.json").write_text(json.dumps({**task, "id": "t", "instruction": "Click the Red button."}))
    with pytest.raises(ResultsFolderError, match="task apps/t as it was then"):
        claim_results(out, policy_identity(quitter), EvalSettings(str(tasks.parent)), RunConfig(), resume=True)


def forgeries(folder: Path, tmp_path: Path) -> dict[str, callable]:
    """Each hostile or damaged change to a finished SUCCESS episode (score 1.0, 1 step) that a resume must not
    trust."""
    record = folder / "episode.json"

    def edit(**fields):
        def do():
            record.write_text(json.dumps({**json.loads(record.read_text()), **fields}))
            if "score" in fields:  # result.txt agrees, so that the fields' own check is what refuses
                (folder / "result.txt").write_text(f"{fields['score']}\n")
        return do

    def result(text):
        return lambda: (folder / "result.txt").write_text(text)

    def replace_with(kind, path):
        def do():
            path.unlink()
            if kind == "fifo":
                os.mkfifo(path)
            else:
                target = tmp_path / f"target-{path.parent.name}-{path.name}"  # what the file held, elsewhere
                target.write_text("1.0\n" if path.name == "result.txt" else record_text)
                os.symlink(target, path)
        return do

    record_text = record.read_text()
    return {
        "success with a NaN score": edit(score=math.nan),
        "success with an infinite score": edit(score=math.inf),
        "success with an env_error outcome": edit(outcome="ENV_ERROR"),
        "score above 1": edit(score=1.5),
        "score below 0": edit(score=-0.5, success=False, outcome="FAILURE"),
        "success with a score at the threshold": edit(score=0.1),
        "failure with a winning score": edit(success=False, outcome="FAILURE"),
        "policy error counted as a success": edit(outcome="POLICY_ERROR"),
        "an unknown outcome": edit(outcome="WON"),
        "an error outcome without an error": edit(success=False, outcome="ABORTED", score=0.0),
        "an error with a score": edit(success=False, outcome="ENV_ERROR", error="ENV_ERROR: x"),
        "an error with success": edit(outcome="ENV_ERROR", error="ENV_ERROR: x", score=0.0),
        "an error with a result.txt": edit(success=False, outcome="ENV_ERROR", error="ENV_ERROR: x", score=0.0),
        "more steps than the budget": edit(steps=99),
        "negative steps": edit(steps=-1),
        "negative seconds": edit(seconds=-5.0),
        "a string outcome of another type": edit(outcome=7),
        "a weight version that is not an integer": edit(policy_version="3"),
        "another episode's record": edit(repeat=1),
        "result.txt contradicts the score": result("0.0\n"),
        "result.txt not a number": result("one\n"),
        "result.txt missing": lambda: (folder / "result.txt").unlink(),
        "result.txt a FIFO": replace_with("fifo", folder / "result.txt"),
        "result.txt a link": replace_with("link", folder / "result.txt"),
        "episode.json a FIFO": replace_with("fifo", record),
        "episode.json a link": replace_with("link", record),
        "episode.json deeply nested": lambda: record.write_text("[" * 100_000 + "]" * 100_000),
        "episode.json larger than its cap": lambda: record.write_text(
            json.dumps({**json.loads(record_text), "instruction": "x" * (2 << 20)})),
    }


def test_a_resume_reruns_every_finished_episode_whose_files_disagree(tmp_path, caplog):
    out = tmp_path / "out"
    names = list(forgeries(write(ours(tmp_path / "probe"), 0), tmp_path))
    count = len(names)
    folder = ours(out, repeats=count + 1)
    episodes = [write(folder, r) for r in range(count + 1)]
    honest = episodes[-1]  # the last one is left as written: trusted
    for i, name in enumerate(names):  # episode i gets forgery i
        forgeries(episodes[i], tmp_path)[name]()
    done = threading.Event()
    resumed = {}

    def run():
        with caplog.at_level(logging.WARNING):
            resumed["folder"] = ResultsFolder.claim(out, read_manifest(out)["params"], resume=True)
            resumed["finished"] = resumed["folder"].finished(max_steps=5)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(60), "reading a forged results folder hung (a FIFO read?)"
    assert set(resumed["finished"]) == {("grid4", "grid4-green", count)}, names
    for i, name in enumerate(names):
        assert f"{episodes[i]}/episode.json" in caplog.text, name
    assert caplog.text.count("the episode runs again") == count
    assert honest.is_dir()
    # a re-run replaces the forged folder (listed: ours) with the new result
    record = EpisodeRecord(domain="grid4", task_id="grid4-green", repeat=0, score=0.0, success=False,
                           outcome="FAILURE", steps=1)
    resumed["folder"].write_episode(record, None)
    assert json.loads((episodes[0] / "episode.json").read_text())["score"] == 0.0
    assert (episodes[0] / "result.txt").read_text() == "0.0\n"


def test_removing_an_episode_folder_never_follows_a_link_on_the_way_or_inside(tmp_path):
    out, victim = tmp_path / "out", tmp_path / "victim"
    (victim / "0").mkdir(parents=True)
    (victim / "0" / "holiday.jpg").write_bytes(b"JPEG")
    (out / "d").mkdir(parents=True)
    os.symlink(victim, out / "d" / "t")  # a link where the task folder should be
    with pytest.raises(OSError):
        remove_tree_below(out, ["d", "t", "0"])
    os.symlink(victim / "0", out / "d" / "1")  # a link as the episode folder itself
    with pytest.raises(OSError):
        remove_tree_below(out, ["d", "1"])
    (out / "d" / "2").mkdir()
    os.symlink(victim / "0" / "holiday.jpg", out / "d" / "2" / "step_1.png")  # a link inside: removed, not followed
    os.symlink(victim, out / "d" / "2" / "sub")
    remove_tree_below(out, ["d", "2"])
    assert not (out / "d" / "2").exists()
    assert (victim / "0" / "holiday.jpg").read_bytes() == b"JPEG"
