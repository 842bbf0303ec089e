"""The trainer's part of a checkpoint: model weights, AdamW state and step count, written and read back.

learner.train.checkpoint owns the checkpoint folder (``<run>/checkpoints/step-N``) and puts the trainer's part in it
under :func:`checkpoint_name`: ``trainer.pt`` with one rank (``torch.save`` of :func:`state_dict`, loaded with
``weights_only=True``), or ``trainer.dcp`` with several (a torch.distributed.checkpoint folder of every rank's
shards plus rank 0's ``trainer.json``: schema, step count, world size, config). Reads and writes the trainer's
``model``, ``module``, ``optimizer`` and ``steps``. :func:`read_model_weights` reads the policy's weights back out of
either kind without a trainer or ranks (``arpo export``).

With several ranks :func:`save_checkpoint` and :func:`load_checkpoint` are collectives: every rank must call them,
so the learner reaches them through the Trainer methods of the same names, which learner.train.distributed.LeadTrainer
forwards to every rank.

Invariants: a one-rank checkpoint is written to a temporary file and renamed into place; a sharded checkpoint
resumes on any number of ranks > 1 (DCP reshards on load), a one-rank one only on one rank, and each refuses the
other kind with a :class:`~learner.train.trainer_errors.TrainerError` saying so; the optimizer's hyper-parameters come
from the checkpoint, the loss settings from the trainer's own config.
"""

from __future__ import annotations

import json
import os
import uuid
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from arpo_async.config import LearnerConfig
from learner.train.distributed import RankGroup
from learner.train.trainer_errors import TrainerError

__all__ = ["checkpoint_name", "load_checkpoint", "load_state_dict", "read_model_weights", "save_checkpoint",
           "state_dict"]


class CheckpointedTrainer(Protocol):
    """What a trainer checkpoint reads and restores of a trainer; learner.train.trainer.Trainer is one. Typed here
    rather than imported so that the Trainer's forwarding methods (learner.train.trainer) can call this module without
    an import circle."""

    model: torch.nn.Module
    """The Hugging Face policy, saved and restored with ``state_dict`` on one rank."""
    module: torch.nn.Module
    """The root that FSDP2 shards (learner.train.policy_forward.CompletionLogprobs around ``model``)."""
    optimizer: torch.optim.Optimizer
    """The AdamW optimizer whose state is saved."""
    group: RankGroup
    """This process's rank (learner.train.distributed); sharded: a DCP folder."""
    config: LearnerConfig
    """The learner section, saved with the checkpoint for reference."""
    steps: int
    """Optimizer steps taken; restored on load."""

_SCHEMA = 1


def checkpoint_name(trainer: CheckpointedTrainer) -> str:
    """The name of this trainer's part of a checkpoint folder: ``trainer.pt`` (one rank, one file) or
    ``trainer.dcp`` (several ranks: a torch.distributed.checkpoint folder of shards)."""
    return "trainer.dcp" if trainer.group.sharded else "trainer.pt"


def state_dict(trainer: CheckpointedTrainer) -> dict[str, Any]:
    """Model and optimizer state plus the step count and config (tensors and plain python values only).
    One rank only (a sharded trainer saves with :func:`save_checkpoint`)."""
    return {
        "schema": _SCHEMA,
        "steps": trainer.steps,
        "config": asdict(trainer.config),
        "model": trainer.model.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
    }


def load_state_dict(trainer: CheckpointedTrainer, state: dict[str, Any]) -> None:
    """Restore model, optimizer and step count from :func:`state_dict`'s output.

    The optimizer's hyper-parameters come from the checkpoint (as torch restores them); this trainer's
    config is kept for the loss.

    Raises:
        TrainerError: unknown schema or a state that does not fit this model.
    """
    if state.get("schema") != _SCHEMA:
        raise TrainerError(f"unsupported trainer checkpoint schema {state.get('schema')!r}")
    try:
        trainer.model.load_state_dict(state["model"])
        trainer.optimizer.load_state_dict(state["optimizer"])
        trainer.steps = int(state["steps"])
    except (KeyError, RuntimeError, ValueError) as error:
        raise TrainerError(f"checkpoint does not fit this model: {type(error).__name__}: {error}") from error


def save_checkpoint(trainer: CheckpointedTrainer, path: Path) -> Path:
    """``torch.save`` :func:`state_dict` to ``path`` (written to a temporary file, then renamed).

    With several ranks (every rank calls it with the same ``path``, a folder on storage they share): each
    rank writes its shards of the model and the AdamW state with torch.distributed.checkpoint, and rank 0
    adds ``trainer.json`` (schema, step count, world size). A sharded checkpoint resumes on any number of
    ranks > 1 (DCP reshards on load)."""
    path = Path(path)
    if trainer.group.sharded:
        return _save_sharded(trainer, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        torch.save(state_dict(trainer), tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def load_checkpoint(trainer: CheckpointedTrainer, path: Path) -> None:
    """Load a checkpoint written by :func:`save_checkpoint` (``torch.load`` with ``weights_only=True``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        TrainerError: the checkpoint does not fit this model.
    """
    path = Path(path)
    if trainer.group.sharded:
        return _load_sharded(trainer, path)
    sharded = path.with_name("trainer.dcp")
    if path.is_dir() or (not path.exists() and sharded.is_dir()):
        raise TrainerError(f"{path.parent} holds a sharded checkpoint (written by several ranks); resume it under "
                           "torchrun with more than one rank")
    state = torch.load(path, map_location="cpu", weights_only=True)
    load_state_dict(trainer, state)


def _sharded_state(trainer: CheckpointedTrainer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(trainer.module),
            "optimizer": get_optimizer_state_dict(trainer.module, trainer.optimizer)}


def _save_sharded(trainer: CheckpointedTrainer, path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    dcp.save(_sharded_state(trainer), checkpoint_id=str(path))
    if trainer.group.lead:
        info = {"schema": _SCHEMA, "steps": trainer.steps, "world": trainer.group.world,
                "config": asdict(trainer.config)}
        (path / "trainer.json").write_text(json.dumps(info, indent=1))
    dist.barrier()
    return path


def _load_sharded(trainer: CheckpointedTrainer, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    if not (path / "trainer.json").is_file():
        raise TrainerError(f"{path} is not a sharded trainer checkpoint (no trainer.json); a checkpoint "
                           "written by one rank (trainer.pt) resumes only on one rank")
    info = json.loads((path / "trainer.json").read_text())
    if info.get("schema") != _SCHEMA:
        raise TrainerError(f"unsupported trainer checkpoint schema {info.get('schema')!r}")
    state = _sharded_state(trainer)
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(trainer.module, state["model"])
    set_optimizer_state_dict(trainer.module, trainer.optimizer, state["optimizer"])
    trainer.steps = int(info["steps"])


_SHARDED_MODEL_PREFIX = "model.policy."
"""How a sharded checkpoint names a policy weight: the ``model`` entry of :func:`_sharded_state`, then the path of
the weight in ``trainer.module`` (learner.train.policy_forward.CompletionLogprobs, whose ``policy`` is the model)."""


def read_model_weights(path: Path) -> dict[str, torch.Tensor]:
    """The policy's weights in a trainer checkpoint, on the CPU, keyed as transformers names them
    (``model.language_model.layers.0...``, ``lm_head.weight``; tied names included, as ``state_dict`` has them).

    Needs no trainer and no process group: ``trainer.pt`` (one rank) is memory-mapped and only its ``model`` entry
    is read; ``trainer.dcp`` (several ranks) is read with torch.distributed.checkpoint in one process
    (``no_dist=True``), which joins every rank's shards into full tensors and skips the AdamW state.

    Args:
        path: a checkpoint folder's ``trainer.pt`` or ``trainer.dcp`` (:func:`checkpoint_name`).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        TrainerError: the file or folder cannot be read as a trainer checkpoint (truncated, schema unknown, no
            model weights); the message names the cause.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no trainer checkpoint at {path}")
    try:
        if path.is_dir():
            return _read_sharded_model(path)
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except TrainerError:
        raise
    except Exception as error:  # noqa: BLE001 - torch.load / DCP raise many types for a damaged file
        raise TrainerError(f"cannot read {path}: {type(error).__name__}: {error}") from error
    if not isinstance(state, dict) or state.get("schema") != _SCHEMA:
        schema = state.get("schema") if isinstance(state, dict) else type(state).__name__
        raise TrainerError(f"{path} is not a trainer checkpoint of schema {_SCHEMA} (found {schema!r})")
    model = state.get("model")
    if not isinstance(model, dict) or not model:
        raise TrainerError(f"{path} holds no model weights")
    return dict(model)


def _read_sharded_model(path: Path) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    info_file = path / "trainer.json"
    if not info_file.is_file():
        raise TrainerError(f"{path} is not a sharded trainer checkpoint (no trainer.json)")
    info = json.loads(info_file.read_text())
    if info.get("schema") != _SCHEMA:
        raise TrainerError(f"unsupported trainer checkpoint schema {info.get('schema')!r} in {info_file}")
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    empty = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in metadata.state_dict_metadata.items()
             if key.startswith(_SHARDED_MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata)}
    if not empty:
        raise TrainerError(f"{path} holds no model weights (no {_SHARDED_MODEL_PREFIX}* entry)")
    with warnings.catch_warnings():  # "torch.distributed is disabled ... assuming ... a single process": intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(empty, checkpoint_id=str(path), no_dist=True)
    return {key[len(_SHARDED_MODEL_PREFIX):]: tensor for key, tensor in empty.items()}
