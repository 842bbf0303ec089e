"""The download cache for OSWorld's ``download`` setup step (and ``cloud_file`` getter): fetched on the actor
host, never inside the desktop (containers have no network).

Layout under ``cache_dir``: ``blobs/<sha256 of the content>`` holds each file once; ``urls/<sha256 of the
URL>`` names the blob a URL gave. A file is looked up in this order:

1. the local mirror of OSWorld's files (``learner.osworld_files``), laid out like OSWorld's file cache
   (``<domain>/<task id>/<file name>``, the name being the basename of the step's target ``path``), or holding
   the file under its Google Drive id (the URL's ``id=`` parameter) or the URL's last path segment;
2. the cache (an earlier download of the same URL);
3. the network: an HTTP GET with a total deadline of ``timeout_s`` and at most ``max_bytes`` bytes, written to a
   temporary file and moved into ``blobs/`` once complete (so a crash never leaves a partial blob).

Errors: :class:`DownloadError` with ``kind`` = ``needs_network`` (no mirror copy and the URL could not be
fetched: no route, DNS failure, timeout, HTTP error) or ``too_large`` (over ``max_bytes``).
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import aiohttp

DEFAULT_MAX_BYTES = 256 * 1024 * 1024
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "arpo" / "downloads"


class DownloadError(Exception):
    """A file could not be had: ``kind`` is ``needs_network`` or ``too_large``; the message names the URL."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class DownloadCache:
    """Where downloads come from and go (see the module docstring).

    Attributes:
        cache_dir: the content-addressed cache folder (created on first use).
        mirror: a local copy of OSWorld's files, looked up first; None = none.
        max_bytes: largest file fetched from the network (bytes).
        timeout_s: deadline for one network fetch, connect to last byte (seconds).
    """

    cache_dir: Path = DEFAULT_CACHE_DIR
    mirror: Path | None = None
    max_bytes: int = DEFAULT_MAX_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.max_bytes <= 0 or self.timeout_s <= 0:
            raise ValueError(f"DownloadCache: max_bytes and timeout_s must be > 0, got {self.max_bytes}, "
                             f"{self.timeout_s}")

    def mirror_candidates(self, url: str, name: str, task_id: str = "") -> list[Path]:
        """Paths in the mirror that may hold ``url`` (saved in the desktop as ``name``) for task ``task_id``."""
        if self.mirror is None:
            return []
        parsed = urllib.parse.urlparse(url)
        keys = urllib.parse.parse_qs(parsed.query).get("id", []) + [Path(parsed.path).name]
        out = sorted(self.mirror.glob(f"*/{task_id}/{name}")) if task_id and name else []
        out += [self.mirror / k for k in keys if k and k not in (".", "..") and "/" not in k]
        return out

    async def fetch(self, url: str, name: str = "", task_id: str = "") -> Path:
        """A local file holding ``url``'s content (mirror, cache or network, in that order).

        Args:
            url: http(s) URL.
            name: the file's name in the desktop (for the mirror's ``<domain>/<task id>/<name>`` layout).
            task_id: the task's id (same).
        Raises:
            DownloadError: kind ``needs_network`` or ``too_large``.
            ValueError: a URL that is not http(s).
        """
        if urllib.parse.urlparse(url).scheme not in ("http", "https"):
            raise ValueError(f"download: only http(s) URLs, got {url!r}")
        for candidate in self.mirror_candidates(url, name, task_id):
            if candidate.is_file():
                return candidate
        index = self.cache_dir / "urls" / hashlib.sha256(url.encode()).hexdigest()
        try:
            blob = self.cache_dir / "blobs" / index.read_text().strip()
            if blob.is_file():
                return blob
        except OSError:
            pass
        return await self._download(url, index)

    async def _download(self, url: str, index: Path) -> Path:
        blobs = self.cache_dir / "blobs"
        await asyncio.to_thread(blobs.mkdir, parents=True, exist_ok=True)
        await asyncio.to_thread(index.parent.mkdir, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=blobs, prefix=".part-")
        digest = hashlib.sha256()
        try:
            with os.fdopen(fd, "wb") as out:
                await self._stream(url, out, digest)
            blob = blobs / digest.hexdigest()
            await asyncio.to_thread(os.replace, tmp, blob)
            await asyncio.to_thread(index.write_text, digest.hexdigest() + "\n")
            return blob
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    async def _stream(self, url: str, out, digest) -> None:
        size = 0
        try:
            async with asyncio.timeout(self.timeout_s):
                async with aiohttp.ClientSession() as session, session.get(url) as resp:
                    if resp.status != 200:
                        raise DownloadError(f"download {url}: HTTP {resp.status}", "needs_network")
                    if (resp.content_length or 0) > self.max_bytes:
                        raise DownloadError(f"download {url}: {resp.content_length} bytes, more than the cap "
                                            f"of {self.max_bytes}", "too_large")
                    async for chunk in resp.content.iter_chunked(1 << 20):
                        size += len(chunk)
                        if size > self.max_bytes:
                            raise DownloadError(f"download {url}: more than the cap of {self.max_bytes} bytes",
                                                "too_large")
                        digest.update(chunk)
                        await asyncio.to_thread(out.write, chunk)
        except TimeoutError as exc:
            raise DownloadError(f"download {url}: not complete within {self.timeout_s:g} s (needs network?)",
                                "needs_network") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise DownloadError(f"download {url}: needs network: {type(exc).__name__}: {exc}",
                                "needs_network") from exc


def run_download_cache(run_dir: str | Path, osworld_files: str = "", max_mb: float = DEFAULT_MAX_BYTES / 2**20,
                       timeout_s: float = DEFAULT_TIMEOUT_S) -> DownloadCache:
    """The DownloadCache of a run: ``<run_dir>/cache/downloads``, the mirror ``osworld_files`` (config
    learner.osworld_files; empty = none), the cap and deadline of actors.download_max_mb / download_timeout_s.
    Raises ValueError for a mirror that is not a folder or a non-positive cap or deadline."""
    mirror = Path(osworld_files).expanduser() if osworld_files else None
    if mirror is not None and not mirror.is_dir():
        raise ValueError(f"learner.osworld_files: {mirror} is not a folder")
    return DownloadCache(cache_dir=Path(run_dir) / "cache" / "downloads", mirror=mirror,
                         max_bytes=int(max_mb * 2**20), timeout_s=timeout_s)
