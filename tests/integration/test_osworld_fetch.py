"""`arpo osworld fetch` as a real subprocess against a real HTTP server on 127.0.0.1: five of OSWorld's task files
(tests/data/tasks/osworld_files) with their URLs rewritten to the server, fetched into a mirror that the download
cache then serves from; a killed fetch resumed; and hostile servers and mirrors (404, over the cap with and without
Content-Length, a hanging server, a web page for a file, a 503 that passes on retry, a symlink and a foreign file at
a file's place, a symlinked domain folder, corrupt partial and complete files, a manifest that is not ours)."""
from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest
from aiohttp import web

from actors.osworld.downloads import run_download_cache
from actors.osworld.fetch import drive_link_problem
from actors.osworld.task_files import task_files
from arpo_async.task_sets import load_task_set
from tests.support import catch_all_http_server

DATA = Path(__file__).resolve().parents[1] / "data" / "tasks" / "osworld_files"
REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 180.0


def body(name: str) -> bytes:
    """The content the server sends for the file named ``name`` (about 20 kB)."""
    return (name.encode() + b" of OSWorld's file cache\n") * 600


class Server:
    """Serves ``/<n>/<name>``: ``body(name)``, or what ``modes[name]`` says: 404, big (Content-Length over the
    cap), chunked_big (no Content-Length, over the cap), hang (headers, then nothing), html (a web page),
    503_once (503, then the file), cut (half the file, then ``cut_sent`` is set and it waits)."""

    def __init__(self) -> None:
        self.modes: dict[str, str] = {}
        self.hits: dict[str, int] = {}
        self.cut_sent = asyncio.Event()
        self.release = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        name = request.path.rsplit("/", 1)[-1]
        self.hits[name] = self.hits.get(name, 0) + 1
        mode = self.modes.get(name, "ok")
        if mode == "404":
            return web.Response(status=404, text="no such file")
        if mode == "503_once" and self.hits[name] == 1:
            return web.Response(status=503, text="busy")
        if mode == "big":
            return web.Response(body=b"x" * 200_000)
        if mode == "html":
            return web.Response(text="<html>Google Drive can't scan this file for viruses</html>",
                                content_type="text/html")
        if mode in ("chunked_big", "hang", "cut"):
            resp = web.StreamResponse()
            if mode == "cut":
                resp.content_length = len(body(name))
            else:
                resp.enable_chunked_encoding()
            await resp.prepare(request)
            if mode == "chunked_big":
                for _ in range(20):
                    await resp.write(b"y" * 10_000)
                await resp.write_eof()
                return resp
            if mode == "cut":
                await resp.write(body(name)[: len(body(name)) // 2])
                self.cut_sent.set()
            await self.release.wait()
            return resp
        return web.Response(body=body(name))


@pytest.fixture
async def server():
    srv = Server()
    async with catch_all_http_server(srv.handle) as base:
        try:
            yield srv, base
        finally:
            srv.release.set()


def local_tasks(folder: Path, base: str) -> dict[str, str]:
    """Copy the task files to ``folder`` with each URL rewritten to ``base/<n>/<name of its first file>``; returns
    {new URL: name}."""
    files = task_files(load_task_set(DATA))
    new = {}
    for f in files:
        new.setdefault(f.url, f"{base}/{len(new)}/{f.name}")
    shutil.copytree(DATA, folder)
    for path in folder.rglob("*.json"):
        text = path.read_text(encoding="utf-8")
        for old, url in new.items():
            text = text.replace(json.dumps(old)[1:-1], url)
        path.write_text(text, encoding="utf-8")
    return {url: url.rsplit("/", 1)[1] for url in new.values()}


async def fetch(tasks: Path, mirror: Path, *extra: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "arpo_cli", "osworld", "fetch", "--tasks", str(tasks), "--to", str(mirror), *extra,
        cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), DEADLINE_S)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return proc.returncode, out.decode(), err.decode()


def manifest(mirror: Path) -> dict:
    return json.loads((mirror / "arpo-mirror.json").read_text())


async def test_fetch_fills_the_mirror_the_download_cache_reads_and_a_rerun_keeps_it(server, tmp_path):
    srv, base = server
    local_tasks(tmp_path / "tasks", base)
    mirror = tmp_path / "mirror"
    rc, out, err = await fetch(tmp_path / "tasks", mirror)
    assert rc == 0, (out, err)
    assert "9 fetched, 0 already present, 0 failed of 9 files" in out
    files = task_files(load_task_set(tmp_path / "tasks"))
    record = manifest(mirror)
    assert set(record["files"]) == {str(f.relpath) for f in files} and record["failed"] == {}
    for f in files:
        data = (mirror / f.relpath).read_bytes()
        first = f.url.rsplit("/", 1)[1]  # files sharing a URL get the content served under its first name
        assert data == body(first)
        assert record["files"][str(f.relpath)] == {**record["files"][str(f.relpath)], "url": f.url,
                                                   "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert srv.hits["thunderbird-profile.tar.gz"] == 1  # two tasks, one URL, one download
    assert not list((mirror / ".arpo-partial").iterdir())

    # the download cache (learner.osworld_files) finds every file in the mirror with the server gone
    srv.modes.update({f.url.rsplit("/", 1)[1]: "404" for f in files})
    cache = run_download_cache(tmp_path / "run", str(mirror))
    for f in files:
        assert await cache.fetch(f.url, f.name, f.task_id) == mirror / f.relpath
    assert not (tmp_path / "run" / "cache" / "downloads" / "blobs").exists()

    # a re-run keeps what matches and fetches again the one file of ours that was damaged
    srv.modes.clear()
    damaged = mirror / files[0].relpath
    damaged.write_bytes(b"truncated")
    hits = dict(srv.hits)
    rc, out, err = await fetch(tmp_path / "tasks", mirror)
    assert rc == 0, (out, err)
    assert "1 fetched, 8 already present, 0 failed of 9 files" in out
    assert damaged.read_bytes() == body(files[0].url.rsplit("/", 1)[1])
    assert {k: v - hits.get(k, 0) for k, v in srv.hits.items() if v != hits.get(k, 0)} == {files[0].name: 1}


async def test_a_killed_fetch_resumes_from_what_it_recorded(server, tmp_path):
    srv, base = server
    local_tasks(tmp_path / "tasks", base)
    mirror = tmp_path / "mirror"
    srv.modes["Employee_Age_By_Birthday.xlsx"] = "cut"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "arpo_cli", "osworld", "fetch", "--tasks", str(tmp_path / "tasks"), "--to",
        str(mirror), "--concurrency", "1", cwd=REPO, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL)
    try:
        await asyncio.wait_for(srv.cut_sent.wait(), DEADLINE_S)
    finally:
        proc.kill()
        await proc.wait()
    target = mirror / "libreoffice_calc/4e6fcf72-daf3-439f-a232-c434ce416af6/Employee_Age_By_Birthday.xlsx"
    assert not target.exists()  # never a partial file in its place
    leftovers = list((mirror / ".arpo-partial").glob("*.part"))
    assert leftovers, "the cut download was in .arpo-partial"
    recorded = manifest(mirror)["files"] if (mirror / "arpo-mirror.json").exists() else {}
    # a file is recorded before it is moved into place: what the killed run recorded is complete or not there
    before = {rel for rel in recorded if (mirror / rel).exists()}
    for rel in before:
        assert hashlib.sha256((mirror / rel).read_bytes()).hexdigest() == recorded[rel]["sha256"]
    assert all((mirror / f.relpath).exists() <= (str(f.relpath) in recorded)  # nothing of ours unrecorded
               for f in task_files(load_task_set(tmp_path / "tasks")))
    # a corrupt partial file and one planted beside it: neither is trusted, both go
    with leftovers[0].open("ab") as f:
        f.write(b"garbage after the cut")
    (mirror / ".arpo-partial" / "planted.part").write_bytes(b"not a download")
    srv.modes.clear()
    hits = dict(srv.hits)
    rc, out, err = await fetch(tmp_path / "tasks", mirror)
    assert rc == 0, (out, err)
    assert "already present, 0 failed of 9 files" in out and f"{len(before)} already present" in out
    assert target.read_bytes() == body("Employee_Age_By_Birthday.xlsx")
    assert not list((mirror / ".arpo-partial").glob("*.part"))
    refetched = {k for k, v in srv.hits.items() if v != hits.get(k, 0)}
    assert not refetched & {Path(rel).name for rel in before}  # recorded files were not downloaded again


async def test_failures_are_listed_each_with_its_reason_and_nothing_foreign_is_touched(server, tmp_path):
    srv, base = server
    local_tasks(tmp_path / "tasks", base)
    for domain, name, mode in (("vlc", "chunked.mp4", "chunked_big"), ("os", "fine.txt", "ok")):
        (tmp_path / "tasks" / domain).mkdir()
        task = {"id": f"{domain}-task", "instruction": "x",
                "config": [{"type": "download", "parameters": {"files": [
                    {"url": f"{base}/9/{name}", "path": f"/home/user/{name}"}]}}],
                "evaluator": {"func": "exact_match", "result": {"type": "vm_file", "path": "/x", "dest": "x"},
                              "expected": {"type": "rule", "rules": {"expected": "x"}}}}
        (tmp_path / "tasks" / domain / f"{domain}-task.json").write_text(json.dumps(task))
        srv.modes[name] = mode
    srv.modes.update({"Customers_New_7digit_Id.xlsx": "404", "Customers_New_7digit_Id_gold.xlsx": "big",
                      "Customers_New_7digit_Id_gold-Sheet1.csv": "hang", "Employee_Age_By_Birthday.xlsx": "html",
                      "Employee_Age_By_Birthday_gold.xlsx": "503_once"})
    mirror, outside = tmp_path / "mirror", tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_bytes(b"keep me")
    apps = mirror / "multi_apps" / "6f4073b8-d8ea-4ade-8a18-c5d1d5d5aa9a"
    apps.mkdir(parents=True)
    (apps / "ConferenceCity.xlsx").symlink_to(outside / "secret.txt")
    (apps / "ConferenceCity_Gold.xlsx").write_bytes(b"the user's own copy")
    (mirror / "vlc").symlink_to(outside, target_is_directory=True)
    (mirror / "notes.txt").write_bytes(b"a user's note")

    rc, out, err = await fetch(tmp_path / "tasks", mirror, "--max-mb", "0.1", "--timeout-s", "3", "--retries", "1")
    assert rc == 1, (out, err)
    calc = "libreoffice_calc/0bf05a7d-b28b-44d2-955a-50b41e24012a"
    calc2 = "libreoffice_calc/4e6fcf72-daf3-439f-a232-c434ce416af6"
    failed = manifest(mirror)["failed"]
    assert {rel: rec["kind"] for rel, rec in failed.items()} == {
        f"{calc}/Customers_New_7digit_Id.xlsx": "http", f"{calc}/Customers_New_7digit_Id_gold.xlsx": "too_large",
        f"{calc}/Customers_New_7digit_Id_gold-Sheet1.csv": "timeout", f"{calc2}/Employee_Age_By_Birthday.xlsx":
        "web_page", "multi_apps/6f4073b8-d8ea-4ade-8a18-c5d1d5d5aa9a/ConferenceCity.xlsx": "symlink",
        "multi_apps/6f4073b8-d8ea-4ade-8a18-c5d1d5d5aa9a/ConferenceCity_Gold.xlsx": "foreign",
        "vlc/vlc-task/chunked.mp4": "symlink"}
    for rel, rec in failed.items():
        assert f"FAILED {rel} [{rec['kind']}] {rec['error']}" in out
    assert "HTTP 404" in failed[f"{calc}/Customers_New_7digit_Id.xlsx"]["error"]
    assert "not complete within 3 s" in failed[f"{calc}/Customers_New_7digit_Id_gold-Sheet1.csv"]["error"]
    assert "4 fetched, 0 already present, 7 failed of 11 files" in out
    assert srv.hits["Customers_New_7digit_Id_gold-Sheet1.csv"] == 2  # a missed deadline is tried again
    assert srv.hits["Customers_New_7digit_Id.xlsx"] == 1  # a 404 is not
    assert srv.hits["Employee_Age_By_Birthday_gold.xlsx"] == 2  # 503, then the file
    assert (mirror / calc2 / "Employee_Age_By_Birthday_gold.xlsx").read_bytes() == body(
        "Employee_Age_By_Birthday_gold.xlsx")
    assert "chunked.mp4" not in srv.hits  # nothing fetched for a place behind a symlink
    # the foreign file, the symlink, what it points to and the linked folder are untouched and reported
    assert (outside / "secret.txt").read_bytes() == b"keep me" and sorted(p.name for p in outside.iterdir()) == [
        "secret.txt"]
    assert (apps / "ConferenceCity_Gold.xlsx").read_bytes() == b"the user's own copy"
    assert (apps / "ConferenceCity.xlsx").is_symlink() and (mirror / "vlc").is_symlink()
    assert manifest(mirror)["left_alone"] == [
        "multi_apps/6f4073b8-d8ea-4ade-8a18-c5d1d5d5aa9a/ConferenceCity.xlsx",
        "multi_apps/6f4073b8-d8ea-4ade-8a18-c5d1d5d5aa9a/ConferenceCity_Gold.xlsx", "notes.txt", "vlc"]
    assert "4 paths in the mirror that arpo did not write, left alone" in out
    assert not list((mirror / ".arpo-partial").iterdir())

    # over the cap without a Content-Length: the body is cut at the cap
    (mirror / "vlc").unlink()
    rc, out, err = await fetch(tmp_path / "tasks", mirror, "--max-mb", "0.1", "--timeout-s", "3", "--retries", "0")
    assert rc == 1
    assert manifest(mirror)["failed"]["vlc/vlc-task/chunked.mp4"]["kind"] == "too_large"
    assert not (mirror / "vlc" / "vlc-task" / "chunked.mp4").exists()


async def test_a_mirror_that_cannot_be_used_is_refused_in_one_line(tmp_path):
    tasks = tmp_path / "tasks"
    shutil.copytree(DATA, tasks)  # its URLs are never asked for: every case stops first
    cases = {}
    cases["file"] = tmp_path / "file"
    cases["file"].write_text("a file")
    cases["foreign_manifest"] = tmp_path / "foreign"
    cases["foreign_manifest"].mkdir()
    (cases["foreign_manifest"] / "arpo-mirror.json").write_text('{"files": {}}')
    cases["bad_record"] = tmp_path / "bad"
    cases["bad_record"].mkdir()
    (cases["bad_record"] / "arpo-mirror.json").write_text(
        json.dumps({"format": "arpo-osworld-mirror", "files": {"a/b/c": {"url": "u", "size": -1, "sha256": "x"}}}))
    cases["linked_manifest"] = tmp_path / "linked"
    cases["linked_manifest"].mkdir()
    (cases["linked_manifest"] / "arpo-mirror.json").symlink_to(tmp_path / "file")
    cases["linked_partial"] = tmp_path / "linkedpartial"
    cases["linked_partial"].mkdir()
    (cases["linked_partial"] / ".arpo-partial").symlink_to(tmp_path, target_is_directory=True)
    expected = {"file": "cannot use it as the mirror folder", "foreign_manifest": "not an arpo mirror manifest",
                "bad_record": "field 'files.a/b/c'", "linked_manifest": "is a symlink",
                "linked_partial": ".arpo-partial is a symlink"}
    for case, mirror in cases.items():
        before = sorted((p.name, p.is_symlink()) for p in mirror.parent.iterdir())
        rc, out, err = await fetch(tasks, mirror)
        assert rc == 2 and expected[case] in err and len(err.strip().splitlines()) == 2, (case, err)
        assert sorted((p.name, p.is_symlink()) for p in mirror.parent.iterdir()) == before
    assert (tmp_path / "file").read_text() == "a file"
    rc, _, err = await fetch(tmp_path / "missing", tmp_path / "m")
    assert rc == 2 and "not a folder of task files" in err and not (tmp_path / "m").exists()


def test_google_drive_links_fetched_only_in_the_direct_download_form():
    assert drive_link_problem("https://drive.google.com/uc?export=download&id=1AbC") == ""
    assert drive_link_problem("https://drive.usercontent.google.com/download?id=1AbC&export=download") == ""
    assert drive_link_problem("https://example.org/file/d/1AbC/view") == ""
    for url in ("https://drive.google.com/file/d/1AbC/view?usp=sharing", "https://drive.google.com/uc?export=download",
                "https://drive.google.com/drive/folders/1AbC"):
        assert "not a direct download" in drive_link_problem(url)


async def test_a_url_that_cannot_be_parsed_fails_at_once(tmp_path):
    from actors.osworld.fetch import FetchOptions, Outcome, fetch_mirror
    from actors.osworld.task_files import TaskFile

    bad = TaskFile("os", "t", "a.txt", "http://exa mple.com:99999/x", "setup")
    report = await asyncio.wait_for(fetch_mirror([bad], tmp_path / "m", FetchOptions(retries=5, backoff_s=60)),
                                    DEADLINE_S / 3)  # with retries, the backoff alone would pass the deadline
    assert [(r.outcome, r.kind) for r in report.results] == [(Outcome.FAILED, "url")]
    assert manifest(tmp_path / "m")["failed"]["os/t/a.txt"]["kind"] == "url"
