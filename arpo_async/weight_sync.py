"""Weights over a process group: what the learner and an inference server share to move tensors without disk.

SGLang 0.5.23's protocol (read in the sglang 0.5.23 wheel: python/sglang/srt/entrypoints/http_server.py,
managers/io_struct.py, managers/scheduler_components/weight_updater.py,
model_executor/model_runner_components/weight_updater.py, utils/common.py), which verl, slime and AReaL drive:

1. the trainer's rank 0 (group rank 0) POSTs ``/init_weights_update_group {master_address, master_port,
   rank_offset, world_size, group_name, backend}``; both ends then build the group with
   :func:`init_custom_process_group` (the server as rank ``rank_offset + tp_rank``);
2. per publication the trainer opens a session, ``POST /begin_weight_update {"selector": "all"}``; per bucket it
   POSTs ``/update_weights_from_distributed {names, dtypes, shapes, group_name, load_format, flush_cache,
   abort_all_requests, weight_version}`` and, while that request waits, broadcasts from rank 0 either each named
   tensor in ``names`` order or, with ``load_format = "flattened_bucket"``, one flat uint8 tensor laid out as
   :func:`flatten_bucket` lays it out; then ``POST /end_weight_update {}`` closes the session. An update outside
   a session, a second begin or an end without a begin answer success = false (HTTP 400).

The learner sends these requests through its inference engine (arpo_async.engine: ``join_weight_group``,
``begin_weight_update``, ``receive_weights``, ``end_weight_update``; SGLang's in arpo_async.sglang_engine).

Names on the wire are checkpoint names (``model.layers.N...``, ``visual...``, ``lm_head.weight``: what
``save_pretrained`` writes, arpo_async.model.checkpoint_names), because SGLang's ``load_weights`` matches those.

:func:`tensor_checksum` and :func:`overall_checksum` are SGLang's ``/weights_checker`` hashes
(sglang/srt/utils/weight_checker.py ``_hash_tensor``, ``overall_checksum``; mm_utils.py ``tensor_hash``, CPU path).
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

__all__ = ["DTYPE_NAMES", "WeightGroup", "WeightGroupError", "bucket_layout", "dtype_from_name", "dtype_name",
           "flatten_bucket", "in_daemon_thread", "init_custom_process_group", "overall_checksum", "tensor_checksum",
           "unflatten_bucket"]

DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""dtype strings on the wire (SGLang sends ``str(dtype).split(".")[-1]``, e.g. "bfloat16")."""

FLATTENED_BUCKET = "flattened_bucket"
"""SGLang's ``load_format`` for one flat uint8 tensor per ``/update_weights_from_distributed`` call."""


class WeightGroupError(RuntimeError):
    """The rendezvous failed, or a broadcast failed (the other end died or timed out)."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


def cast_floating(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """``tensors`` with every floating-point tensor cast to ``dtype`` (integer and bool tensors as they are); the
    same dict when ``dtype`` is None or nothing needs a cast."""
    if dtype is None or all(not t.is_floating_point() or t.dtype == dtype for t in tensors.values()):
        return tensors
    return {name: t.to(dtype) if t.is_floating_point() else t for name, t in tensors.items()}


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> torch.bfloat16. Raises ValueError for another name."""
    key = name.split(".")[-1]
    if key not in DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {name!r}; one of {sorted(DTYPE_NAMES)}")
    return DTYPE_NAMES[key]


def init_custom_process_group(*, backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout: datetime.timedelta) -> "dist.ProcessGroup":
    """A process group apart from the default one, built exactly as SGLang's ``init_custom_process_group``
    (sglang 0.5.23 python/sglang/srt/utils/common.py, itself after verl and OpenRLHF) builds it, so that both
    ends meet: torch's ``rendezvous(init_method, rank, world_size)`` (a TCPStore, rank 0 hosting it; see below), then
    ``PrefixStore(group_name, store)``, then ``_new_process_group_helper(world_size, rank, [], backend, store,
    group_name=group_name)``, which prefixes the keys again; group ranks equal their ranks in the group.

    Args:
        init_method: ``"tcp://ADDR:PORT"``.
        group_name: unique within this process (torch refuses a name already created here).

    One departure, which changes no key: the store is made as ``rendezvous`` makes it outside torchrun
    (``TCPStore(host, port, world_size, is_master=rank == 0, multi_tenant=True)``, torch's ``_create_c10d_store``).
    Under torchrun (``TORCHELASTIC_USE_AGENT_STORE``) ``rendezvous`` would make rank 0 a client of a store that
    nobody hosts at ``init_method`` (verl and slime run their trainers under Ray, where this never arises), and
    the learner's rank 0 runs under torchrun.

    Raises:
        ValueError, RuntimeError, torch.distributed.DistError: the rendezvous timed out or the name is taken.
    """
    from urllib.parse import urlparse

    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    where = urlparse(init_method)
    if where.scheme != "tcp" or where.hostname is None or where.port is None:
        raise ValueError(f"init_method must be tcp://ADDR:PORT, got {init_method!r}")
    store = dist.TCPStore(host_name=where.hostname, port=where.port, world_size=world_size, is_master=rank == 0,
                          timeout=timeout, multi_tenant=True)
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                         backend_options=None, timeout=timeout, device_id=None)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


MULTI_RANK_NCCL = (2, 30, 0)
"""The first NCCL that lets two ranks of one communicator share a GPU, with ``NCCL_MULTI_RANK_GPU_ENABLE=1``
(NCCL 2.30 release notes, experimental); NCCL 2.5 to 2.29 refuse them ("Duplicate GPU detected")."""


def weight_group_plan() -> tuple[str, int]:
    """How a weight group between a learner on GPU 0 and one inference server on this machine can run:
    ``(backend, the server's GPU)``.

    ("nccl", 1) when there are two GPUs or more; ("nccl", 0) when there is one and NCCL is `MULTI_RANK_NCCL` or
    newer (both processes then need ``NCCL_MULTI_RANK_GPU_ENABLE=1``); else ("gloo", 0): the same broadcasts
    through host memory. Without CUDA: ("gloo", 0).
    """
    if not torch.cuda.is_available():
        return "gloo", 0
    if torch.cuda.device_count() >= 2:
        return "nccl", 1
    return ("nccl" if tuple(torch.cuda.nccl.version()[:3]) >= MULTI_RANK_NCCL else "gloo"), 0


@dataclass
class WeightGroup:
    """One member's handle on a weight-update group (blocking calls: run them in a thread).

    Attributes: name (``group_name``), rank in the group, world (members), the process group, and the device
    tensors go through (CUDA for nccl).
    """

    name: str
    rank: int
    world: int
    group: "dist.ProcessGroup"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @classmethod
    def join(cls, address: str, port: int, rank: int, world: int, name: str, timeout_s: float,
             backend: str = "gloo") -> "WeightGroup":
        """Build the group with :func:`init_custom_process_group` (rank 0 hosts the rendezvous at
        ``address:port``; the others connect to it). Blocks until all joined.

        ``backend``: "gloo" (CPU tensors) or "nccl" (tensors are moved to the current CUDA device to broadcast).

        Raises:
            WeightGroupError: the rendezvous did not complete within ``timeout_s``, the address is unusable, the
                name was already used in this process, or "nccl" without CUDA.
        """
        if backend not in ("gloo", "nccl"):
            raise WeightGroupError(f"weight group backend must be 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise WeightGroupError("weight group backend 'nccl' needs CUDA; this process sees no CUDA device")
        try:
            group = init_custom_process_group(backend=backend, init_method=f"tcp://{address}:{port}",
                                              world_size=world, rank=rank, group_name=name,
                                              timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError) as error:
            raise WeightGroupError(f"cannot join weight group {name!r} at {address}:{port} as rank {rank} of "
                                   f"{world}: {error}") from error
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        return cls(name, rank, world, group, device)

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        """Broadcast ``tensors`` from group rank 0 in order (rank 0 sends them; the others receive into them),
        one ``torch.distributed.broadcast(src=0)`` each, as SGLang's receiver posts them.

        Raises:
            WeightGroupError: a member died or the broadcast timed out.
        """
        try:
            for tensor in tensors:
                if tensor.device != self.device:  # nccl: through the GPU, back into the caller's tensor
                    staged = tensor.to(self.device)
                    dist.broadcast(staged, src=0, group=self.group)
                    tensor.copy_(staged)
                else:
                    dist.broadcast(tensor, src=0, group=self.group)
        except (RuntimeError, dist.DistError) as error:
            raise WeightGroupError(f"broadcast in weight group {self.name!r} failed: {error}") from error

    def destroy(self) -> None:
        """Forget the group here (its name may then be used again). Never raises."""
        try:
            dist.destroy_process_group(self.group)
        except (RuntimeError, ValueError, AssertionError):
            pass


# ---------------------------------------------------------------------------------------- flattened buckets


def bucket_layout(dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Byte ``(start, end)`` of each tensor in a flattened bucket: back to back, in order, no padding (sglang
    0.5.23 weight_sync/tensor_bucket.py ``FlattenedTensorBucket``).

    Raises:
        ValueError: a negative dimension, no tensor, or a tensor whose start is not a multiple of its element
            size (SGLang refuses such a bucket: "Unaligned received tensor").
    """
    spans, offset = [], 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        if any(int(d) < 0 for d in shape):
            raise ValueError(f"negative dimension in shape {list(shape)}")
        if offset % dtype.itemsize:
            raise ValueError(f"unaligned tensor in a flattened bucket: byte offset {offset}, dtype {dtype}")
        size = torch.Size([int(d) for d in shape]).numel() * dtype.itemsize
        spans.append((offset, offset + size))
        offset += size
    if not spans:
        raise ValueError("a flattened bucket needs at least one tensor")
    return spans


def flatten_bucket(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat uint8 tensor holding ``tensors``' bytes back to back (shape ``[total_bytes]``), as SGLang's
    ``FlattenedTensorBucket(named_tensors=...)`` builds it. Raises ValueError as :func:`bucket_layout`."""
    bucket_layout([t.dtype for t in tensors], [t.shape for t in tensors])
    return torch.cat([t.contiguous().flatten().view(torch.uint8) for t in tensors])


def unflatten_bucket(flat: torch.Tensor, dtypes: Sequence[torch.dtype],
                     shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Views of ``flat`` (uint8) as the bucket's tensors (SGLang's ``reconstruct_tensors``).

    Raises:
        ValueError: as :func:`bucket_layout`, or ``flat`` is not exactly as long as the layout.
    """
    spans = bucket_layout(dtypes, shapes)
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() != spans[-1][1]:
        raise ValueError(f"flattened bucket holds {flat.numel()} {flat.dtype} elements; the layout needs "
                         f"{spans[-1][1]} uint8")
    return [flat[a:b].view(dtype).reshape([int(d) for d in shape])
            for (a, b), dtype, shape in zip(spans, dtypes, shapes)]


# ---------------------------------------------------------------------------------------- checksums


def tensor_checksum(tensor: torch.Tensor) -> str:
    """SGLang's per-tensor weight checksum: the first 8 bytes of sha256 over the tensor's raw bytes (contiguous,
    on the CPU), as 16 hex digits (sglang 0.5.23 utils/weight_checker.py ``_hash_tensor`` over
    managers/mm_utils.py ``tensor_hash``, CPU path; on CUDA SGLang hashes with a kernel of its own, so a GPU
    server's checksums match only another GPU's)."""
    data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    digest = hashlib.sha256(memoryview(data)).digest()[:8]
    return f"{int.from_bytes(digest, byteorder='big', signed=False):016x}"


def overall_checksum(checksums: dict[str, str]) -> str:
    """sha256 over ``name + checksum`` in sorted name order, hex (SGLang's ``overall_checksum``)."""
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()


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
