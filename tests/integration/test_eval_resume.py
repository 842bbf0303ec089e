"""`arpo eval --resume` on real desktops, as a hostile or careless user tries it (issue 48, items 1 and 6): a
resume with another policy, step budget, temperature or task set is refused with one line; forged or damaged
episode records are re-run, not counted; a symlinked task folder inside OUT is never followed; errored episodes
re-run with --retry-errors only."""
from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import subprocess
from pathlib import Path

import pytest

from actors.eval import evaluate
from actors.eval.folder import MANIFEST
from actors.eval.provenance import source_commit
from actors.oracle import OraclePolicy
from arpo_async.config import load_config
from arpo_async.inference_client import PolicyUnavailable
from arpo_async.model.inputs import PromptEncoder
from arpo_async.task_sets import load_task_set, runnable_tasks
from arpo_cli.cli import main as arpo_main

pytestmark = pytest.mark.docker

MAX_STEPS = 8


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
            and not p.is_symlink()}


def test_resume_refuses_other_settings_reruns_forged_records_and_never_follows_a_link(tiny_model, desktop_image,
                                                                                      tmp_path, capsys, caplog):
    out = tmp_path / "oracle"
    base = ["eval", "--tasks", "grid4-green", "--repeats", "2", "--desktops", "2", "--max-steps", str(MAX_STEPS),
            "--out", str(out), "--set", f"actors.image={desktop_image!r}"]
    oracle = ["--oracle", "--tokenizer", str(tiny_model)]
    assert arpo_main(base + oracle) == 0
    manifest = json.loads((out / MANIFEST).read_text())
    assert sorted(manifest["episodes"]) == ["repeat-1/grid4/grid4-green", "repeat-2/grid4/grid4-green"]
    assert json.loads((out / "report.json").read_text())["overall"]["successes"] == 2
    # provenance (issue 50 item 4): this checkout's commit, the real id of the image the desktops ran, task hashes
    provenance = json.loads((out / "report.json").read_text())["provenance"]
    real_id = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", desktop_image], check=True,
                             capture_output=True, text=True, timeout=60).stdout.strip()
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", real_id)
    assert (provenance["image"], provenance["image_id"]) == (desktop_image, real_id)
    assert provenance["commit"] == source_commit()[0] and re.fullmatch(r"[0-9a-f]{40}", provenance["commit"])
    assert provenance["task_sha256"] == manifest["params"]["tasks"] and len(provenance["sessions"]) == 1
    assert provenance["settings"]["actors.max_steps"] == MAX_STEPS and provenance["warnings"] == []
    assert f"id `{real_id}`" in (out / "report.md").read_text()
    capsys.readouterr()

    # another policy, step budget, temperature or task set: one line naming the difference, exit 2, nothing changed
    before = snapshot(out)
    for flags, words in ((["--url", "http://127.0.0.1:9", "--tokenizer", str(tiny_model)],
                          "policy oracle 'oracle', this run asks url 'http://127.0.0.1:9'"),
                         (oracle + ["--max-steps", "3"], "max steps 8, this run asks 3"),
                         (oracle + ["--temperature", "1"], "temperature 0.0, this run asks 1.0"),
                         (oracle + ["--tasks", "grid4-red"], "task set of 1 tasks")):
        assert arpo_main(base + flags + ["--resume"]) == 2, flags
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("arpo eval:")]
        assert len(err) == 1 and words in err[0] and str(out) in err[0], (flags, err)
    assert snapshot(out) == before  # a refused resume records no session either

    # the image was rebuilt since the first session (its recorded id is another): the resume keeps the first
    # session's date, commit and image id, appends its own, and says plainly that they differ
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["sessions"][0]["image_id"] = "sha256:" + "0" * 64
    (out / MANIFEST).write_text(json.dumps(manifest))
    # forged: success with a NaN score; damaged: result.txt contradicting episode.json. Both run again.
    first, second = out / "repeat-1/grid4/grid4-green", out / "repeat-2/grid4/grid4-green"
    record = json.loads((first / "episode.json").read_text())
    (first / "episode.json").write_text(json.dumps({**record, "score": math.nan, "success": True}))
    (second / "result.txt").write_text("0.0\n")
    stamps = {p: (p / "episode.json").stat().st_mtime_ns for p in (first, second)}
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # a warning line each (stderr for the command; pytest captures it here)
        assert arpo_main(base + oracle + ["--resume"]) == 0
    for folder in (first, second):
        assert f"{folder / 'episode.json'}: " in caplog.text and "runs again" in caplog.text
        assert (folder / "episode.json").stat().st_mtime_ns != stamps[folder]  # re-run, folder replaced
        assert float((folder / "result.txt").read_text()) == json.loads((folder / "episode.json").read_text())[
            "score"] == 1.0
    report = json.loads((out / "report.json").read_text())
    assert report["overall"]["successes"] == 2 and report["errors"] == [] and report["complete"]
    started, resumed = report["provenance"]["sessions"]
    assert started == {**provenance["sessions"][0], "image_id": "sha256:" + "0" * 64}
    assert (report["provenance"]["date"], report["provenance"]["commit"]) == (provenance["date"],
                                                                             provenance["commit"])
    assert resumed["image_id"] == real_id and resumed["date"] >= started["date"]
    assert "ran different desktop images" in caplog.text and "sha256:" + "0" * 64 in caplog.text  # on stderr
    assert "**WARNING**: the sessions of this evaluation ran different desktop images" in (
        out / "report.md").read_text()

    # a symlinked task folder inside OUT, pointing at the user's files: never followed, nothing deleted there
    victim = tmp_path / "photos"
    (victim / "0").mkdir(parents=True)
    (victim / "0" / "holiday.jpg").write_bytes(b"\xff\xd8\xffJPEG")
    os.rename(out / "repeat-1" / "grid4", tmp_path / "moved-away")
    os.symlink(victim, out / "repeat-1" / "grid4")
    capsys.readouterr()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert arpo_main(base + oracle + ["--resume"]) == 2
    assert f"{out / 'repeat-1' / 'grid4'} is a symbolic link or not a folder: left alone" in caplog.text
    assert f"arpo eval: {out / 'repeat-1' / 'grid4'} is a symbolic link" in capsys.readouterr().err
    assert (victim / "0" / "holiday.jpg").read_bytes() == b"\xff\xd8\xffJPEG"
    assert sorted(p.name for p in victim.rglob("*")) == ["0", "holiday.jpg"]
    assert len(json.loads((out / MANIFEST).read_text())["sessions"]) == 2  # refused before it ran: no session


class ServerDownThenUp:
    """The oracle behind an inference server that is down (every call raises PolicyUnavailable, as PolicyClient
    does after its retries) until ``up`` is set."""

    def __init__(self, oracle: OraclePolicy) -> None:
        self.oracle, self.up, self.calls = oracle, False, 0

    async def generate(self, **kw):
        self.calls += 1
        if not self.up:
            raise PolicyUnavailable("connection refused (the server is down)")
        return await self.oracle.generate(**kw)

    async def aclose(self) -> None:
        pass


async def test_errored_episodes_run_again_with_retry_errors_only(tiny_model, desktop_image, tmp_path):
    config = load_config(None, [f"model={str(tiny_model)!r}", f"actors.image={desktop_image!r}"])
    encoder = PromptEncoder(tiny_model)
    policy = ServerDownThenUp(OraclePolicy(runnable_tasks(load_task_set("grid4-green")), encoder))
    kwargs = dict(tasks="grid4-green", repeats=2, desktops=2, max_steps=MAX_STEPS, config=config, encoder=encoder,
                  out=tmp_path / "out")
    down = await evaluate(policy, **kwargs)
    assert [e["outcome"] for e in down["errors"]] == ["ABORTED", "ABORTED"]
    policy.up, policy.calls = True, 0
    kept = await evaluate(policy, resume=True, **kwargs)  # the errored episodes are finished: kept
    assert policy.calls == 0 and len(kept["errors"]) == 2
    retried = await asyncio.wait_for(evaluate(policy, resume=True, retry_errors=True, **kwargs), 600)
    assert policy.calls >= 2 and retried["errors"] == [] and retried["overall"]["successes"] == 2
    # each resume appends a session; the first one's date stays the report's date
    assert [s["date"] for s in retried["provenance"]["sessions"]][0] == down["provenance"]["date"]
    assert len(retried["provenance"]["sessions"]) == 3 and retried["provenance"]["warnings"] == []
