"""Weights over a process group: what the learner and an inference server share to move tensors without disk.

SGLang's protocol (REFERENCE.md section 4; sglang 0.5.x ``/init_weights_update_group`` and
``/update_weights_from_distributed``, which verl, slime and AReaL drive):

1. the trainer's rank 0 (group rank 0) opens a TCP rendezvous at ``master_address:master_port`` and POSTs
   ``/init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name, backend}``
   to the server, which joins the group as rank ``rank_offset`` (ranks 1..world_size-1 are servers' GPUs);
2. per update the trainer POSTs ``/update_weights_from_distributed {names, dtypes, shapes, group_name,
   flush_cache, abort_all_requests, weight_version}`` and, while that request waits, broadcasts each named
   tensor from rank 0, in ``names`` order; the server receives them into fresh tensors of the given dtype and
   shape, loads them, and answers ``{"success", "message"}``.

Here both ends build the group from a ``TCPStore`` with ``ProcessGroupGloo`` (CPU tensors; arpo-serve runs on
CPU), a group of its own, apart from torchrun's training group. SGLang on GPUs uses NCCL with the same
messages; the learner asks for ``backend = "nccl"`` when ``learner.device`` is cuda.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DTYPE_NAMES", "WeightGroup", "WeightGroupError", "dtype_from_name", "dtype_name"]

DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""dtype strings on the wire (SGLang sends ``str(dtype).split(".")[-1]``, e.g. "bfloat16")."""


class WeightGroupError(RuntimeError):
    """The rendezvous failed, or a broadcast failed (the other end died or timed out)."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> torch.bfloat16. Raises ValueError for another name."""
    key = name.split(".")[-1]
    if key not in DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {name!r}; one of {sorted(DTYPE_NAMES)}")
    return DTYPE_NAMES[key]


@dataclass
class WeightGroup:
    """One member's handle on a weight-update group (blocking calls: run them in a thread).

    Attributes: name (``group_name``), rank in the group, world (members), the gloo process group.
    """

    name: str
    rank: int
    world: int
    group: "dist.ProcessGroup"

    device: torch.device = torch.device("cpu")

    @classmethod
    def join(cls, address: str, port: int, rank: int, world: int, name: str, timeout_s: float,
             backend: str = "gloo") -> "WeightGroup":
        """Rank 0 hosts the rendezvous at ``address:port``; the others connect to it. Blocks until all joined.

        ``backend``: "gloo" (CPU tensors) or "nccl" (tensors are moved to the current CUDA device to broadcast).

        Raises:
            WeightGroupError: the rendezvous did not complete within ``timeout_s``, the address is unusable, or
                "nccl" without CUDA.
        """
        timeout = datetime.timedelta(seconds=timeout_s)
        if backend not in ("gloo", "nccl"):
            raise WeightGroupError(f"weight group backend must be 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise WeightGroupError("weight group backend 'nccl' needs CUDA; this process sees no CUDA device")
        try:
            store = dist.TCPStore(address, port, world, is_master=rank == 0, timeout=timeout,
                                  wait_for_workers=False)
            prefixed = dist.PrefixStore(name, store)
            if backend == "nccl":
                group = dist.ProcessGroupNCCL(prefixed, rank, world)
            else:
                group = dist.ProcessGroupGloo(prefixed, rank, world, timeout)
        except (RuntimeError, ValueError) as error:
            raise WeightGroupError(f"cannot join weight group {name!r} at {address}:{port} as rank {rank} of "
                                   f"{world}: {error}") from error
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        member = cls(name, rank, world, group, device)
        member._store = store  # the rendezvous server lives as long as rank 0's handle
        return member

    def broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Broadcast ``tensors`` from rank 0 in order (rank 0 sends them; the others receive into them).

        Raises:
            WeightGroupError: a member died or the broadcast timed out.
        """
        try:
            for tensor in tensors:
                if tensor.device != self.device:  # nccl: through the GPU, back into the caller's tensor
                    staged = tensor.to(self.device)
                    self.group.broadcast(staged, 0).wait()
                    tensor.copy_(staged)
                else:
                    self.group.broadcast(tensor, 0).wait()
        except (RuntimeError, dist.DistError) as error:
            raise WeightGroupError(f"broadcast in weight group {self.name!r} failed: {error}") from error
