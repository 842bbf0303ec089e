"""The download cache (actors.osworld.downloads) against a real HTTP server on 127.0.0.1: content-addressed
storage, one network fetch per URL, the mirror first, the size cap and the deadline, and a refused connection
reported as needs_network."""
from __future__ import annotations

import asyncio
import hashlib

import pytest
from aiohttp import web

from actors.osworld.downloads import DownloadCache, DownloadError, run_download_cache
from tests.support import free_port, local_http_server

BODY = b"osworld fixture\n" * 100


@pytest.fixture
async def server():
    """Routes: /f.txt (BODY), /big (2 MiB), /stall (headers, then nothing until the test ends)."""
    hits = {"f": 0}
    release = asyncio.Event()

    async def f(_r):
        hits["f"] += 1
        return web.Response(body=BODY)

    async def big(_r):
        return web.Response(body=b"x" * (2 << 20))

    async def stall(request):
        resp = web.StreamResponse()
        await resp.prepare(request)
        await release.wait()
        return resp

    async with local_http_server({"/f.txt": f, "/big": big, "/stall": stall}) as port:
        try:
            yield f"http://127.0.0.1:{port}", hits
        finally:
            release.set()


async def test_fetch_stores_by_content_hash_and_fetches_once(server, tmp_path):
    base, hits = server
    cache = DownloadCache(cache_dir=tmp_path, max_bytes=1 << 20, timeout_s=10)
    path = await cache.fetch(f"{base}/f.txt")
    assert path.read_bytes() == BODY and path.name == hashlib.sha256(BODY).hexdigest()
    assert await cache.fetch(f"{base}/f.txt") == path and hits["f"] == 1
    assert not list((tmp_path / "blobs").glob(".part-*"))


async def test_mirror_is_looked_up_first(server, tmp_path):
    base, hits = server
    mirror = tmp_path / "mirror"
    (mirror / "os" / "task-1").mkdir(parents=True)
    (mirror / "os" / "task-1" / "notes.txt").write_bytes(b"from the mirror")
    (mirror / "1AbC").write_bytes(b"by drive id")
    cache = DownloadCache(cache_dir=tmp_path / "c", mirror=mirror, max_bytes=1 << 20, timeout_s=10)
    assert (await cache.fetch(f"{base}/f.txt", "notes.txt", "task-1")).read_bytes() == b"from the mirror"
    got = await cache.fetch("https://drive.google.com/uc?export=download&id=1AbC", "x.xlsx", "other")
    assert got.read_bytes() == b"by drive id" and hits["f"] == 0


async def test_cap_deadline_and_no_network_are_errors(server, tmp_path):
    base, _ = server
    cache = DownloadCache(cache_dir=tmp_path, max_bytes=1 << 20, timeout_s=1)
    with pytest.raises(DownloadError, match="cap") as err:
        await cache.fetch(f"{base}/big")
    assert err.value.kind == "too_large"
    with pytest.raises(DownloadError, match="within 1 s") as err:
        await cache.fetch(f"{base}/stall")
    assert err.value.kind == "needs_network"
    with pytest.raises(DownloadError, match="needs network") as err:  # a port nobody listens on
        await cache.fetch(f"http://127.0.0.1:{free_port()}/x")
    assert err.value.kind == "needs_network"
    with pytest.raises(ValueError, match="http"):
        await cache.fetch("file:///etc/passwd")
    assert not list((tmp_path / "blobs").iterdir())  # no partial file left behind


def test_run_download_cache_layout(tmp_path):
    cache = run_download_cache(tmp_path / "run", str(tmp_path), max_mb=1, timeout_s=5)
    assert cache.cache_dir == tmp_path / "run" / "cache" / "downloads" and cache.max_bytes == 1 << 20
    with pytest.raises(ValueError, match="not a folder"):
        run_download_cache(tmp_path, str(tmp_path / "missing"))
