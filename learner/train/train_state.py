"""What a trainer trains and saves: the policy, its sharded root, AdamW and the step count, with their files.

Owns :class:`TrainState`, whose fields are the whole of a trainer's state, and every read and write of them: the
trainer's part of a checkpoint (:meth:`TrainState.save_checkpoint`, :meth:`TrainState.load_checkpoint`) and the
exports the weight publishers send (:meth:`TrainState.save_weights`, :meth:`TrainState.checkpoint_state_dict`).
learner.train.trainer.Trainer is a TrainState plus the optimizer step; it is the only subclass. Also here, as the
format's reader: :func:`read_model_weights`, the policy's weights out of a checkpoint without a trainer or ranks
(``arpo export``).

Checkpoint files (learner.train.checkpoint puts them in ``<run>/checkpoints/step-N`` under
:attr:`TrainState.checkpoint_name`): ``trainer.pt`` with one rank (``torch.save`` of :meth:`TrainState.state_dict`,
loaded with ``weights_only=True``), or ``trainer.dcp`` with several (a torch.distributed.checkpoint folder of every
rank's shards plus rank 0's ``trainer.json``: schema, step count, world size, config).

With several ranks, saving and loading a checkpoint and every export are collectives: every rank must call them
(rank 0 reaches the others through learner.train.lead_trainer.LeadTrainer).

Invariants: a one-rank checkpoint is written to a temporary file and renamed into place; a sharded checkpoint
resumes on any number of ranks > 1 (DCP reshards on load), a one-rank one only on one rank, and each refuses the
other kind with a :class:`~learner.train.trainer_errors.TrainerError` saying so; the optimizer's hyper-parameters
come from the checkpoint, the loss settings from the trainer's own config; tied weights (:attr:`TrainState.tied`)
are left out of every export, as save_pretrained leaves them out; only rank 0 receives and writes full tensors.
"""

from __future__ import annotations

import json
import os
import uuid
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from arpo_async.config import LearnerConfig
from arpo_async.model.checkpoint_names import tied_names, to_checkpoint_names
from arpo_async.model.inputs import load_policy
from arpo_async.weight_sync import cast_floating, dtype_from_name
from learner.train.distributed import RankGroup, decoder_layers, shard_policy, vision_blocks
from learner.train.policy_forward import CompletionLogprobs
from learner.train.trainer_errors import TrainerError
from learner.train.weights_export import write_folder

__all__ = ["TrainState", "read_model_weights"]

_SCHEMA = 1
_SHARDED_MODEL_PREFIX = "model.policy."
"""How a sharded checkpoint names a policy weight: the ``model`` entry of ``_sharded_state``, then the path of the
weight in ``TrainState.module`` (learner.train.policy_forward.CompletionLogprobs, whose ``policy`` is the model)."""


class TrainState:
    """The policy being trained, its AdamW optimizer and the count of optimizer steps, on this rank.

    Args:
        model_dir: a Hugging Face checkpoint folder (Qwen2-VL / Qwen2.5-VL layout), loaded with
            :func:`arpo_async.model.inputs.load_policy`; its processor files go into every weights folder written.
        config: the learner section (lr, weight_decay, dtype, torch_threads, gradient_checkpointing,
            logprob_chunk_tokens are read here).
        group: this process's rank (learner.train.distributed); sharded: the policy is sharded with FSDP2.

    Sets ``torch.set_num_threads(config.torch_threads)`` for the whole process. The weights stay float32 (the
    master copy the optimizer updates).

    Raises:
        arpo_async.model.inputs.ModelInputError: the folder cannot be loaded.
    """

    def __init__(self, model_dir: Path, config: LearnerConfig, group: RankGroup) -> None:
        self.model_dir = Path(model_dir)
        self.config = config
        self.group = group
        self.device = group.device
        torch.set_num_threads(config.torch_threads)
        self.model, self.image_processor = load_policy(self.model_dir)
        self.model.to(self.device)
        self.model.eval()  # no dropout: log-probs must be comparable with the sampler's
        if config.gradient_checkpointing:
            if hasattr(self.model, "activation_checkpointing_enable"):  # transformers >= 5.x
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            # transformers checkpoints only modules in train mode: the decoder layers and the vision blocks (five
            # 1280x720 screenshots keep ~1 GB of activations per vision block of the 3B model otherwise). Neither
            # has dropout (Qwen2.5-VL's attention_dropout is 0, its vision attention has none), so this is exact.
            for layer in [*decoder_layers(self.model), *vision_blocks(self.model)]:
                layer.train()
        self.tied = tied_names(self.model)
        """Names of weights tied to another one (left out of exported weights, as save_pretrained does)."""
        self.module = CompletionLogprobs(self.model, config.logprob_chunk_tokens)
        """The root FSDP2 shards and the forward pass runs: the policy and its log-prob head."""
        self.bf16 = config.dtype == "bfloat16"
        if self.group.sharded:
            shard_policy(self.module, self.model, bf16=self.bf16)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.module.parameters() if p.requires_grad], lr=config.lr, weight_decay=config.weight_decay
        )
        self.steps = 0
        """Optimizer steps taken (restored by :meth:`load_checkpoint`)."""

    @property
    def lr(self) -> float:
        """The optimizer's learning rate now (``learner.lr``, or where ``learner.target_kl`` has moved it; saved
        and restored with the optimizer's state in the checkpoint)."""
        return float(self.optimizer.param_groups[0]["lr"])

    @lr.setter
    def lr(self, value: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = value

    @property
    def vocab_size(self) -> int:
        """Token ids the policy scores (its text config's ``vocab_size``)."""
        config = self.model.config
        return int(getattr(config, "text_config", config).vocab_size)

    @property
    def checkpoint_name(self) -> str:
        """The name of this state's part of a checkpoint folder: ``trainer.pt`` (one rank, one file) or
        ``trainer.dcp`` (several ranks: a torch.distributed.checkpoint folder of shards)."""
        return "trainer.dcp" if self.group.sharded else "trainer.pt"

    # ------------------------------------------------------------------ export

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's whole weights on the CPU, keyed as transformers names them (``model.language_model...``),
        tied weights left out.

        With several ranks this is a collective (every rank must call it): rank 0 receives the full tensors,
        the other ranks an empty dict (torch.distributed.checkpoint.state_dict, ``full_state_dict=True``).
        """
        if not self.group.sharded:
            return {k: v.detach().to("cpu") for k, v in self.model.state_dict().items() if k not in self.tied}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        prefix = "policy."
        named = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in full.items()}
        return {k: v for k, v in named.items() if k not in self.tied}

    def checkpoint_state_dict(self) -> dict[str, torch.Tensor]:
        """:meth:`full_state_dict` under checkpoint names (``model.layers...``, ``visual...``: what save_pretrained
        writes and SGLang's ``load_weights`` matches; arpo_async.model.checkpoint_names), for the weight broadcast
        (learner.train.publisher.DistributedPublisher). A collective like :meth:`full_state_dict`; ranks other than
        0 get an empty dict."""
        full = self.full_state_dict()
        return to_checkpoint_names(self.model, full) if full else {}

    def save_weights(self, out_dir: Path, *, overwrite: bool = False, dtype: str | None = None) -> Path:
        """Write the current weights as a complete Hugging Face folder, atomically (learner.train.weights_export.
        write_folder: ``model.safetensors``, configs, and the processor files of :attr:`model_dir`), loadable by
        SGLang's ``/update_weights_from_disk``, arpo-serve and ``load_policy``.

        Args:
            out_dir: the folder to create.
            overwrite: replace an existing ``out_dir`` (the old folder is moved aside, then deleted).
            dtype: write the floating-point weights in this dtype ("bfloat16", ...; arpo_async.weight_sync.
                DTYPE_NAMES), e.g. the one the inference servers serve (learner.train.publish_dtype); None: as
                trained (float32).

        Returns:
            ``out_dir`` as a Path.

        With several ranks every rank must call it (the full tensors are gathered from the shards); rank 0 writes
        the folder, the others only take part in the gather.

        Raises:
            TrainerError: ``out_dir`` exists and ``overwrite`` is False.
        """
        out_dir = Path(out_dir)
        full = self.full_state_dict() if self.group.sharded or dtype is not None else None
        if not self.group.lead:
            return out_dir
        if out_dir.exists() and not overwrite:
            raise TrainerError(f"weights folder {out_dir} already exists (pass overwrite=True to replace it)")
        if dtype is not None:
            full = cast_floating(full, dtype_from_name(dtype))
        return write_folder(self.model, out_dir, self.model_dir, state_dict=full)

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state plus the step count and config (tensors and plain python values only).
        One rank only (a sharded state saves with :meth:`save_checkpoint`)."""
        return {"schema": _SCHEMA, "steps": self.steps, "config": asdict(self.config),
                "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore model, optimizer and step count from :meth:`state_dict`'s output. The optimizer's
        hyper-parameters come from the checkpoint (as torch restores them); this state's config is kept.

        Raises:
            TrainerError: unknown schema or a state that does not fit this model.
        """
        if state.get("schema") != _SCHEMA:
            raise TrainerError(f"unsupported trainer checkpoint schema {state.get('schema')!r}")
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.steps = int(state["steps"])
        except (KeyError, RuntimeError, ValueError) as error:
            raise TrainerError(f"checkpoint does not fit this model: {type(error).__name__}: {error}") from error

    def save_checkpoint(self, path: Path) -> Path:
        """``torch.save`` :meth:`state_dict` to ``path`` (written to a temporary file, then renamed); returns it.

        With several ranks (every rank calls it with the same ``path``, a folder on storage they share): each rank
        writes its shards of the model and the AdamW state with torch.distributed.checkpoint, and rank 0 adds
        ``trainer.json`` (schema, step count, world size)."""
        path = Path(path)
        if self.group.sharded:
            return self._save_sharded(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            torch.save(self.state_dict(), tmp)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
        return path

    def load_checkpoint(self, path: Path) -> None:
        """Load a checkpoint written by :meth:`save_checkpoint` (``torch.load`` with ``weights_only=True``).

        Raises:
            FileNotFoundError: ``path`` does not exist.
            TrainerError: the checkpoint does not fit this model, or is of the other kind (sharded / one rank).
        """
        path = Path(path)
        if self.group.sharded:
            return self._load_sharded(path)
        sharded = path.with_name("trainer.dcp")
        if path.is_dir() or (not path.exists() and sharded.is_dir()):
            raise TrainerError(f"{path.parent} holds a sharded checkpoint (written by several ranks); resume it "
                               "under torchrun with more than one rank")
        self.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))

    def _sharded_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        return {"model": get_model_state_dict(self.module),
                "optimizer": get_optimizer_state_dict(self.module, self.optimizer)}

    def _save_sharded(self, path: Path) -> Path:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._sharded_state(), checkpoint_id=str(path))
        if self.group.lead:
            info = {"schema": _SCHEMA, "steps": self.steps, "world": self.group.world, "config": asdict(self.config)}
            (path / "trainer.json").write_text(json.dumps(info, indent=1))
        dist.barrier()
        return path

    def _load_sharded(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        if not (path / "trainer.json").is_file():
            raise TrainerError(f"{path} is not a sharded trainer checkpoint (no trainer.json); a checkpoint "
                               "written by one rank (trainer.pt) resumes only on one rank")
        info = json.loads((path / "trainer.json").read_text())
        if info.get("schema") != _SCHEMA:
            raise TrainerError(f"unsupported trainer checkpoint schema {info.get('schema')!r}")
        state = self._sharded_state()
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(self.module, state["model"])
        set_optimizer_state_dict(self.module, self.optimizer, state["optimizer"])
        self.steps = int(info["steps"])


def read_model_weights(path: Path) -> dict[str, torch.Tensor]:
    """The policy's weights in a trainer checkpoint, on the CPU, keyed as transformers names them
    (``model.language_model.layers.0...``, ``lm_head.weight``; tied names included, as ``state_dict`` has them).

    Needs no trainer and no process group: ``trainer.pt`` (one rank) is memory-mapped and only its ``model`` entry
    is read; ``trainer.dcp`` (several ranks) is read with torch.distributed.checkpoint in one process
    (``no_dist=True``), which joins every rank's shards into full tensors and skips the AdamW state.

    Args:
        path: a checkpoint folder's ``trainer.pt`` or ``trainer.dcp`` (:attr:`TrainState.checkpoint_name`).

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
