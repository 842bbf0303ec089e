"""Weight export: the trained policy's weights in the forms inference servers load, gathered from every rank.

Owns the two exports the weight publisher (learner.train.publisher) sends: a complete Hugging Face checkpoint folder
(:func:`save_weights`: for ``/update_weights_from_disk`` and arpo-serve; written by :func:`write_folder`, which
``arpo export`` uses too) and the full tensors under checkpoint
names (:func:`checkpoint_state_dict`: for the NCCL/gloo weight broadcast, learner.train.publisher.DistributedPublisher).
Reads the trainer's policy (``trainer.model``, ``trainer.module``), its rank group and its source folder; writes
nothing to the trainer.

With several ranks every function here is a collective: every rank must call it, so the learner reaches them
through the Trainer methods of the same names, which learner.train.distributed.LeadTrainer forwards to every rank.

Invariants: weight folders are written to a temporary sibling and renamed into place, so a reader never sees half
a folder; every file in one has the same mode (``0666`` less the umask, as ``open`` gives); tied weights
(``trainer.tied``) are left out, as save_pretrained leaves them out; only rank 0 receives
and writes the full tensors.
"""

from __future__ import annotations

import os
import shutil
import stat
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from arpo_async.model.checkpoint_names import to_checkpoint_names
from arpo_async.weight_sync import cast_floating, dtype_from_name
from learner.train.distributed import RankGroup
from learner.train.trainer_errors import TrainerError

__all__ = ["PROCESSOR_FILES", "ExportSource", "checkpoint_state_dict", "full_state_dict", "save_weights",
           "write_folder"]


class ExportSource(Protocol):
    """What the export reads of a trainer; learner.train.trainer.Trainer is one. Typed here rather than imported so that
    the Trainer's forwarding methods (learner.train.trainer) can call this module without an import circle."""

    model: torch.nn.Module
    """The Hugging Face policy (``state_dict``, ``save_pretrained``)."""
    module: torch.nn.Module
    """The root that FSDP2 shards (learner.train.policy_forward.CompletionLogprobs around ``model``)."""
    group: RankGroup
    """This process's rank (learner.train.distributed)."""
    tied: set[str]
    """Names of weights tied to another one, left out of every export."""
    model_dir: Path
    """The source model folder, whose processor files are copied."""

# Files besides the weights that make a checkpoint folder loadable by transformers, arpo-serve and SGLang:
# tokenizer, chat template and image/video processor configs. Copied from the source model folder when present.
PROCESSOR_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
)


def save_weights(trainer: ExportSource, out_dir: Path, *, overwrite: bool = False, dtype: str | None = None) -> Path:
    """Write the current weights as a complete Hugging Face checkpoint folder, atomically.

    The folder holds ``config.json``, ``generation_config.json``, ``model.safetensors`` (``save_pretrained``,
    safetensors) and the tokenizer, chat-template and processor files copied from the source model folder,
    so SGLang's ``/update_weights_from_disk``, ``arpo-serve`` and ``load_policy`` can load it. It is written
    to a temporary sibling folder and renamed to ``out_dir``.

    Args:
        trainer: the learner.train.trainer.Trainer whose policy is written (its ``model_dir`` gives the processor
            files).
        out_dir: the folder to create.
        overwrite: replace an existing ``out_dir`` (the old folder is moved aside, then deleted).
        dtype: write the floating-point weights in this dtype ("bfloat16", ...; arpo_async.weight_sync.DTYPE_NAMES),
            e.g. the one the inference servers serve (learner.train.publish_dtype); None: as trained (float32).

    Returns:
        ``out_dir`` as a Path.

    With several ranks every rank must call it (the full tensors are gathered from the shards); rank 0
    writes the folder, the others only take part in the gather.

    Raises:
        TrainerError: ``out_dir`` exists and ``overwrite`` is False.
    """
    out_dir = Path(out_dir)
    full = full_state_dict(trainer) if trainer.group.sharded or dtype is not None else None
    if not trainer.group.lead:
        return out_dir
    if out_dir.exists() and not overwrite:
        raise TrainerError(f"weights folder {out_dir} already exists (pass overwrite=True to replace it)")
    if dtype is not None:
        full = cast_floating(full, dtype_from_name(dtype))
    return write_folder(trainer.model, out_dir, trainer.model_dir, state_dict=full)


def write_folder(model: torch.nn.Module, out_dir: Path, source_dir: Path, *,
                 state_dict: dict[str, torch.Tensor] | None = None,
                 finish: Callable[[Path], None] | None = None) -> Path:
    """Write ``model`` as a Hugging Face folder at ``out_dir``, atomically, replacing any folder there.

    ``model.save_pretrained`` (safetensors; ``config.json``, ``generation_config.json``; tied weights left out)
    into a temporary sibling, plus the tokenizer, chat-template and processor files of ``source_dir`` (the model
    folder the weights came from), then renamed to ``out_dir``; an existing ``out_dir`` is moved aside first and
    deleted after. Used by :func:`save_weights` (the learner's ``weights/vN``) and ``arpo export``. Every file
    gets the mode a new file gets here (``0666`` less the umask): safetensors writes ``model.safetensors`` 0600
    and ``shutil.copy2`` would keep the source files' modes.

    Args:
        model: a transformers ``PreTrainedModel`` (its config and generation config are written).
        out_dir: the folder to create or replace.
        source_dir: the folder to copy the processor files from (those it has).
        state_dict: the weights to write instead of ``model``'s own (e.g. gathered from a sharded model).
        finish: called with the temporary folder once every file is in it, before the rename (``arpo export``
            writes its manifest there); what it raises leaves ``out_dir`` as it was.

    Returns:
        ``out_dir`` as a Path.
    """
    out_dir, source_dir = Path(out_dir), Path(source_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        for name in PROCESSOR_FILES:
            source = source_dir / name
            if source.is_file():
                shutil.copyfile(source, tmp / name)
        if finish is not None:
            finish(tmp)
        _same_mode(tmp)
        if out_dir.exists():
            old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out_dir, old)
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _same_mode(folder: Path) -> None:
    """Give every regular file in ``folder`` the mode ``open`` gives a new file here (``0666`` less the umask),
    learned from a probe file rather than ``os.umask`` (which sets the umask of every thread while it reads it)."""
    probe = folder / f".mode-{uuid.uuid4().hex[:8]}"
    fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
        probe.unlink()
    for entry in os.scandir(folder):
        if entry.is_file(follow_symlinks=False):
            os.chmod(entry.path, mode)


def full_state_dict(trainer: ExportSource) -> dict[str, torch.Tensor]:
    """The policy's whole weights on the CPU, keyed as transformers names them (``model.language_model...``).

    With several ranks this is a collective (every rank must call it): rank 0 receives the full tensors,
    the other ranks an empty dict (torch.distributed.checkpoint.state_dict, ``full_state_dict=True``).
    """
    if not trainer.group.sharded:
        return {k: v.detach().to("cpu") for k, v in trainer.model.state_dict().items() if k not in trainer.tied}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(trainer.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    prefix = "policy."
    named = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in full.items()}
    return {k: v for k, v in named.items() if k not in trainer.tied}


def checkpoint_state_dict(trainer: ExportSource) -> dict[str, torch.Tensor]:
    """:func:`full_state_dict` under checkpoint names (``model.layers...``, ``visual...``: what save_pretrained
    writes and SGLang's ``load_weights`` matches; arpo_async.model.checkpoint_names). A collective like
    :func:`full_state_dict`; ranks other than 0 get an empty dict."""
    full = full_state_dict(trainer)
    return to_checkpoint_names(trainer.model, full) if full else {}
