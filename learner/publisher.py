"""Weight publishers: the trainer's new weights -> every inference server, one server at a time.

Two ways (``learner.weight_sync``), one interface (``publish_from(trainer, version) -> seconds``):

- :class:`WeightPublisher` ("disk"): the trainer writes a Hugging Face folder (``<run>/weights/v<N>``, the
  last ``keep`` are kept), then per server pause_generation -> update_weights_from_disk(model_path,
  weight_version) -> continue_generation (sglang 0.5.23, python/sglang/srt/entrypoints/http_server.py; as slime
  and AReaL do it). A server that
  refuses the update raises PublishError, naming the server; one that does not answer is skipped and caught up.
- :class:`DistributedPublisher` ("distributed"): the full tensors (gathered from every rank's shards), under
  checkpoint names, go to each server over a process group of its own (arpo_async.weight_sync, SGLang 0.5.23's
  ``/init_weights_update_group``, ``/begin_weight_update``, ``/update_weights_from_distributed``,
  ``/end_weight_update``), in buckets of ``bucket_mb``, between pause_generation and continue_generation.
  Nothing touches the disk.

Both can check what a server serves afterwards (``verify_every``; SGLang's ``/weights_checker``).

Both catch up a server that is behind (``catch_up(trainer, version)``, :func:`servers_behind`): a server restarted
after a publication serves the run's base weights under version 0 until it gets the current ones.

Updating one server at a time keeps the others generating.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any

import torch

from arpo_async.inference_client import PolicyClient, PolicyRequestError, PolicyUnavailable, parse_version
from arpo_async.weight_sync import (
    DTYPE_NAMES,
    FLATTENED_BUCKET,
    WeightGroup,
    WeightGroupError,
    dtype_from_name,
    dtype_name,
    flatten_bucket,
    tensor_checksum,
)
from learner.weight_check import WeightCheck, compare_checksums, served_checksums

log = logging.getLogger("arpo.learner.publish")


class PublishError(RuntimeError):
    """An inference server did not load the new weights."""


class SyncRejected(PublishError):
    """A server refused to join the weight group (a configuration error: it stops the learner)."""


async def servers_behind(client: PolicyClient, urls: list[str], version: int) -> list[str]:
    """The servers among ``urls`` that answer /health and report a ``weight_version`` below ``version`` (GET
    /get_model_info, where SGLang 0.5.23 reports the version a weight update set; /get_server_info keeps the
    startup value; its "default" is 0). A server that does not answer, or reports no version this learner
    can read, is left out (logged at DEBUG): the next check asks again."""
    behind = []
    for url in urls:
        try:
            if not await client.health(url):
                continue
            served = parse_version((await client.model_info(url)).get("weight_version", "default"))
        except (PolicyUnavailable, PolicyRequestError) as error:
            log.debug("weight version check of %s: %s", url, error)
            continue
        if served < version:
            behind.append(url)
    return behind


class WeightPublisher:
    """Pushes saved checkpoints to inference servers and keeps the last ``keep`` folders on disk.

    Args:
        client: HTTP client for the servers' admin endpoints.
        urls: every inference server (each gets the update directly, never through a router).
        weights_root: where versioned weight folders live.
        keep: how many published folders to keep (the server may still read the newest).
    """

    def __init__(self, client: PolicyClient, urls: list[str], weights_root: Path, keep: int = 2,
                 verify_every: int = 0) -> None:
        self._client = client
        self._urls = list(urls)
        self.weights_root = weights_root
        self._keep = keep
        self.verify_every = verify_every
        self.publications = 0
        self.failures = 0
        """Server loads skipped because the server did not answer (it is caught up once it does)."""
        self.verified = 0
        """Server checksum comparisons that agreed."""

    async def publish_from(self, trainer: Any, version: int) -> float:
        """Write the trainer's weights to ``folder(version)`` (every rank takes part in gathering them), then
        :meth:`publish` them; returns the seconds :meth:`publish` took. Every ``verify_every``-th publication,
        compares each server's checksums with the trainer's weights (:func:`verify_server`; raises
        :class:`WeightsMismatch`)."""
        await asyncio.to_thread(trainer.save_weights, self.folder(version), overwrite=True)
        seconds = await self.publish(version)
        self.publications += 1
        if self.verify_every > 0 and self.publications % self.verify_every == 0:
            tensors = await asyncio.to_thread(trainer.checkpoint_state_dict)
            for url in self._urls:
                await verify_server(self._client, url, tensors, trainer)
                self.verified += 1
        return seconds

    def folder(self, version: int) -> Path:
        """Where the checkpoint of ``version`` is (to be) saved."""
        return self.weights_root / f"v{version}"

    async def publish(self, version: int) -> float:
        """Load ``folder(version)`` on every server under ``version``; returns the seconds it took.

        A server that stays unreachable through the client's retries (dead, or restarting) is skipped for this
        version (counted in ``failures``, logged); :meth:`catch_up` sends it the current weights once it answers.

        Raises:
            PublishError: a server answered success=false; the message names it.
        """
        started = time.perf_counter()
        for url in self._urls:
            try:
                await self._load(url, version)
            except PolicyUnavailable as error:
                self.failures += 1
                log.warning("loading version %d on %s failed: %s; it gets the current weights once it answers "
                            "(learner.resync_interval_s)", version, url, error)
        self._prune(version)
        return time.perf_counter() - started

    async def catch_up(self, trainer: Any, version: int) -> list[str]:
        """Load ``folder(version)`` (the current weights, already on disk) on every server behind ``version``
        (:func:`servers_behind`); returns their URLs. ``trainer`` is unused (the interface is the publishers').
        A server that fails on the way is logged and left for the next check."""
        synced = []
        for url in await servers_behind(self._client, self._urls, version):
            try:
                await self._load(url, version)
            except (PublishError, PolicyUnavailable, PolicyRequestError) as error:
                log.warning("catching %s up to version %d failed: %s; trying again at the next check", url, version,
                            error)
                continue
            log.warning("%s served an older version than %d (restarted?): sent it the current weights", url, version)
            synced.append(url)
        return synced

    async def _load(self, url: str, version: int) -> None:
        path = str(self.folder(version).resolve())
        await self._client.pause_generation(url)
        try:
            reply = await self._client.update_weights_from_disk(url, path, version)
        finally:
            await self._client.continue_generation(url)
        if not reply.get("success", False):
            raise PublishError(f"{url} did not load {path}: {reply.get('message', reply)}")

    def _prune(self, newest: int) -> None:
        for old in self.weights_root.glob("v*"):
            suffix = old.name[1:]
            if suffix.isdigit() and int(suffix) <= newest - self._keep:
                shutil.rmtree(old, ignore_errors=True)


def buckets(tensors: dict[str, torch.Tensor], bucket_bytes: int, *, aligned: bool = False) -> list[list[str]]:
    """Names of ``tensors`` in order, cut into consecutive runs of at most ``bucket_bytes`` bytes (a tensor larger
    than that is a bucket of its own). ``aligned``: also cut where a tensor would start at a byte offset that is
    not a multiple of its element size (SGLang refuses such a flattened bucket)."""
    out: list[list[str]] = []
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if not out or size + nbytes > bucket_bytes or (aligned and size % tensor.element_size()):
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


class WeightsMismatch(PublishError):
    """A server's /weights_checker checksums differ from the learner's weights after a publication (it stops the
    learner: every later version would be served wrong in the same way)."""


def _served_dtype(info: dict, trainer: Any) -> torch.dtype:
    """The dtype a server holds its weights in: ``dtype`` of /get_server_info (SGLang's --dtype). "auto" resolves
    as SGLang 0.5.23 resolves it (configs/model_config.py ``_get_and_verify_dtype``): the checkpoint's config
    dtype, except that a float32 checkpoint is served in float16 (bfloat16 for Gemma)."""
    name = str(info.get("dtype") or "auto").lower()
    if name != "auto":
        return dtype_from_name(name)
    config = json.loads((Path(trainer.model_dir) / "config.json").read_text())
    configured = DTYPE_NAMES.get(str(config.get("dtype") or config.get("torch_dtype") or "float32"), torch.float32)
    if configured == torch.float32:
        return torch.bfloat16 if str(config.get("model_type", "")).startswith("gemma") else torch.float16
    return configured


def _hasher(info: dict):
    """How the server hashes: on a CUDA server SGLang hashes with its own GPU kernel (mm_utils.tensor_hash), which
    only sglang itself computes; on a CPU server, sha256 (arpo_async.weight_sync.tensor_checksum)."""
    if str(info.get("device", "cpu")).startswith("cuda"):
        try:
            from sglang.srt.managers.mm_utils import tensor_hash
        except ImportError as error:
            raise PublishError("learner.verify_weights_every with a CUDA SGLang server needs sglang installed on "
                               f"the learner (pip install -e '.[gpu]' in the clone) to hash as the server does: {error}")
        return lambda t: f"{tensor_hash(t.cuda()):016x}"
    return tensor_checksum


async def verify_server(client: PolicyClient, url: str, tensors: dict[str, torch.Tensor], trainer: Any) -> WeightCheck:
    """Compare ``url``'s /weights_checker checksums with ``tensors`` (checkpoint names, the weights just published).

    Raises:
        WeightsMismatch: a checksum differs, or no name could be compared (the message names the server).
        PolicyUnavailable, PolicyRequestError: the server did not answer.
    """
    info = await client.server_info(url)
    answer = await client.weights_checker(url)
    try:
        served = served_checksums(answer)
    except ValueError as error:
        raise WeightsMismatch(f"{url} /weights_checker: {error}") from error
    try:
        dtype = _served_dtype(info, trainer)
    except ValueError as error:
        raise WeightsMismatch(f"{url} get_server_info: cannot tell its weights' dtype: {error}") from error
    check = await asyncio.to_thread(compare_checksums, served, tensors, dtype, _hasher(info))
    if not check.ok:
        raise WeightsMismatch(f"{url} /weights_checker: {len(check.mismatched)} of {check.compared} weights differ "
                              f"from the learner's after the publication (first: {check.mismatched[:5]}; "
                              f"{check.skipped} names not comparable)")
    log.info("%s serves the published weights: %d checksums agree (%d names not comparable)", url, check.compared,
             check.skipped)
    return check


class DistributedPublisher:
    """Pushes the trainer's weights to each server over a weight group of its own (learner.weight_sync =
    "distributed"), as SGLang 0.5.23 takes them (arpo_async.weight_sync).

    Per server and publication: pause_generation (retract) -> begin_weight_update -> per bucket
    update_weights_from_distributed + broadcast -> end_weight_update -> continue_generation, under checkpoint names
    (Trainer.checkpoint_state_dict). Every ``verify_every``-th publication, each server's /weights_checker
    checksums are compared with the published tensors (:func:`verify_server`).

    Args:
        client: HTTP client for the servers' admin endpoints.
        urls: every inference server.
        bucket_mb: most megabytes of tensors per ``/update_weights_from_distributed`` request.
        host: the address the servers reach this learner at (``master_address``; learner.sync_host).
        backend: "gloo" (arpo-serve, CPU) or "nccl" (SGLang on GPUs).
        timeout_s: rendezvous and broadcast timeout per server.
        load_format: None (one broadcast per tensor) or "flattened_bucket" (one flat uint8 tensor per bucket).
        verify_every: compare checksums after every this many publications (0 = never).

    Failure (one log line naming the server and the call):
    - a server that answers the join request with success = false raises :class:`SyncRejected` (the learner stops:
      the backend or address is wrong for every version to come); a checksum mismatch raises
      :class:`WeightsMismatch` (the learner stops);
    - a server that cannot be reached, dies, times out mid-broadcast, or answers begin, an update or end with
      success = false is skipped for this version (counted in ``failures``) and its group destroyed; at the next
      publication, once it answers /health again, a new group (a new name: torch refuses a name twice in one
      process) gets the whole current weights. A server that failed after its session began may hold part of the
      new weights (SGLang loads bucket by bucket), so it is left paused until a whole publication succeeds on it;
      a begin refused because a session is still open (a publication cut short) is answered with one
      end_weight_update and one more begin.
    """

    def __init__(self, client: PolicyClient, urls: list[str], *, bucket_mb: float = 512.0,
                 host: str = "127.0.0.1", backend: str = "gloo", timeout_s: float = 120.0,
                 load_format: str | None = None, verify_every: int = 0) -> None:
        if load_format not in (None, FLATTENED_BUCKET):
            raise ValueError(f"load_format must be None or {FLATTENED_BUCKET!r}, got {load_format!r}")
        self._client = client
        self._urls = list(urls)
        self.bucket_bytes = max(1, int(bucket_mb * (1 << 20)))
        self.host = host
        self.backend = backend
        self.timeout_s = timeout_s
        self.load_format = load_format
        self.verify_every = verify_every
        self._groups: dict[str, WeightGroup] = {}
        self._joins = 0
        self._token = f"{os.getpid()}-{secrets.token_hex(3)}"
        self.publications = 0
        self.failures = 0
        """Server syncs that failed (the server was skipped for that version)."""
        self.verified = 0
        """Server checksum comparisons that agreed."""

    async def publish_from(self, trainer: Any, version: int) -> float:
        """Gather the full weights (every rank takes part), then sync each server; returns the seconds the
        syncs took. Raises only :class:`SyncRejected` and :class:`WeightsMismatch` (see the class docstring)."""
        tensors = await asyncio.to_thread(trainer.checkpoint_state_dict)
        started = time.perf_counter()
        self.publications += 1
        verify = self.verify_every > 0 and self.publications % self.verify_every == 0
        for index, url in enumerate(self._urls):
            if await self._sync_or_skip(index, url, tensors, version) and verify:
                await verify_server(self._client, url, tensors, trainer)
                self.verified += 1
        return time.perf_counter() - started

    async def catch_up(self, trainer: Any, version: int) -> list[str]:
        """Send the trainer's current weights, as ``version``, to every server behind it (:func:`servers_behind`)
        over a new group; returns the URLs that got them. Gathers the weights only when a server is behind (every
        rank takes part). Failures are handled as in :meth:`publish_from` (the server waits for the next check)."""
        behind = await servers_behind(self._client, self._urls, version)
        if not behind:
            return []
        for url in behind:  # a restarted server left its old group: it joins a new one
            self._drop(url)
        tensors = await asyncio.to_thread(trainer.checkpoint_state_dict)
        synced = []
        for url in behind:
            if await self._sync_or_skip(self._urls.index(url), url, tensors, version):
                log.warning("%s served an older version than %d (restarted?): sent it the current weights", url,
                            version)
                synced.append(url)
        return synced

    async def _sync_or_skip(self, index: int, url: str, tensors: dict[str, torch.Tensor], version: int) -> bool:
        """Sync one server; False (counted in ``failures``, its group dropped) when it fails in a way that skips
        it for this version. Raises SyncRejected."""
        try:
            await self._sync(index, url, tensors, version)
        except SyncRejected:
            raise
        except (WeightGroupError, PolicyUnavailable, PolicyRequestError, PublishError) as error:
            self.failures += 1
            self._drop(url)
            log.warning("weight sync of version %d to %s failed: %s; it gets the whole weights over a new "
                        "group at the next publication once it answers", version, url, error)
            return False
        return True

    def _drop(self, url: str) -> None:
        group = self._groups.pop(url, None)
        if group is not None:
            group.destroy()

    async def _join(self, index: int, url: str) -> WeightGroup:
        """A new group with ``url``: this learner is rank 0, the server's tensor-parallel ranks are 1..tp_size
        (SGLang: rank_offset + tp_rank; ``tp_size`` from /get_server_info, 1 when it does not say)."""
        self._joins += 1
        name = f"arpo-weights-{index}-{self._token}-{self._joins}"
        tp_size = (await self._client.server_info(url)).get("tp_size") or 1
        if not isinstance(tp_size, int) or isinstance(tp_size, bool) or not 1 <= tp_size <= 4096:
            raise PublishError(f"{url} get_server_info reports tp_size {tp_size!r}: not a rank count")
        world = 1 + tp_size
        port = _free_port(self.host)
        joining = asyncio.create_task(self._client.init_weights_update_group(
            url, master_address=self.host, master_port=port, rank_offset=1, world_size=world, group_name=name,
            backend=self.backend, timeout_s=self.timeout_s + 30))
        joined = in_daemon_thread(WeightGroup.join, self.host, port, 0, world, name, self.timeout_s, self.backend)
        await asyncio.wait([joining, joined], return_when=asyncio.FIRST_COMPLETED)
        if joining.done() and not joining.exception() and not joining.result().get("success", False):
            raise SyncRejected(f"{url} init_weights_update_group refused group {name}: "
                               f"{joining.result().get('message')}; check learner.sync_backend (sent "
                               f"{self.backend!r}) and learner.sync_host ({self.host!r}, the address the server "
                               "must reach)")
        try:
            group = await joined
        except WeightGroupError:
            joining.cancel()
            raise
        reply = await joining
        if not reply.get("success", False):
            group.destroy()
            raise PublishError(f"{url} init_weights_update_group did not join {name}: {reply.get('message', reply)}")
        self._groups[url] = group
        return group

    async def _begin(self, url: str) -> None:
        reply = await self._client.begin_weight_update(url)
        if not reply.get("success", False):  # a session left open by a publication cut short: close it once
            log.warning("%s begin_weight_update refused (%s); closing the open session and beginning again", url,
                        reply.get("message"))
            await self._client.end_weight_update(url)
            reply = await self._client.begin_weight_update(url)
        if not reply.get("success", False):
            raise PublishError(f"{url} begin_weight_update answered success=false: {reply.get('message', reply)}")

    async def _sync(self, index: int, url: str, tensors: dict[str, torch.Tensor], version: int) -> None:
        group = self._groups.get(url)
        if group is None:
            if not await self._client.health(url):
                raise PolicyUnavailable(f"{url} does not answer /health")
            group = await self._join(index, url)
        await self._client.pause_generation(url)
        try:
            await self._begin(url)
        except PublishError:  # nothing was loaded: the server goes on with its old weights
            await self._client.continue_generation(url)
            raise
        try:
            await self._send(url, group, tensors, version)
        except BaseException:
            log.error("%s may hold part of version %d: left paused until a whole publication succeeds on it", url,
                      version)
            raise
        reply = await self._client.end_weight_update(url)
        if not reply.get("success", False):
            raise PublishError(f"{url} end_weight_update answered success=false: {reply.get('message', reply)}")
        await self._client.continue_generation(url)

    async def _send(self, url: str, group: WeightGroup, tensors: dict[str, torch.Tensor], version: int) -> None:
        parts = buckets(tensors, self.bucket_bytes, aligned=self.load_format == FLATTENED_BUCKET)
        for k, names in enumerate(parts):
            batch = [tensors[n].contiguous() for n in names]
            request = asyncio.create_task(self._client.update_weights_from_distributed(
                url, names=names, dtypes=[dtype_name(t.dtype) for t in batch],
                shapes=[list(t.shape) for t in batch], group_name=group.name,
                weight_version=version if k == len(parts) - 1 else None, load_format=self.load_format,
                timeout_s=self.timeout_s + 30))
            payload = [flatten_bucket(batch)] if self.load_format == FLATTENED_BUCKET else batch
            try:
                await asyncio.to_thread(group.broadcast, payload)
            except WeightGroupError:
                request.cancel()
                raise
            reply = await request
            if not reply.get("success", False):
                raise PublishError(f"{url} update_weights_from_distributed answered success=false for bucket "
                                   f"{k + 1}/{len(parts)}: {reply.get('message', reply)}")
