"""The training-engine seam: what the learner asks of the policy it trains, in our terms.

Role: the training loop (learner.train.loop), the checkpointer (learner.train.checkpoint) and the weight publishers
(learner.train.publisher, learner.train.weight_check) drive training only through :class:`TrainEngine`, as they
reach inference servers only through arpo_async.engine.InferenceEngine (the inference side of the same seam;
AReaL keeps the two side by side too: ``TrainEngine`` and ``InferenceEngine`` in ``areal/api/engine_api.py``,
inclusionAI/AReaL at 0782aa8d). This one lives in learner/ because its samples (learner.algo.train_sample) do.

Implementations, each declaring every method itself (no forwarding by name):

- learner.train.trainer.Trainer: one rank (or one rank's share of a sharded step, on ranks 1..N-1);
- learner.train.lead_trainer.LeadTrainer: rank 0 of N under torchrun, sending each call to every rank, then
  running its own share.

A new training backend (another sharding, another framework) is one new class with these methods, built in
learner.main; nothing else in learner/ changes.

Calls are synchronous and blocking (torch work): the learner makes them from a thread (``asyncio.to_thread``), one
at a time. With several ranks every method that touches the weights is a collective; a rank that is gone makes the
call raise learner.train.distributed.RankGroupError (the call named).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from learner.algo.train_sample import TrainSample

__all__ = ["TrainEngine"]


@runtime_checkable
class TrainEngine(Protocol):
    """The policy being trained, as the learner drives it: train on samples, score them, export and checkpoint."""

    @property
    def steps(self) -> int:
        """Optimizer steps taken (restored by :meth:`load_checkpoint`); counts across restarts."""
        ...

    @property
    def model_dir(self) -> Path:
        """The model folder training started from; its processor files and config go into every weights folder,
        and its ``config.json`` resolves a server's dtype "auto" (learner.train.weight_check.served_dtype)."""
        ...

    @property
    def vocab_size(self) -> int:
        """Token ids the policy scores (its text config's ``vocab_size``): the bound on every sample's token ids."""
        ...

    @property
    def checkpoint_name(self) -> str:
        """The name of the trainer's part in a checkpoint folder: ``trainer.pt`` (one rank) or ``trainer.dcp`` (a
        torch.distributed.checkpoint folder of every rank's shards)."""
        ...

    def train_batch(self, samples: Sequence[TrainSample], *, minibatches: int = 1) -> dict[str, float]:
        """Train on one rollout batch with ``minibatches`` optimizer steps, all clipped against the log-probs the
        policy had before the first (ARPO: 2 per batch); with ``learner.target_kl`` / ``learner.max_kl`` the KL
        control (learner.algo.kl_schedule) sets the next learning rate and bounds the update kept.

        Args:
            samples: the batch, at least ``minibatches`` usable samples (every rank: the same).
            minibatches: optimizer steps, 1..len(samples); samples split in order into that many chunks.
        Returns:
            The step's statistics (learner.train.trainer.Trainer.train_batch lists them): ``loss``, ``grad_norm``,
            ``tokens``, ``samples``, ``optimizer_steps``, ``lr``, ... (floats; nats for losses and KLs).
        Raises:
            learner.train.trainer_errors.TrainerInputError: an empty batch, no usable sample, or ``minibatches``
                out of range.
            learner.train.trainer_errors.TrainerConfigError: a sample longer than
                ``learner.max_tokens_per_microbatch``.
        """
        ...

    def train_step(self, samples: Sequence[TrainSample], *,
                   proximal_logprobs: Sequence[Sequence[float]] | None = None) -> dict[str, float]:
        """One optimizer step on ``samples`` (DAPO token-level mean of the corrected clipped loss, AdamW).

        Args:
            samples: at least one sample (every rank: the same).
            proximal_logprobs: per sample, the pre-update log-probs of its output tokens (nats, one per output
                token); None: this step's own forward pass gives them.
        Returns:
            The step's statistics, as :meth:`train_batch` without ``optimizer_steps`` and ``lr``.
        Raises:
            As :meth:`train_batch`.
        """
        ...

    def compute_logprobs(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """Log-probs (nats) of each sample's output tokens under the current weights, without gradient: one list
        of len(output_ids) floats per sample, in order. Raises TrainerConfigError as :meth:`train_batch`."""
        ...

    def save_weights(self, out_dir: Path, *, overwrite: bool = False, dtype: str | None = None) -> Path:
        """Write the current weights as a complete Hugging Face folder at ``out_dir``, atomically, in ``dtype``
        ("bfloat16", ...; None: float32 as trained); returns ``out_dir``. Raises TrainerError when ``out_dir``
        exists and ``overwrite`` is False."""
        ...

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's whole weights on the CPU under transformers' names, tied weights left out (float32)."""
        ...

    def checkpoint_state_dict(self) -> dict[str, torch.Tensor]:
        """:meth:`full_state_dict` under checkpoint names (what save_pretrained writes and SGLang's
        ``load_weights`` matches): the tensors the weight broadcast sends."""
        ...

    def save_checkpoint(self, path: Path) -> Path:
        """Write the trainer's part of a checkpoint (weights, AdamW state, step count) at ``path`` (a folder's
        :attr:`checkpoint_name`), atomically on one rank; returns ``path``."""
        ...

    def load_checkpoint(self, path: Path) -> None:
        """Restore weights, AdamW state and :attr:`steps` from :meth:`save_checkpoint`'s ``path``.

        Raises:
            FileNotFoundError: ``path`` does not exist.
            learner.train.trainer_errors.TrainerError: it does not fit this model, or is of the other kind (a
                sharded checkpoint on one rank, a one-rank checkpoint on several).
        """
        ...
