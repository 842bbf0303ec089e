"""Weight publishers: the trainer's new weights -> every inference server, one server at a time.

Servers are reached only through the inference-engine seam (arpo_async.engine.InferenceEngine, one object per
server; SGLang's routes live in arpo_async.sglang_engine). Two ways (``learner.weight_sync``), one interface
(``publish_from(trainer, version) -> seconds``):

- :class:`WeightPublisher` ("disk"): the trainer writes a Hugging Face folder (``<run>/weights/v<N>``, the
  last ``keep`` are kept, and ``v0``, the weights the run started from, always), then per server pause ->
  load_weights_from_disk(path, version) -> resume (SGLang: pause_generation, update_weights_from_disk,
  continue_generation; as slime and AReaL do it). A server that refuses the update raises PublishError, naming
  the server; one that does not answer is skipped and caught up.
- :class:`DistributedPublisher` ("distributed"): the full tensors (gathered from every rank's shards), under
  checkpoint names, go to each server over a process group of its own (arpo_async.weight_sync; the engine's
  join_weight_group, begin_weight_update, receive_weights, end_weight_update), in buckets of ``bucket_mb``,
  between pause and resume. Nothing touches the disk.

Both publish in the dtype the servers serve (``learner.publish_dtype``, learner.train.publish_dtype): a bf16
server gets bf16 tensors (or a bf16 folder), half the bytes of the learner's float32 master weights.

Both can check what a server serves afterwards (``verify_every``; the engine's ``weights_checksums``;
learner.train.weight_check.verify_or_resync): a server that cannot check, or whose checksums differ, is sent the
whole weights again and checked once more; only checksums that still differ stop the learner (WeightsMismatch).

Both catch up a server that is behind (``catch_up(trainer, version)``, learner.train.server_book): a server
restarted after a publication serves the run's base weights under version 0 until it gets the current ones, and a
server whose update failed half-way gets the whole weights again. Both resume every server they paused, whatever
failed; a resume that does not go through is tried again at the next catch-up.

Updating one server at a time keeps the others generating.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import socket
import time
from pathlib import Path
from typing import Sequence

import torch

from arpo_async.engine import InferenceEngine
from arpo_async.inference_client import PolicyRequestError, PolicyUnavailable
from arpo_async.weight_sync import (FLATTENED_BUCKET, WeightGroup, WeightGroupError, cast_floating, dtype_name,
                                    flatten_bucket, in_daemon_thread)
from learner.train.publish_dtype import PublishDtypes, tensor_bytes
from learner.train.publish_errors import CannotCheck, PublishError, SyncRejected, WeightsMismatch
from learner.train.server_book import CHECK_TIMEOUT_S, ServerBook, servers_behind
from learner.train.train_engine import TrainEngine
from learner.train.weight_check import verify_or_resync, verify_server

log = logging.getLogger("arpo.learner.publish")

__all__ = ["CHECK_TIMEOUT_S", "CannotCheck", "DistributedPublisher", "PublishError", "SyncRejected",
           "WeightPublisher", "WeightsMismatch", "servers_behind", "verify_or_resync", "verify_server"]


class WeightPublisher(ServerBook):
    """Pushes saved checkpoints to inference servers and keeps the last ``keep`` folders on disk.

    Args:
        engines: every inference server (each gets the update directly, never through a router); kept as
            ``engines``.
        weights_root: where versioned weight folders live (a path every server can read).
        keep: how many published folders to keep (the server may still read the newest).
        verify_every: compare checksums after every this many publications (0 = never).
        dtypes: the dtype of the folder: the servers' when they agree (a new PublishDtypes when None).
    """

    def __init__(self, engines: Sequence[InferenceEngine], weights_root: Path, keep: int = 2,
                 verify_every: int = 0, dtypes: PublishDtypes | None = None) -> None:
        super().__init__(engines)
        self.dtypes = dtypes if dtypes is not None else PublishDtypes()
        self.bytes_published = 0
        """Bytes of weights (safetensors files) the last publication wrote."""
        self.weights_root = weights_root
        self._keep = keep
        self.verify_every = verify_every
        self.publications = 0
        self.failures = 0
        """Server loads skipped because the server did not answer (it is caught up once it does)."""
        self.verified = 0
        """Server checksum comparisons that agreed."""
        self.loaded: list[InferenceEngine] = []
        """The servers that loaded the last publication."""

    async def publish_from(self, trainer: TrainEngine, version: int) -> float:
        """Write the trainer's weights to ``folder(version)`` in the servers' dtype (every rank takes part in
        gathering them), then :meth:`publish` them; returns the seconds :meth:`publish` took. Every
        ``verify_every``-th publication, compares the checksums of each server that loaded them with the trainer's
        weights (:func:`verify_or_resync`: a server that cannot check or differs is loaded again and checked once
        more; raises :class:`WeightsMismatch` when they still differ); a server that was down, or goes down before
        it answers, is skipped as :meth:`publish` skips it."""
        folder = await self._save(trainer, version)
        self.bytes_published = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        seconds = await self.publish(version)
        self.publications += 1
        if self.verify_every > 0 and self.publications % self.verify_every == 0 and self.loaded:
            tensors = await asyncio.to_thread(trainer.checkpoint_state_dict)
            for engine in self.loaded:
                self.verified += await verify_or_resync(engine, tensors, trainer, version, self.catch_up)
        return seconds

    async def keep_initial(self, trainer: TrainEngine) -> Path:
        """Write the trainer's weights, before any step, as ``folder(0)`` in the servers' dtype (every rank takes
        part, as in :meth:`publish_from`); returns the folder. Nothing is sent to the servers: they serve these
        weights already, as version 0. ``v0`` is never pruned, so ``arpo eval --model RUN/weights/v0`` scores the
        policy the run started from, whatever ``keep``."""
        return await self._save(trainer, 0)

    async def _save(self, trainer: TrainEngine, version: int) -> Path:
        dtype = await self.dtypes.common(self.engines, Path(trainer.model_dir))
        folder = self.folder(version)
        await asyncio.to_thread(trainer.save_weights, folder, overwrite=True,  # float32: the master weights as they are
                                dtype=dtype_name(dtype) if dtype not in (None, torch.float32) else None)
        return folder

    def folder(self, version: int) -> Path:
        """Where the checkpoint of ``version`` is (to be) saved."""
        return self.weights_root / f"v{version}"

    async def publish(self, version: int) -> float:
        """Load ``folder(version)`` on every server under ``version``; returns the seconds it took.

        A server that stays unreachable (PolicyUnavailable: dead, or restarting) is skipped for this
        version (counted in ``failures``, logged); :meth:`catch_up` sends it the current weights once it answers.

        Raises:
            PublishError: a server answered success=false; the message names it.
        """
        started = time.perf_counter()
        self.loaded = []
        for engine in self.engines:
            try:
                await self._load(engine, version)
                self.loaded.append(engine)
            except PolicyUnavailable as error:
                self.failures += 1
                log.warning("loading version %d on %s failed: %s; it gets the current weights once it answers "
                            "(learner.resync_interval_s)", version, engine.url, error)
        self._prune(version)
        return time.perf_counter() - started

    async def catch_up(self, trainer: TrainEngine, version: int,
                       behind: Sequence[InferenceEngine] | None = None) -> list[str]:
        """Resume the servers a publication left paused, then load ``folder(version)`` (the current weights, already
        on disk) on every server behind ``version`` (``behind``, or :meth:`behind` when None); returns the URLs
        loaded. ``trainer`` is unused (the interface is the publishers'). A server that fails on the way is logged
        and left for the next check."""
        await self.lift_pauses()
        synced = []
        for engine in await self.behind(version) if behind is None else behind:
            try:
                await self._load(engine, version)
            except (PublishError, PolicyUnavailable, PolicyRequestError) as error:
                log.warning("catching %s up to version %d failed: %s; trying again at the next check", engine.url,
                            version, error)
                continue
            log.warning("%s served an older version than %d (restarted?): sent it the current weights", engine.url,
                        version)
            synced.append(engine.url)
        return synced

    async def _load(self, engine: InferenceEngine, version: int) -> None:
        path = str(self.folder(version).resolve())
        await self.pause(engine)
        try:
            reply = await engine.load_weights_from_disk(path, version)
        finally:
            await self.resume(engine)
        if not reply.ok:
            raise PublishError(f"{engine.url} did not load {path}: {reply.message}")

    def _prune(self, newest: int) -> None:
        """Delete the version folders older than the newest ``keep``, except ``v0`` (the run's initial weights)."""
        for old in self.weights_root.glob("v*"):
            suffix = old.name[1:]
            if suffix.isdigit() and 0 < int(suffix) <= newest - self._keep:
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


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class DistributedPublisher(ServerBook):
    """Pushes the trainer's weights to each server over a weight group of its own (learner.weight_sync =
    "distributed"), as SGLang 0.5.23 takes them (arpo_async.weight_sync).

    Per server and publication, through its engine (SGLang's routes in brackets): pause (retract; /pause_generation)
    -> begin_weight_update -> per bucket receive_weights (/update_weights_from_distributed) + broadcast ->
    end_weight_update -> resume (/continue_generation), under checkpoint names (Trainer.checkpoint_state_dict).
    Every ``verify_every``-th publication, each server's checksums are compared with the published tensors
    (:func:`verify_or_resync`).

    Args:
        engines: every inference server; kept as ``engines``.
        bucket_mb: most megabytes of tensors per bucket (one ``receive_weights`` request).
        host: the address the servers reach this learner at (``master_address``; learner.sync_host).
        backend: "gloo" (arpo-serve, CPU) or "nccl" (SGLang on GPUs).
        timeout_s: rendezvous and broadcast timeout per server.
        load_format: None (one broadcast per tensor) or "flattened_bucket" (one flat uint8 tensor per bucket).
        verify_every: compare checksums after every this many publications (0 = never).
        dtypes: the dtype each server gets its tensors in (a new PublishDtypes when None: each server's own).

    Failure (one log line naming the server and the call):
    - a server that answers the join request with success = false raises :class:`SyncRejected` (the learner stops:
      the backend or address is wrong for every version to come); a checksum mismatch that survives a resync of
      the server raises :class:`WeightsMismatch` (the learner stops); a server that cannot check is resynced and
      checked again, and skipped with a warning when it still cannot;
    - a server that cannot be reached, dies, times out mid-broadcast, or answers begin, an update or end with
      success = false is skipped for this version (counted in ``failures``) and its group destroyed; at the next
      publication, once it answers /health again, a new group (a new name: torch refuses a name twice in one
      process) gets the whole current weights. Every server paused is resumed, whatever failed (a resume that does
      not go through is tried again at the next resync). A server that failed after its session began may hold
      part of the new weights (SGLang loads bucket by bucket), whatever version it reports (the last bucket sets
      it), so the next resync sends it the whole current weights (learner.train.server_book); a begin refused
      because a session is still open (a publication cut short) is answered with one end_weight_update and one
      more begin.
    """

    def __init__(self, engines: Sequence[InferenceEngine], *, bucket_mb: float = 512.0,
                 host: str = "127.0.0.1", backend: str = "gloo", timeout_s: float = 120.0,
                 load_format: str | None = None, verify_every: int = 0, dtypes: PublishDtypes | None = None) -> None:
        if load_format not in (None, FLATTENED_BUCKET):
            raise ValueError(f"load_format must be None or {FLATTENED_BUCKET!r}, got {load_format!r}")
        super().__init__(engines)
        self.dtypes = dtypes if dtypes is not None else PublishDtypes()
        self.bytes_published = 0
        """Bytes of tensors the last server synced got."""
        self.bucket_bytes = max(1, int(bucket_mb * (1 << 20)))
        self.host = host
        self.backend = backend
        self.timeout_s = timeout_s
        self.load_format = load_format
        self.verify_every = verify_every
        self._groups: dict[str, WeightGroup] = {}
        """Server URL -> its weight group."""
        self._joins = 0
        self._token = f"{os.getpid()}-{secrets.token_hex(3)}"
        self.publications = 0
        self.failures = 0
        """Server syncs that failed (the server was skipped for that version)."""
        self.verified = 0
        """Server checksum comparisons that agreed."""

    async def keep_initial(self, trainer: TrainEngine) -> None:
        """Nothing: with distributed sync no weights folder is written; the run's base model (``model``) holds the
        weights it started from."""

    async def publish_from(self, trainer: TrainEngine, version: int) -> float:
        """Gather the full weights (every rank takes part), then sync each server; returns the seconds the
        syncs took. Raises only :class:`SyncRejected` and :class:`WeightsMismatch` (see the class docstring)."""
        tensors = await asyncio.to_thread(trainer.checkpoint_state_dict)
        started = time.perf_counter()
        self.publications += 1
        verify = self.verify_every > 0 and self.publications % self.verify_every == 0
        casts: dict[torch.dtype | None, dict[str, torch.Tensor]] = {}
        for index, engine in enumerate(self.engines):
            sent = await self._in_served_dtype(engine, tensors, trainer, casts)
            if await self._sync_or_skip(index, engine, sent, version) and verify:
                self.verified += await verify_or_resync(engine, sent, trainer, version, self.catch_up)
        return time.perf_counter() - started

    async def _in_served_dtype(self, engine: InferenceEngine, tensors: dict[str, torch.Tensor], trainer: TrainEngine,
                               casts: dict[torch.dtype | None, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """``tensors`` in the dtype ``engine`` serves (cast once per dtype and publication, in a thread)."""
        dtype = await self.dtypes.of(engine, Path(trainer.model_dir))
        if dtype not in casts:
            casts[dtype] = await asyncio.to_thread(cast_floating, tensors, dtype)
        return casts[dtype]

    async def catch_up(self, trainer: TrainEngine, version: int,
                       behind: Sequence[InferenceEngine] | None = None) -> list[str]:
        """Resume the servers a publication left paused, then send the trainer's current weights, as ``version``, to
        every server behind it (``behind``, or :meth:`behind` when None) over a new group; returns the URLs that got
        them. Gathers the weights only when a server is behind (every rank takes part). Failures are handled as in
        :meth:`publish_from` (the server waits for the next check)."""
        await self.lift_pauses()
        if behind is None:
            behind = await self.behind(version)
        if not behind:
            return []
        for engine in behind:  # it joins a new group; one that did not restart leaves its old one first
            await self._leave(engine)
            self._drop(engine.url)
        tensors = await asyncio.to_thread(trainer.checkpoint_state_dict)
        synced, casts = [], {}
        for engine in behind:
            sent = await self._in_served_dtype(engine, tensors, trainer, casts)
            if await self._sync_or_skip(self.engines.index(engine), engine, sent, version):
                log.warning("%s served an older version than %d (restarted?): sent it the current weights",
                            engine.url, version)
                synced.append(engine.url)
        return synced

    async def _sync_or_skip(self, index: int, engine: InferenceEngine, tensors: dict[str, torch.Tensor],
                            version: int) -> bool:
        """Sync one server; False (counted in ``failures``, its group dropped) when it fails in a way that skips
        it for this version. Raises SyncRejected."""
        try:
            await self._sync(index, engine, tensors, version)
        except SyncRejected:
            raise
        except (WeightGroupError, PolicyUnavailable, PolicyRequestError, PublishError) as error:
            self.failures += 1
            await self._leave(engine)
            self._drop(engine.url)
            log.warning("weight sync of version %d to %s failed: %s; it gets the whole weights over a new "
                        "group at the next publication once it answers", version, engine.url, error)
            return False
        return True

    async def _leave(self, engine: InferenceEngine) -> None:
        """Ask ``engine`` to destroy the group this publisher had with it (once; a server that does not answer or
        has no such group, e.g. after a restart, is left alone): a failed group would otherwise stay open there."""
        group = self._groups.get(engine.url)
        if group is None:
            return
        try:
            reply = await engine.leave_weight_group(group.name)
        except (PolicyUnavailable, PolicyRequestError) as error:
            log.debug("%s did not leave group %s: %s", engine.url, group.name, error)
            return
        if not reply.ok:
            log.debug("%s did not leave group %s: %s", engine.url, group.name, reply.message)

    def _drop(self, url: str) -> None:
        self.dtypes.forget(url)  # a restarted server may serve another dtype
        group = self._groups.pop(url, None)
        if group is not None:
            group.destroy()

    async def _join(self, index: int, engine: InferenceEngine) -> WeightGroup:
        """A new group with ``engine``: this learner is rank 0, the server's ranks are 1..ranks
        (``weight_group_ranks``; SGLang: rank_offset + tp_rank)."""
        self._joins += 1
        name = f"arpo-weights-{index}-{self._token}-{self._joins}"
        world = 1 + await engine.weight_group_ranks()
        port = _free_port(self.host)
        joining = asyncio.create_task(engine.join_weight_group(
            master_address=self.host, master_port=port, rank_offset=1, world_size=world, group_name=name,
            backend=self.backend, timeout_s=self.timeout_s + 30))
        joined = in_daemon_thread(WeightGroup.join, self.host, port, 0, world, name, self.timeout_s, self.backend)
        await asyncio.wait([joining, joined], return_when=asyncio.FIRST_COMPLETED)
        if joining.done() and not joining.exception() and not joining.result().ok:
            raise SyncRejected(f"{engine.url} init_weights_update_group refused group {name}: "
                               f"{joining.result().message}; check learner.sync_backend (sent "
                               f"{self.backend!r}) and learner.sync_host ({self.host!r}, the address the server "
                               "must reach)")
        try:
            group = await joined
        except WeightGroupError:
            joining.cancel()
            raise
        reply = await joining
        if not reply.ok:
            group.destroy()
            raise PublishError(f"{engine.url} init_weights_update_group did not join {name}: {reply.message}")
        self._groups[engine.url] = group
        return group

    async def _begin(self, engine: InferenceEngine) -> None:
        reply = await engine.begin_weight_update()
        if not reply.ok:  # a session left open by a publication cut short: close it once
            log.warning("%s begin_weight_update refused (%s); closing the open session and beginning again",
                        engine.url, reply.message)
            await engine.end_weight_update()
            reply = await engine.begin_weight_update()
        if not reply.ok:
            raise PublishError(f"{engine.url} begin_weight_update answered success=false: {reply.message}")

    async def _sync(self, index: int, engine: InferenceEngine, tensors: dict[str, torch.Tensor], version: int) -> None:
        group = self._groups.get(engine.url)
        if group is None:
            if not await engine.healthy():
                raise PolicyUnavailable(f"{engine.url} does not answer /health")
            group = await self._join(index, engine)
        await self.pause(engine)
        try:
            await self._begin(engine)  # a begin that fails loaded nothing: the server goes on with its old weights
            self.partial[engine.url] = engine
            try:
                await self._send(engine, group, tensors, version)
                reply = await engine.end_weight_update()
                if not reply.ok:
                    raise PublishError(f"{engine.url} end_weight_update answered success=false: {reply.message}")
            except BaseException:
                log.error("%s may hold part of version %d: it gets the whole weights at the next resync",
                          engine.url, version)
                raise
            self.partial.pop(engine.url, None)
        finally:
            await self.resume(engine)  # whatever failed: a server left paused would never generate again

    async def _send(self, engine: InferenceEngine, group: WeightGroup, tensors: dict[str, torch.Tensor],
                    version: int) -> None:
        parts = buckets(tensors, self.bucket_bytes, aligned=self.load_format == FLATTENED_BUCKET)
        self.bytes_published = tensor_bytes(tensors)
        for k, names in enumerate(parts):
            batch = [tensors[n].contiguous() for n in names]
            request = asyncio.create_task(engine.receive_weights(
                names=names, dtypes=[dtype_name(t.dtype) for t in batch],
                shapes=[list(t.shape) for t in batch], group_name=group.name,
                version=version if k == len(parts) - 1 else None, load_format=self.load_format,
                timeout_s=self.timeout_s + 30))
            payload = [flatten_bucket(batch)] if self.load_format == FLATTENED_BUCKET else batch
            try:
                await asyncio.to_thread(group.broadcast, payload)
            except WeightGroupError:
                request.cancel()
                raise
            reply = await request
            if not reply.ok:
                raise PublishError(f"{engine.url} update_weights_from_distributed answered success=false for "
                                   f"bucket {k + 1}/{len(parts)}: {reply.message}")
