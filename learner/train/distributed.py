"""Sharded data-parallel training: ranks under torchrun and FSDP2 sharding (rank 0 leads the others through
learner.train.lead_trainer).

Layout of a run with N ranks (``torchrun --nproc-per-node N -m learner.main --config run.toml``; across nodes
with torchrun's usual ``--nnodes``/``--rdzv-endpoint`` flags):

- every rank loads the policy and shards it with FSDP2 (:func:`shard_policy`: ``fully_shard`` on each decoder
  layer, then on the root): parameters, gradients and AdamW state are split across ranks;
- rank 0 alone runs the learner (ZeroMQ socket, scheduler, batcher, replay buffer, publisher, checkpointer,
  metrics). It drives the trainer through learner.train.lead_trainer.LeadTrainer, which first tells every other
  rank what to do (one ``broadcast_object_list`` per call: a command holding the call's arguments, the step's
  samples included), then does its own share;
- ranks 1..N-1 run learner.train.lead_trainer.follow: wait for the next command, run it on their
  learner.train.trainer.Trainer, repeat until rank 0 says stop. Each picks its share of the step's samples
  itself (learner.train.microbatch plans from token counts alone, so all ranks agree without talking), and FSDP's
  collectives keep them in step.

Failure: a rank that dies breaks the collectives; the survivors log it and exit non-zero, torchrun stops the
others (learner.train.lead_trainer). A restart resumes from the newest checkpoint (torch.distributed.checkpoint,
written by all ranks).

Backend: "gloo" on CPU, "nccl" on CUDA (``learner.device``).
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

log = logging.getLogger("arpo.learner.dist")

__all__ = ["RankGroup", "RankGroupError", "init_one_rank_fsdp", "init_ranks", "leave", "shard_policy"]


class RankGroupError(RuntimeError):
    """The process group cannot be set up, or a collective failed (a rank died or timed out)."""


@dataclass(frozen=True)
class RankGroup:
    """This process's place in the data-parallel group.

    Attributes:
        rank: 0..world-1; rank 0 leads.
        world: number of ranks (1 = no process group, no FSDP).
        device: where this rank trains (``cuda:<local rank>`` under torchrun on GPUs).
        fsdp: shard with FSDP2 even with one rank (the default process group must exist): runs FSDP2's code path
            on one device, as the GPU check does (scripts/gpu_check.sh); several ranks always shard.
    """

    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    fsdp: bool = False

    @property
    def sharded(self) -> bool:
        """Whether the policy is sharded with FSDP2 (and the trainer's calls are collectives)."""
        return self.world > 1 or self.fsdp

    @property
    def lead(self) -> bool:
        return self.rank == 0


def torchrun_world() -> int:
    """WORLD_SIZE as torchrun sets it (1 when not under torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_ranks(device: torch.device, timeout_s: float) -> RankGroup:
    """Join torchrun's process group (gloo on CPU, nccl on CUDA) when WORLD_SIZE > 1; else a 1-rank group.

    Args:
        device: ``learner.device`` resolved; on CUDA each rank takes ``cuda:LOCAL_RANK``.
        timeout_s: collective timeout (``learner.dist_timeout_s``).
    Raises:
        RankGroupError: the rendezvous fails, or CUDA has fewer devices than local ranks.
    """
    world = torchrun_world()
    if world <= 1:
        return RankGroup(device=device)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        if local >= torch.cuda.device_count():
            raise RankGroupError(f"local rank {local} but only {torch.cuda.device_count()} CUDA devices "
                                 "(use --nproc-per-node <= the GPUs per node)")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as error:
        raise RankGroupError(f"cannot join torchrun's process group ({backend}): {error}") from error
    return RankGroup(rank=dist.get_rank(), world=dist.get_world_size(), device=device)


def init_one_rank_fsdp(device: torch.device, timeout_s: float = 300.0) -> RankGroup:
    """A one-rank default process group (nccl on CUDA, gloo on CPU, rendezvous on a free loopback port) and a
    :class:`RankGroup` that shards with FSDP2 on it: FSDP2's code path (mixed precision, gathered weights for
    publication) on one device, without torchrun.

    Raises:
        RankGroupError: a default process group exists already, or the group cannot be made.
    """
    import socket

    if dist.is_initialized():
        raise RankGroupError("a default process group exists already in this process")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as error:
        raise RankGroupError(f"cannot make a one-rank {backend} process group: {error}") from error
    return RankGroup(device=device, fsdp=True)


def shard_policy(root: torch.nn.Module, policy, *, bf16: bool) -> None:
    """FSDP2: ``fully_shard`` every decoder layer of ``policy``, then ``root`` (which owns the rest: embeddings,
    vision tower, final norm, output head), in place.

    ``bf16``: parameters are all-gathered and computed in bfloat16 while the sharded master copy, the
    gradients' reduce-scatter and the AdamW state stay float32 (``MixedPrecisionPolicy``). FSDP2 averages
    gradients over ranks (gloo has no pre-scaled sum, so the divide factor is left alone); the trainer scales
    each rank's loss by the world size, so the average is the sum over ranks of loss_sum / the step's token count
    and the step equals the 1-rank step (learner.train.trainer).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
          else MixedPrecisionPolicy())
    for layer in decoder_layers(policy):
        fully_shard(layer, mp_policy=mp)
    fully_shard(root, mp_policy=mp)


def decoder_layers(policy) -> list[torch.nn.Module]:
    """The language model's decoder layers (Qwen2.5-VL: ``policy.model.language_model.layers``)."""
    inner = policy.model
    language = getattr(inner, "language_model", inner)
    return list(language.layers)


def vision_blocks(policy) -> list[torch.nn.Module]:
    """The vision tower's blocks (Qwen2.5-VL: ``policy.model.visual.blocks``; ``policy.visual`` in transformers
    4.x); empty for a model without one."""
    visual = getattr(policy.model, "visual", None)
    visual = getattr(policy, "visual", None) if visual is None else visual
    return list(getattr(visual, "blocks", []))


def leave(code: int) -> NoReturn:
    """End a rank's process with ``code`` once its work is done and the group destroyed: flush logs and stdio,
    then ``os._exit``. A plain interpreter exit after a gloo group aborts now and then ("terminate called without
    an active exception", SIGABRT, about 1 run in 15 on torch 2.13 CPU) while static destructors run, which
    would turn a finished run into a failed one."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
