"""Provenance of an evaluation (issue 50 item 4): the commit of a real git checkout and nothing for a folder that
is not the top of one; task hashes as the manifest pins them; the settings that change a score; sessions kept in a
real results folder's manifest across claims, with a plain warning when their commit or image differ."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import subprocess

from actors.eval.folder import MANIFEST, ResultsFolder, run_params
from actors.eval.provenance import (UNKNOWN, attach_task_hashes, build_provenance, image_id, provenance_lines,
                                    score_settings, session_warnings, source_commit, task_hashes, task_set_hash)
from actors.eval.report import build_report, render_markdown
from actors.eval.results import EpisodeRecord
from arpo_async.config import RunConfig
from arpo_async.task_sets import load_task_set


def git(root, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.org", "-C", str(root), *args],
                          check=True, capture_output=True, text=True, timeout=60).stdout.strip()


def test_the_commit_of_a_git_checkout_its_dirtiness_and_unknown_for_a_folder_that_is_not_its_top(tmp_path):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    git(tmp_path, "init", "-q", str(repo))
    (repo / "pkg" / "code.py").write_text("x = 1\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "first")
    head = git(repo, "rev-parse", "HEAD")
    assert source_commit(repo) == (head, False)
    (repo / "pkg" / "code.py").write_text("x = 2\n")  # a tracked file changed: the commit no longer says it all
    assert source_commit(repo) == (head, True)
    (repo / "untracked.txt").write_text("notes")  # untracked files do not count
    git(repo, "checkout", "-q", "--", "pkg/code.py")
    assert source_commit(repo) == (head, False)
    # an installed package sitting inside some other repository's folder is not that repository's code
    assert source_commit(repo / "pkg") == (UNKNOWN, None)
    plain = tmp_path / "plain"
    plain.mkdir()
    assert source_commit(plain) == (UNKNOWN, None)
    assert source_commit(tmp_path / "missing") == (UNKNOWN, None)


async def test_the_id_of_an_image_the_engine_does_not_hold_is_unknown_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        assert await image_id("arpo-no-such-image:0123456789ab") == UNKNOWN
    assert "arpo-no-such-image:0123456789ab: its id is unknown" in caplog.text


def test_task_hashes_are_the_manifests_and_change_with_the_task_file(tmp_path):
    (tmp_path / "d").mkdir()
    task = load_task_set("grid4-green")[0].task.to_dict()
    (tmp_path / "d" / "t1.json").write_text(json.dumps({**task, "id": "t1"}))
    entries = load_task_set(tmp_path)
    hashes = task_hashes(entries)
    params = run_params({"kind": "oracle"}, entries, repeats=1, seed=0, tokenizer="m", success_threshold=0.1,
                        actors=RunConfig().actors)
    assert hashes == params["tasks"] and list(hashes) == ["d/t1"]
    # the set's hash: sha256 of the sorted "<name> <sha256>\n" lines
    assert task_set_hash(hashes) == hashlib.sha256(f"d/t1 {hashes['d/t1']}\n".encode()).hexdigest()
    (tmp_path / "d" / "t1.json").write_text(json.dumps({**task, "id": "t1", "instruction": "another"}))
    assert task_hashes(load_task_set(tmp_path))["d/t1"] != hashes["d/t1"]
    # the same task written with other spacing and key order hashes alike: the canonical JSON, not the bytes
    (tmp_path / "d" / "t1.json").write_text(json.dumps(dict(reversed(list({**task, "id": "t1"}.items()))), indent=4))
    assert task_hashes(load_task_set(tmp_path)) == hashes


def test_score_settings_hold_every_knob_that_changes_a_score_and_serve_only_for_a_served_model():
    config = RunConfig()
    config = dataclasses.replace(config, actors=dataclasses.replace(config.actors, max_steps=15, constrained=False))
    settings = score_settings(config, repeats=3, seed=7, policy_kind="url")
    assert (settings["repeats"], settings["seed"], settings["actors.max_steps"]) == (3, 7, 15)
    assert settings["actors.constrained"] is False
    for key in ("actors.temperature", "actors.coordinate_mode", "actors.prompt_style", "actors.screen_width",
                "actors.screen_height", "actors.history_images", "learner.success_threshold", "model",
                "actors.settle_interval_s", "actors.policy_timeout_s", "actors.image"):
        assert key in settings, key
    assert not any(k.startswith("serve.") for k in settings)
    assert score_settings(config, repeats=1, seed=0, policy_kind="model")["serve.dtype"] == config.serve.dtype
    assert "actors.actors" not in settings and "actors.warm_spares" not in settings  # speed, not scores
    json.dumps(settings)  # goes into report.json as is


def _session(date: str, commit: str, image: str) -> dict:
    return {"date": date, "commit": commit, "dirty": False, "version": "0.1.0", "image": "arpo-desktop:x",
            "image_id": image}


def test_sessions_persist_in_the_manifest_across_claims_and_a_change_of_commit_or_image_is_said(tmp_path, caplog):
    entries = load_task_set("grid4-green")
    params = run_params({"kind": "oracle", "name": "oracle", "weight_version": None}, entries, repeats=1, seed=0,
                        tokenizer="m", success_threshold=0.1, actors=RunConfig().actors)
    out = tmp_path / "out"
    first = _session("2025-01-01T00:00:00+00:00", "a" * 40, "sha256:" + "1" * 64)
    assert ResultsFolder.claim(out, params, resume=False).add_session(first) == [first]
    same = _session("2025-01-02T00:00:00+00:00", "a" * 40, "sha256:" + "1" * 64)
    sessions = ResultsFolder.claim(out, params, resume=True).add_session(same)  # a resume reads it back from disk
    assert sessions == [first, same] and session_warnings(sessions) == []
    rebuilt = _session("2025-01-03T00:00:00+00:00", "b" * 40, "sha256:" + "2" * 64)
    sessions = ResultsFolder.claim(out, params, resume=True).add_session(rebuilt)
    assert json.loads((out / MANIFEST).read_text())["sessions"] == sessions == [first, same, rebuilt]
    warnings = session_warnings(sessions)
    assert len(warnings) == 2
    assert "different commits" in warnings[0] and "a" * 40 in warnings[0] and "b" * 40 in warnings[0]
    assert "different desktop images" in warnings[1] and "session 3 (2025-01-03T00:00:00+00:00): sha256:2" in \
        warnings[1]

    provenance = build_provenance(sessions, {"kind": "oracle"}, {"repeats": 1}, task_hashes(entries))
    assert (provenance["date"], provenance["commit"], provenance["image_id"]) == (
        first["date"], first["commit"], first["image_id"])  # the first session's, whatever came after
    record = EpisodeRecord("grid4", "grid4-green", 0, 1.0, True, "success")
    report = attach_task_hashes(build_report([record], repeats=1, planned=1, meta={"provenance": provenance}))
    assert report["tasks_detail"]["grid4/grid4-green"]["task_sha256"] == params["tasks"]["grid4/grid4-green"]
    markdown = render_markdown(report)
    assert markdown.count("**WARNING**") == 2 and "different desktop images" in markdown
    assert f"id `{first['image_id']}`" in markdown and f"commit `{first['commit']}`" in markdown
    assert provenance_lines({}) == []  # an older report: no header lines, no error

    # a damaged sessions list is started again, with a warning naming the manifest; the rest is kept
    manifest = json.loads((out / MANIFEST).read_text())
    (out / MANIFEST).write_text(json.dumps({**manifest, "sessions": "garbage"}))
    with caplog.at_level(logging.WARNING):
        assert ResultsFolder.claim(out, params, resume=True).add_session(first) == [first]
    assert f"{out / MANIFEST}: its sessions are not a list of objects" in caplog.text
    assert json.loads((out / MANIFEST).read_text())["params"] == params
