"""Fetching OSWorld's files into a mirror (`arpo osworld fetch`): every file a task set names
(:mod:`actors.osworld.task_files`), downloaded over HTTP into ``<mirror>/<domain>/<task id>/<name>``, the layout
:class:`actors.osworld.downloads.DownloadCache` reads as ``learner.osworld_files``.

How (OSWorld's SetupController._download_setup, desktop_env/controllers/setup.py in
https://github.com/xlang-ai/OSWorld, fetches a task's URL with one plain GET, following redirects, up to 3 tries;
we do the same per URL, with these additions):

- each URL once: the files that share a URL (a Thunderbird profile many tasks download) get one download, copied
  to each place;
- resumable: the manifest (:mod:`actors.osworld.mirror_fs`) records each file's URL, size and sha256; a file the
  manifest lists whose size and sha256 still match is kept (``present``); a download goes to
  ``.arpo-partial/*.part`` and is renamed into place once complete, so an interrupted run leaves no partial file
  in the mirror, and a re-run starts the unfinished files again (leftover ``*.part`` files are removed);
- bounded: at most ``concurrency`` downloads at a time; each try has a deadline (``timeout_s``, connect to last
  byte) and a size cap (``max_bytes``; a larger Content-Length is refused before the body), the semantics of
  actors.download_timeout_s / download_max_mb;
- retries with exponential backoff and full jitter (tenacity's wait_random_exponential) for what may pass: no
  connection, a deadline missed, HTTP 408, 429 and 5xx; a 4xx, a file over the cap or a web page are final;
- a server that answers with a web page (text/html) for a file whose name is not .html is a failure: that is what
  Google Drive sends instead of the file (its virus-scan confirmation for large files, a quota or sign-in page).
  A drive.google.com URL is fetched as OSWorld does only in the simple form ``/uc?...id=...``; any other
  drive.google.com link is a failure without a request.

Outcomes are :class:`Outcome` per file; a failure carries its kind (:data:`FAILURE_KINDS`) and one line. Nothing
outside the mirror is written; nothing in it that the manifest does not list is touched (:mod:`mirror_fs`).
"""
from __future__ import annotations

import asyncio
import enum
import hashlib
import os
import shutil
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import tenacity

from actors.osworld import mirror_fs
from actors.osworld.downloads import DEFAULT_MAX_BYTES, DEFAULT_TIMEOUT_S
from actors.osworld.task_files import TaskFile

FAILURE_KINDS = ("http", "too_large", "timeout", "network", "web_page", "drive_link", "url", "symlink", "foreign",
                 "disk")
"""Why a file failed: an HTTP error status; over the size cap; the deadline passed; no connection (DNS, refused,
reset); a web page instead of the file; a drive.google.com link that is not a direct download; a URL that cannot
be parsed; a symlink or a file arpo did not write at its place (left alone); the local disk failed."""
_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class Outcome(enum.Enum):
    """What became of one file: ``FETCHED`` (downloaded now), ``PRESENT`` (already in the mirror, size and sha256
    as recorded), ``FAILED`` (see the error)."""

    FETCHED = "fetched"
    PRESENT = "present"
    FAILED = "failed"


@dataclass(frozen=True)
class FetchOptions:
    """How `arpo osworld fetch` downloads.

    Attributes:
        max_bytes: largest file, bytes (actors.download_max_mb's meaning).
        timeout_s: deadline of one try, connect to last byte, seconds (actors.download_timeout_s's meaning).
        concurrency: downloads at a time.
        retries: further tries after a failure that may pass (0 = one try).
        backoff_s: the first wait before a retry, seconds; the waits grow exponentially (full jitter), at most
            ``30 * backoff_s``.
    """

    max_bytes: int = DEFAULT_MAX_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    concurrency: int = 4
    retries: int = 2
    backoff_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_bytes <= 0 or self.timeout_s <= 0 or self.concurrency < 1 or self.retries < 0 \
                or self.backoff_s < 0:
            raise ValueError("fetch: max_bytes, timeout_s and concurrency must be > 0, retries and backoff_s >= 0")


@dataclass(frozen=True)
class FileResult:
    """One file's outcome: size (bytes) and sha256 when it is in the mirror; ``kind`` and ``error`` when not."""

    file: TaskFile
    outcome: Outcome
    size: int = 0
    sha256: str = ""
    kind: str = ""
    error: str = ""


@dataclass
class FetchReport:
    """A fetch's results, one per file in the order given, and the mirror's paths arpo did not write (left alone)."""

    results: list[FileResult] = field(default_factory=list)
    left_alone: list[str] = field(default_factory=list)

    @property
    def failed(self) -> list[FileResult]:
        """The results whose outcome is FAILED."""
        return [r for r in self.results if r.outcome is Outcome.FAILED]


class _Failure(Exception):
    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class _Retryable(_Failure):
    pass


def drive_link_problem(url: str) -> str:
    """Why ``url`` is a Google Drive link we do not fetch ("" when it is fine): a drive.google.com URL other than
    the direct-download form ``/uc?...id=<file id>`` (a ``/file/d/<id>/view`` page, a folder) needs a browser."""
    parts = urllib.parse.urlsplit(url)
    if (parts.hostname or "").lower() != "drive.google.com":
        return ""
    if parts.path == "/uc" and urllib.parse.parse_qs(parts.query).get("id"):
        return ""
    return "a Google Drive link that is not a direct download (drive.google.com/uc?export=download&id=...)"


async def fetch_mirror(files: list[TaskFile], mirror: Path, options: FetchOptions = FetchOptions(),
                       on_progress: Callable[[int], None] | None = None,
                       on_result: Callable[[FileResult], None] | None = None) -> FetchReport:
    """Fetch ``files`` into ``mirror`` (module docstring) and record them in its manifest.

    Args:
        files: what to fetch (:func:`actors.osworld.task_files.task_files`).
        mirror: the mirror folder (created if missing).
        options: caps, deadline, concurrency and retries.
        on_progress: called with each chunk's byte count as it arrives (for a progress bar).
        on_result: called with each file's result when it is known.
    Returns:
        the report (its ``failed`` are also in the manifest's ``failed``, with their kind and error).
    Raises:
        MirrorError: the mirror cannot be used (not a folder, a manifest that is not ours or malformed, a
            ``.arpo-partial`` that is a symlink); nothing was written then.
    """
    root_fd = mirror_fs.open_root(mirror)
    try:
        manifest = await asyncio.to_thread(mirror_fs.read_manifest, root_fd, mirror)
        partial_fd = await asyncio.to_thread(mirror_fs.open_partial_dir, root_fd, mirror, manifest)
        try:
            run = _Run(root_fd, partial_fd, mirror, manifest, options, on_progress or (lambda n: None),
                       on_result or (lambda r: None))
            return await run.all(files)
        finally:
            os.close(partial_fd)
    finally:
        os.close(root_fd)


class _Run:
    """One fetch: the open mirror, its manifest, the HTTP session and the results."""

    def __init__(self, root_fd: int, partial_fd: int, mirror: Path, manifest: dict, options: FetchOptions,
                 on_progress: Callable[[int], None], on_result: Callable[[FileResult], None]) -> None:
        self.root_fd, self.partial_fd, self.mirror, self.manifest = root_fd, partial_fd, mirror, manifest
        self.options, self.on_progress, self.on_result = options, on_progress, on_result
        self.results: dict[TaskFile, FileResult] = {}
        self.lock = asyncio.Lock()

    async def all(self, files: list[TaskFile]) -> FetchReport:
        by_url: dict[str, list[TaskFile]] = {}
        for f in files:
            by_url.setdefault(f.url, []).append(f)
        gate = asyncio.Semaphore(self.options.concurrency)
        timeout = aiohttp.ClientTimeout(total=None)  # each try's deadline is asyncio.timeout(timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as self.session:
            async with asyncio.TaskGroup() as tg:
                for url, group in by_url.items():
                    tg.create_task(self._group(url, group, gate))
        report = FetchReport([self.results[f] for f in files])
        report.left_alone = await asyncio.to_thread(mirror_fs.left_alone, self.mirror, self.manifest)
        async with self.lock:
            self.manifest["left_alone"] = report.left_alone
            await asyncio.to_thread(mirror_fs.write_manifest, self.root_fd, self.manifest)
        return report

    async def _finish(self, result: FileResult) -> None:
        """Record ``result``: a failure in the manifest's ``failed`` (written at once, as is a cleared one)."""
        rel = str(result.file.relpath)
        async with self.lock:
            changed = self.manifest["failed"].pop(rel, None) is not None
            if result.outcome is Outcome.FAILED:
                self.manifest["failed"][rel] = {"url": result.file.url, "kind": result.kind, "error": result.error}
                changed = True
            if changed:
                await asyncio.to_thread(mirror_fs.write_manifest, self.root_fd, self.manifest)
        self.results[result.file] = result
        self.on_result(result)

    async def _claim(self, f: TaskFile, size: int, sha: str) -> dict | None:
        """Record ``f`` in the manifest (written) before its file is moved into place, so a run killed between
        the two leaves a record of a missing file (fetched again), never a file of ours the manifest lacks;
        returns the record it replaced."""
        async with self.lock:
            old = self.manifest["files"].get(str(f.relpath))
            self.manifest["files"][str(f.relpath)] = {"url": f.url, "size": size, "sha256": sha,
                                                      "fetched_at": mirror_fs.now()}
            await asyncio.to_thread(mirror_fs.write_manifest, self.root_fd, self.manifest)
            return old

    async def _group(self, url: str, group: list[TaskFile], gate: asyncio.Semaphore) -> None:
        """Fetch one URL for the files that name it: keep those present, place the download at the others."""
        todo: list[tuple[TaskFile, int]] = []  # (file, descriptor of its folder)
        try:
            for f in group:
                try:
                    state = await asyncio.to_thread(self._check, f)
                except mirror_fs.PlacementError as exc:
                    await self._finish(FileResult(f, Outcome.FAILED, kind=exc.kind, error=str(exc)))
                    continue
                except OSError as exc:
                    await self._finish(FileResult(f, Outcome.FAILED, kind="disk", error=f"{f.relpath}: {exc}"))
                    continue
                if isinstance(state, FileResult):
                    await self._finish(state)
                else:
                    todo.append((f, state))
            if not todo:
                return
            async with gate:
                try:
                    allow_html = all(f.name.lower().endswith((".html", ".htm")) for f, _ in todo)
                    part, size, sha = await self._download(url, allow_html)
                except _Failure as exc:
                    for f, _ in todo:
                        await self._finish(FileResult(f, Outcome.FAILED, kind=exc.kind, error=str(exc)))
                    return
            await self._place(part, size, sha, todo)
        finally:
            for _, fd in todo:
                os.close(fd)

    def _check(self, f: TaskFile) -> FileResult | int:
        """PRESENT when the manifest lists ``f`` and its size and sha256 match; else the descriptor of its folder
        (created) with its place free or ours to replace. Raises PlacementError when the place is taken."""
        rel = str(f.relpath)
        record = self.manifest["files"].get(rel)
        fd = self.root_fd
        opened: list[int] = []
        try:
            for i, part in enumerate(f.relpath.parts[:-1]):
                where = self.mirror / Path(*f.relpath.parts[:i + 1])
                fd = mirror_fs.open_dir(fd, part, str(where), create=True)
                opened.append(fd)
            kind = mirror_fs.entry_kind(fd, f.name)
            if kind in ("symlink", "other") or (kind == "file" and record is None):
                what = "a symlink" if kind == "symlink" else "a file arpo did not write (not in arpo-mirror.json)"
                raise mirror_fs.PlacementError(f"{self.mirror / rel} is {what}: left alone; move it away to fetch "
                                               "this file", "symlink" if kind == "symlink" else "foreign")
            if kind == "file" and record is not None:
                size, sha = mirror_fs.hash_file(fd, f.name)
                if (size, sha) == (record["size"], record["sha256"]) and record["url"] == f.url:
                    return FileResult(f, Outcome.PRESENT, size, sha)
            keep = opened.pop()
            return keep
        finally:
            for d in opened:
                os.close(d)

    async def _download(self, url: str, allow_html: bool) -> tuple[str, int, str]:
        """Download ``url`` into a new ``*.part`` file with retries: (its name, size, sha256). A web page is a
        failure unless ``allow_html`` (every file it goes to is named .html or .htm)."""
        problem = drive_link_problem(url)
        if problem:
            raise _Failure(f"{url}: {problem}; download it in a browser", "drive_link")
        o = self.options
        retrying = tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(o.retries + 1),
            wait=tenacity.wait_random_exponential(multiplier=o.backoff_s, max=30 * o.backoff_s),
            retry=tenacity.retry_if_exception_type(_Retryable), reraise=True)
        async for attempt in retrying:
            with attempt:
                return await self._try(url, allow_html)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _try(self, url: str, allow_html: bool) -> tuple[str, int, str]:
        name, fd = await asyncio.to_thread(mirror_fs.new_partial, self.partial_fd)
        digest, size, done = hashlib.sha256(), 0, False
        cap = self.options.max_bytes
        try:
            with os.fdopen(fd, "wb") as out:
                async with asyncio.timeout(self.options.timeout_s):
                    async with self.session.get(url) as resp:
                        _check_response(url, resp, cap, allow_html)
                        async for chunk in resp.content.iter_chunked(1 << 20):
                            size += len(chunk)
                            if size > cap:
                                raise _Failure(f"{url}: more than the cap of {cap} bytes", "too_large")
                            digest.update(chunk)
                            await asyncio.to_thread(out.write, chunk)
                            self.on_progress(len(chunk))
            done = True
            return name, size, digest.hexdigest()
        except TimeoutError as exc:
            raise _Retryable(f"{url}: not complete within {self.options.timeout_s:g} s", "timeout") from exc
        except aiohttp.InvalidURL as exc:  # a ClientError, but no retry mends it
            raise _Failure(f"{url}: not a URL we can fetch: {exc}", "url") from exc
        except aiohttp.ClientError as exc:
            raise _Retryable(f"{url}: {type(exc).__name__}: {exc}", "network") from exc
        except ValueError as exc:  # yarl: a URL it cannot parse
            raise _Failure(f"{url}: not a URL we can fetch: {exc}", "url") from exc
        except OSError as exc:
            raise _Failure(f"{url}: writing {self.mirror / mirror_fs.PARTIAL_DIR / name}: {exc}", "disk") from exc
        finally:
            if not done:
                await asyncio.to_thread(_unlink, self.partial_fd, name)

    async def _place(self, part: str, size: int, sha: str, todo: list[tuple[TaskFile, int]]) -> None:
        """Move the download ``part`` to each file's place (copies for all but the last), each claimed in the
        manifest first (:meth:`_claim`); a claim whose move fails is withdrawn."""
        for i, (f, fd) in enumerate(todo):
            old = await self._claim(f, size, sha)
            try:
                await asyncio.to_thread(self._move, part, f, fd, old, copy=i < len(todo) - 1)
            except (mirror_fs.PlacementError, OSError) as exc:
                kind = exc.kind if isinstance(exc, mirror_fs.PlacementError) else "disk"
                async with self.lock:
                    self.manifest["files"].pop(str(f.relpath), None)
                await self._finish(FileResult(f, Outcome.FAILED, kind=kind, error=f"{f.relpath}: {exc}"
                                              if kind == "disk" else str(exc)))
                continue
            await self._finish(FileResult(f, Outcome.FETCHED, size, sha))
        await asyncio.to_thread(_unlink, self.partial_fd, part)

    def _move(self, part: str, f: TaskFile, dir_fd: int, old: dict | None, *, copy: bool) -> None:
        src = part
        if copy:
            src, out_fd = mirror_fs.new_partial(self.partial_fd)
            in_fd = os.open(part, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=self.partial_fd)
            with os.fdopen(in_fd, "rb") as fin, os.fdopen(out_fd, "wb") as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
        kind = mirror_fs.entry_kind(dir_fd, f.name)  # checked again just before the rename
        if kind in ("symlink", "other") or (kind == "file" and old is None):
            _unlink(self.partial_fd, src)
            raise mirror_fs.PlacementError(f"{self.mirror / f.relpath}: something arpo did not write appeared "
                                           "there: left alone", "symlink" if kind == "symlink" else "foreign")
        os.replace(src, f.name, src_dir_fd=self.partial_fd, dst_dir_fd=dir_fd)


def _check_response(url: str, resp: aiohttp.ClientResponse, cap: int, allow_html: bool) -> None:
    if resp.status in _RETRYABLE_STATUS:
        raise _Retryable(f"{url}: HTTP {resp.status}", "http")
    if resp.status != 200:
        raise _Failure(f"{url}: HTTP {resp.status}", "http")
    if (resp.content_length or 0) > cap:
        raise _Failure(f"{url}: {resp.content_length} bytes, more than the cap of {cap}", "too_large")
    if resp.content_type == "text/html" and not allow_html:
        raise _Failure(f"{url}: the server sent a web page (text/html from {resp.url.host}), not the file; Google "
                       "Drive does so for a large file's virus-scan confirmation, a quota or a sign-in: download "
                       "it in a browser", "web_page")


def _unlink(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
