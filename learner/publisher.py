"""Weight publishers: the trainer's new weights -> every inference server, one server at a time.

Two ways (``learner.weight_sync``), one interface (``publish_from(trainer, version) -> seconds``):

- :class:`WeightPublisher` ("disk"): the trainer writes a Hugging Face folder (``<run>/weights/v<N>``, the
  last ``keep`` are kept), then per server pause_generation -> update_weights_from_disk(model_path,
  weight_version) -> continue_generation (REFERENCE.md section 4, as slime and AReaL do it). A server that
  refuses the update raises PublishError, naming the server.
- :class:`DistributedPublisher` ("distributed"): the full tensors (gathered from every rank's shards) go to
  each server over a process group of its own (arpo_async.weight_sync, SGLang's ``/init_weights_update_group``
  and ``/update_weights_from_distributed``), in buckets of ``bucket_mb``, between pause_generation and
  continue_generation. Nothing touches the disk.

Updating one server at a time keeps the others generating.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any

import torch

from arpo_async.inference_client import PolicyClient, PolicyRequestError, PolicyUnavailable
from arpo_async.weight_sync import WeightGroup, WeightGroupError, dtype_name

log = logging.getLogger("arpo.learner.publish")


class PublishError(RuntimeError):
    """An inference server did not load the new weights."""


class SyncRejected(PublishError):
    """A server refused to join the weight group (a configuration error: it stops the learner)."""


class WeightPublisher:
    """Pushes saved checkpoints to inference servers and keeps the last ``keep`` folders on disk.

    Args:
        client: HTTP client for the servers' admin endpoints.
        urls: every inference server (each gets the update directly, never through a router).
        weights_root: where versioned weight folders live.
        keep: how many published folders to keep (the server may still read the newest).
    """

    def __init__(self, client: PolicyClient, urls: list[str], weights_root: Path, keep: int = 2) -> None:
        self._client = client
        self._urls = list(urls)
        self.weights_root = weights_root
        self._keep = keep

    async def publish_from(self, trainer: Any, version: int) -> float:
        """Write the trainer's weights to ``folder(version)`` (every rank takes part in gathering them), then
        :meth:`publish` them; returns the seconds :meth:`publish` took."""
        await asyncio.to_thread(trainer.save_weights, self.folder(version), overwrite=True)
        return await self.publish(version)

    def folder(self, version: int) -> Path:
        """Where the checkpoint of ``version`` is (to be) saved."""
        return self.weights_root / f"v{version}"

    async def publish(self, version: int) -> float:
        """Load ``folder(version)`` on every server under ``version``; returns the seconds it took.

        Raises:
            PublishError: a server answered success=false; the message names it.
            arpo_async.inference_client.PolicyUnavailable: a server stayed unreachable.
        """
        started = time.perf_counter()
        path = str(self.folder(version).resolve())
        for url in self._urls:
            await self._client.pause_generation(url)
            try:
                reply = await self._client.update_weights_from_disk(url, path, version)
            finally:
                await self._client.continue_generation(url)
            if not reply.get("success", False):
                raise PublishError(f"{url} did not load {path}: {reply.get('message', reply)}")
        self._prune(version)
        return time.perf_counter() - started

    def _prune(self, newest: int) -> None:
        for old in self.weights_root.glob("v*"):
            suffix = old.name[1:]
            if suffix.isdigit() and int(suffix) <= newest - self._keep:
                shutil.rmtree(old, ignore_errors=True)


def buckets(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """Names of ``tensors`` in order, cut into consecutive runs of at most ``bucket_bytes`` bytes (a tensor larger
    than that is a bucket of its own)."""
    out: list[list[str]] = []
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if not out or size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(name)
        size += nbytes
    return out


def in_daemon_thread(fn, *args) -> asyncio.Future:
    """Run blocking ``fn(*args)`` in a daemon thread; a future for its result. Unlike ``asyncio.to_thread``, a
    rendezvous that waits for a server which refused to come does not hold up the process's exit."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(result: Any = None, error: BaseException | None = None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def work() -> None:
        try:
            result = fn(*args)
        except BaseException as error:  # noqa: BLE001 - handed to the awaiting task
            loop.call_soon_threadsafe(settle, None, error)
        else:
            loop.call_soon_threadsafe(settle, result)

    threading.Thread(target=work, daemon=True, name=f"arpo-{getattr(fn, '__name__', 'work')}").start()
    return future


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class DistributedPublisher:
    """Pushes the trainer's weights to each server over a weight group of its own (learner.weight_sync =
    "distributed").

    Args:
        client: HTTP client for the servers' admin endpoints.
        urls: every inference server.
        bucket_mb: most megabytes of tensors per ``/update_weights_from_distributed`` request.
        host: the address the servers reach this learner at (``master_address``; learner.sync_host).
        backend: "gloo" (arpo-serve, CPU) or "nccl" (SGLang on GPUs).
        timeout_s: rendezvous and broadcast timeout per server.

    Failure: a server that answers the join request with success = false raises :class:`SyncRejected` (the
    learner stops: the backend or address is wrong for every version to come). A server that cannot be reached,
    dies or times out mid-broadcast is dropped from its group (logged,
    counted in ``failures``) and training goes on; at the next publication, once it answers /health again, a
    new group is made and it receives the whole current weights. A restarted learner makes new groups (same
    names: the server replaces its old one).
    """

    def __init__(self, client: PolicyClient, urls: list[str], *, bucket_mb: float = 512.0,
                 host: str = "127.0.0.1", backend: str = "gloo", timeout_s: float = 120.0) -> None:
        self._client = client
        self._urls = list(urls)
        self.bucket_bytes = max(1, int(bucket_mb * (1 << 20)))
        self.host = host
        self.backend = backend
        self.timeout_s = timeout_s
        self._groups: dict[str, WeightGroup] = {}
        self.failures = 0
        """Server syncs that failed (the server was skipped for that version)."""

    async def publish_from(self, trainer: Any, version: int) -> float:
        """Gather the full weights (every rank takes part), then sync each server; returns the seconds the
        syncs took. Never raises for a server that fails (see the class docstring)."""
        tensors = await asyncio.to_thread(trainer.full_state_dict)
        started = time.perf_counter()
        for index, url in enumerate(self._urls):
            try:
                await self._sync(index, url, tensors, version)
            except SyncRejected:
                raise
            except (WeightGroupError, PolicyUnavailable, PolicyRequestError, PublishError) as error:
                self.failures += 1
                self._groups.pop(url, None)
                log.warning("weight sync of version %d to %s failed (%s); it gets the whole weights over a new "
                            "group at the next publication once it answers", version, url, error)
        return time.perf_counter() - started

    async def _join(self, index: int, url: str) -> WeightGroup:
        name = f"arpo-weights-{index}"
        port = _free_port(self.host)
        joining = asyncio.create_task(self._client.init_weights_update_group(
            url, master_address=self.host, master_port=port, rank_offset=1, world_size=2, group_name=name,
            backend=self.backend, timeout_s=self.timeout_s + 30))
        joined = in_daemon_thread(WeightGroup.join, self.host, port, 0, 2, name, self.timeout_s, self.backend)
        await asyncio.wait([joining, joined], return_when=asyncio.FIRST_COMPLETED)
        if joining.done() and not joining.exception() and not joining.result().get("success", False):
            raise SyncRejected(f"{url} refused weight group {name}: {joining.result().get('message')}; check "
                               f"learner.sync_backend (sent {self.backend!r}) and learner.sync_host ({self.host!r}, "
                               "the address the server must reach)")
        try:
            group = await joined
        except WeightGroupError:
            joining.cancel()
            raise
        reply = await joining
        if not reply.get("success", False):
            raise PublishError(f"{url} did not join weight group {name}: {reply.get('message', reply)}")
        self._groups[url] = group
        return group

    async def _sync(self, index: int, url: str, tensors: dict[str, torch.Tensor], version: int) -> None:
        group = self._groups.get(url)
        if group is None:
            if not await self._client.health(url):
                raise PolicyUnavailable(f"{url} does not answer /health")
            group = await self._join(index, url)
        parts = buckets(tensors, self.bucket_bytes)
        await self._client.pause_generation(url)
        try:
            for k, names in enumerate(parts):
                batch = [tensors[n].contiguous() for n in names]
                request = asyncio.create_task(self._client.update_weights_from_distributed(
                    url, names=names, dtypes=[dtype_name(t.dtype) for t in batch],
                    shapes=[list(t.shape) for t in batch], group_name=group.name,
                    weight_version=version if k == len(parts) - 1 else None, timeout_s=self.timeout_s + 30))
                try:
                    await asyncio.to_thread(group.broadcast, batch)
                except WeightGroupError:
                    request.cancel()
                    raise
                reply = await request
                if not reply.get("success", False):
                    raise PublishError(f"{url} did not load weight bucket {k + 1}/{len(parts)}: "
                                       f"{reply.get('message', reply)}")
        finally:
            try:
                await self._client.continue_generation(url)
            except (PolicyUnavailable, PolicyRequestError) as error:
                log.warning("continue_generation on %s failed: %s", url, error)
