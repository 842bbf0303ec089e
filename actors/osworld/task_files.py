"""The files a set of OSWorld tasks names: every URL a task's setup steps download and its evaluator fetches,
with the place each one has in the mirror of OSWorld's files (``learner.osworld_files``).

A task names a file in three places (OSWorld's task JSON, evaluation_examples/examples/<domain>/<id>.json in
https://github.com/xlang-ai/OSWorld; checked against all 369 of its tasks):

- a ``download`` step in ``config``: ``parameters.files[i] = {"url", "path"}`` (OSWorld's
  SetupController._download_setup, desktop_env/controllers/setup.py), kind ``setup``;
- the same step in ``evaluator.postconfig`` (run by the same controller after the episode), kind ``setup``;
- a ``cloud_file`` getter in ``evaluator.result`` / ``evaluator.expected`` (each a getter or a list of them):
  ``path`` is the URL and ``dest`` the file name, or with ``"multi": true`` lists of both, paired in order
  (OSWorld's get_cloud_file, desktop_env/evaluators/getters/file.py), kind ``evaluator``.

Other URLs in tasks (``chrome_open_tabs``, ``update_browse_history``, ``open``ed web pages, the goto_prefix and
url of browser-page getters, the ``googledrive`` step's) are live web pages or another service's, not files;
they are not listed.

A file's place in the mirror is ``<domain>/<task id>/<name>``: the domain is the task file's folder, the task
id is the task's ``id`` field (what :class:`actors.osworld.downloads.DownloadCache` looks the mirror up by; in
OSWorld's own data 15 thunderbird files' ``id`` differs from their file name, and the id is what counts), and
the name is the basename of the step's ``path`` or the getter's ``dest``, as the download cache asks for it.

Invariants: each (domain, task id, name) appears once in :func:`task_files`'s answer (a task naming the same
file twice with the same URL is listed once); every part is one safe path component (not empty, not ``.`` or
``..``, no ``/``, ``\\`` or NUL, at most 255 bytes) and every URL is http(s), so a mirror path built from them
never leaves the mirror. A reference that breaks this is left out and reported by :func:`scan_task_files`.
"""
from __future__ import annotations

import posixpath
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

SETUP = "setup"
EVALUATOR = "evaluator"


@dataclass(frozen=True)
class TaskFile:
    """One file a task names.

    Attributes:
        domain: the task's domain (the folder of its task file), the mirror's first level.
        task_id: the task's ``id`` field, the mirror's second level.
        name: the file's name in the mirror (basename of the ``download`` step's ``path`` or the getter's ``dest``).
        url: the http(s) URL OSWorld fetches it from.
        kind: ``setup`` (a ``download`` step, in ``config`` or ``evaluator.postconfig``) or ``evaluator`` (a
            ``cloud_file`` getter).
        where: the field that names it, e.g. ``config[1].parameters.files[0]`` or ``evaluator.expected.path[2]``.
    """

    domain: str
    task_id: str
    name: str
    url: str
    kind: str
    where: str = ""

    @property
    def relpath(self) -> PurePosixPath:
        """``<domain>/<task id>/<name>``, the file's path relative to the mirror."""
        return PurePosixPath(self.domain, self.task_id, self.name)


def _bad_component(part: Any) -> str:
    """Why ``part`` cannot be one path component ("" when it can)."""
    if not isinstance(part, str) or not part:
        return "empty or not a string"
    if part in (".", ".."):
        return f"{part!r} is not a file name"
    if any(c in part for c in ("/", "\\", "\0")):
        return f"{part[:80]!r} holds '/', '\\' or NUL"
    if len(part.encode("utf-8", "surrogatepass")) > 255:
        return "longer than 255 bytes"
    return ""


def _download_refs(steps: Any, prefix: str) -> Iterable[tuple[str, Any, Any, str]]:
    for i, step in enumerate(steps if isinstance(steps, list) else []):
        if not isinstance(step, dict) or step.get("type") != "download":
            continue
        params = step.get("parameters")
        files = params.get("files") if isinstance(params, dict) else None
        for j, f in enumerate(files if isinstance(files, list) else [None]):
            where = f"{prefix}[{i}].parameters.files[{j}]"
            f = f if isinstance(f, dict) else {}
            path = f.get("path")
            yield where, f.get("url"), posixpath.basename(path) if isinstance(path, str) else path, SETUP


def _cloud_refs(ev: dict) -> Iterable[tuple[str, Any, Any, str]]:
    for key in ("result", "expected"):
        getters = ev.get(key)
        listed = isinstance(getters, list)
        for k, g in enumerate(getters if listed else [getters]):
            if not isinstance(g, dict) or g.get("type") != "cloud_file":
                continue
            where = f"evaluator.{key}[{k}]" if listed else f"evaluator.{key}"
            urls, dests = g.get("path"), g.get("dest")
            if g.get("multi"):
                if not isinstance(urls, list) or not isinstance(dests, list) or len(urls) != len(dests):
                    yield f"{where}.path", None, None, EVALUATOR  # reported: multi needs equal lists
                    continue
                for n, (url, dest) in enumerate(zip(urls, dests)):
                    yield f"{where}.path[{n}]", url, _base(dest), EVALUATOR
            else:
                yield f"{where}.path", urls, _base(dests), EVALUATOR


def _base(dest: Any) -> Any:
    return PurePosixPath(dest).name if isinstance(dest, str) else dest


def scan_task_files(entries: Iterable[Any]) -> tuple[list[TaskFile], list[str]]:
    """The files ``entries`` name (see the module docstring), and one line for each reference left out.

    Args:
        entries: :class:`arpo_async.task_sets.TaskEntry` items (``domain`` and ``task``; an entry whose task did
            not load, ``task`` None, is reported with its ``error``).
    Returns:
        (files in task order, each (domain, task id, name) once; problems, each ``<domain>/<task id>: <field>:
        <what is wrong>``): a URL that is not http(s), a name or domain or id that is not one safe path
        component, a ``multi`` cloud_file whose ``path`` and ``dest`` are not lists of one length, or the same
        mirror path named with two different URLs (the first is kept).
    """
    files: list[TaskFile] = []
    problems: list[str] = []
    seen: dict[tuple[str, str, str], str] = {}
    for entry in entries:
        task = entry.task
        if task is None:
            problems.append(f"{entry.domain}/{entry.task_id}: not loaded ({entry.error})")
            continue
        raw = task.raw
        ev = raw.get("evaluator") if isinstance(raw.get("evaluator"), dict) else {}
        refs = [*_download_refs(raw.get("config"), "config"),
                *_download_refs(ev.get("postconfig"), "evaluator.postconfig"), *_cloud_refs(ev)]
        for where, url, name, kind in refs:
            def bad(why: str) -> None:
                problems.append(f"{entry.domain}/{task.id}: {where}: {why}")
            if url is None and name is None:
                bad("a cloud_file with multi needs 'path' and 'dest' lists of one length")
                continue
            if not isinstance(url, str) or urllib.parse.urlsplit(url).scheme not in ("http", "https"):
                bad(f"{str(url)[:120]!r} is not an http(s) URL")
                continue
            why = next((f"{label} {w}" for label, part in (("domain", entry.domain), ("task id", task.id),
                                                             ("file name", name))
                        if (w := _bad_component(part))), "")
            if why:
                bad(why)
                continue
            key = (entry.domain, task.id, name)
            if key in seen:
                if seen[key] != url:
                    bad(f"{'/'.join(key)} is also named with another URL ({seen[key][:120]}); the first is kept")
                continue
            seen[key] = url
            files.append(TaskFile(entry.domain, task.id, name, url, kind, where))
    return files, problems


def task_files(entries: Iterable[Any]) -> list[TaskFile]:
    """The files ``entries`` name, each mirror path once, in task order (:func:`scan_task_files` without the
    problems: references that are malformed are left out)."""
    return scan_task_files(entries)[0]
