"""A Hugging Face weights folder, written atomically: what inference servers and ``arpo export`` load.

Owns :func:`write_folder` and the list of processor files (:data:`PROCESSOR_FILES`) copied beside the weights. It
takes a model and the tensors to write, never a trainer: the trainer's state gathers its own weights
(learner.train.train_state.TrainState.save_weights, for the publisher's ``<run>/weights/vN``), and ``arpo export``
reads them out of a checkpoint (arpo_cli.export_command).

Invariants: a folder is written to a temporary sibling and renamed into place, so a reader never sees half a folder;
every file in one has the same mode (``0666`` less the umask, as ``open`` gives); tied weights are left out, as
save_pretrained leaves them out.
"""

from __future__ import annotations

import os
import shutil
import stat
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["PROCESSOR_FILES", "write_folder"]


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


def write_folder(model: torch.nn.Module, out_dir: Path, source_dir: Path, *,
                 state_dict: dict[str, torch.Tensor] | None = None,
                 finish: Callable[[Path], None] | None = None) -> Path:
    """Write ``model`` as a Hugging Face folder at ``out_dir``, atomically, replacing any folder there.

    ``model.save_pretrained`` (safetensors; ``config.json``, ``generation_config.json``; tied weights left out)
    into a temporary sibling, plus the tokenizer, chat-template and processor files of ``source_dir`` (the model
    folder the weights came from), then renamed to ``out_dir``; an existing ``out_dir`` is moved aside first and
    deleted after. Used by learner.train.train_state.TrainState.save_weights (the learner's ``weights/vN``) and
    ``arpo export``. Every file gets the mode a new file gets here (``0666`` less the umask): safetensors writes
    ``model.safetensors`` 0600 and ``shutil.copy2`` would keep the source files' modes.

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
