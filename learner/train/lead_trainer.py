"""Rank 0 leading the other ranks of a sharded run: :class:`LeadTrainer` sends each call to every rank, :func:`follow`
runs them there.

Role: the training engine (learner.train.train_engine.TrainEngine) of a run on N ranks under torchrun
(learner.train.distributed sets the ranks up). Every TrainEngine method of :class:`LeadTrainer` is written out with
its own signature: it builds one command (a small frozen dataclass holding that call's arguments), broadcasts it to
every rank (``broadcast_object_list``: the step's samples travel with it), then runs it on rank 0's own
:class:`~learner.train.trainer.Trainer`. Ranks 1..N-1 receive the same command in :func:`follow` and run it on
theirs; FSDP's collectives keep them in step. A command runs by calling the Trainer method of the same name,
typed, not by looking a name up.

Failure: a rank that dies breaks the collectives. The survivors' next collective fails (gloo reports the closed
connection at once; at the latest after ``learner.dist_timeout_s``), they log which rank and command, and exit
non-zero; torchrun then stops the others and exits non-zero too. Rank 0 sends a no-op command when the trainer has
been idle for a third of the timeout (waiting for rollouts: :meth:`LeadTrainer.ping_if_idle`), so a slow rollout
phase never trips it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from learner.algo.train_sample import TrainSample
from learner.train.distributed import RankGroup, RankGroupError
from learner.train.trainer import Trainer

log = logging.getLogger("arpo.learner.dist")

__all__ = ["LeadTrainer", "follow"]


# ------------------------------------------------------------------ the commands rank 0 sends


@dataclass(frozen=True)
class TrainBatch:
    """learner.train.train_engine.TrainEngine.train_batch on every rank."""

    name: ClassVar[str] = "train_batch"
    samples: Sequence[TrainSample]
    minibatches: int

    def run(self, trainer: Trainer) -> dict[str, float]:
        return trainer.train_batch(self.samples, minibatches=self.minibatches)


@dataclass(frozen=True)
class TrainStep:
    """learner.train.train_engine.TrainEngine.train_step on every rank."""

    name: ClassVar[str] = "train_step"
    samples: Sequence[TrainSample]
    proximal_logprobs: Sequence[Sequence[float]] | None

    def run(self, trainer: Trainer) -> dict[str, float]:
        return trainer.train_step(self.samples, proximal_logprobs=self.proximal_logprobs)


@dataclass(frozen=True)
class ComputeLogprobs:
    """learner.train.train_engine.TrainEngine.compute_logprobs on every rank."""

    name: ClassVar[str] = "compute_logprobs"
    samples: Sequence[TrainSample]

    def run(self, trainer: Trainer) -> list[list[float]]:
        return trainer.compute_logprobs(self.samples)


@dataclass(frozen=True)
class SaveWeights:
    """learner.train.train_engine.TrainEngine.save_weights on every rank (all gather, rank 0 writes)."""

    name: ClassVar[str] = "save_weights"
    out_dir: Path
    overwrite: bool
    dtype: str | None

    def run(self, trainer: Trainer) -> Path:
        return trainer.save_weights(self.out_dir, overwrite=self.overwrite, dtype=self.dtype)


@dataclass(frozen=True)
class FullStateDict:
    """learner.train.train_engine.TrainEngine.full_state_dict on every rank (rank 0 gets the tensors)."""

    name: ClassVar[str] = "full_state_dict"

    def run(self, trainer: Trainer) -> dict[str, torch.Tensor]:
        return trainer.full_state_dict()


@dataclass(frozen=True)
class CheckpointStateDict:
    """learner.train.train_engine.TrainEngine.checkpoint_state_dict on every rank (rank 0 gets the tensors)."""

    name: ClassVar[str] = "checkpoint_state_dict"

    def run(self, trainer: Trainer) -> dict[str, torch.Tensor]:
        return trainer.checkpoint_state_dict()


@dataclass(frozen=True)
class SaveCheckpoint:
    """learner.train.train_engine.TrainEngine.save_checkpoint on every rank (each writes its shards)."""

    name: ClassVar[str] = "save_checkpoint"
    path: Path

    def run(self, trainer: Trainer) -> Path:
        return trainer.save_checkpoint(self.path)


@dataclass(frozen=True)
class LoadCheckpoint:
    """learner.train.train_engine.TrainEngine.load_checkpoint on every rank (each reads its shards)."""

    name: ClassVar[str] = "load_checkpoint"
    path: Path

    def run(self, trainer: Trainer) -> None:
        trainer.load_checkpoint(self.path)


@dataclass(frozen=True)
class Ping:
    """Nothing: keeps the process group's connections from timing out while the trainer idles."""

    name: ClassVar[str] = "ping"

    def run(self, trainer: Trainer) -> None:
        return None


@dataclass(frozen=True)
class Stop:
    """Leave :func:`follow` (after a barrier, so every rank has it before any tears the group down)."""

    name: ClassVar[str] = "stop"

    def run(self, trainer: Trainer) -> None:
        return None


Command = (TrainBatch | TrainStep | ComputeLogprobs | SaveWeights | FullStateDict | CheckpointStateDict
           | SaveCheckpoint | LoadCheckpoint | Ping | Stop)
"""One call rank 0 sends to every rank."""


# ------------------------------------------------------------------ rank 0


class LeadTrainer:
    """Rank 0's training engine: each :class:`~learner.train.train_engine.TrainEngine` call is sent to every rank,
    then run on this rank's ``trainer``. Calls are serialised (a lock), as the collectives of two calls must not
    interleave.

    Args:
        trainer: rank 0's Trainer (sharded: ``trainer.group.sharded``).
        group: this process's rank group (rank 0).
        timeout_s: the collective timeout (``learner.dist_timeout_s``); a ping goes out after a third of it idle.

    Raises (from any call): RankGroupError when another rank is gone (the command and the error are named).
    """

    def __init__(self, trainer: Trainer, group: RankGroup, timeout_s: float) -> None:
        self._trainer = trainer
        self._group = group
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self.keepalive_s = timeout_s / 3

    # ---------------------------------------------------------------- TrainEngine: read on rank 0

    @property
    def steps(self) -> int:
        return self._trainer.steps

    @property
    def model_dir(self) -> Path:
        return self._trainer.model_dir

    @property
    def vocab_size(self) -> int:
        return self._trainer.vocab_size

    @property
    def checkpoint_name(self) -> str:
        return self._trainer.checkpoint_name

    # ---------------------------------------------------------------- TrainEngine: run on every rank

    def train_batch(self, samples: Sequence[TrainSample], *, minibatches: int = 1) -> dict[str, float]:
        return self._everywhere(TrainBatch(samples, minibatches))

    def train_step(self, samples: Sequence[TrainSample], *,
                   proximal_logprobs: Sequence[Sequence[float]] | None = None) -> dict[str, float]:
        return self._everywhere(TrainStep(samples, proximal_logprobs))

    def compute_logprobs(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        return self._everywhere(ComputeLogprobs(samples))

    def save_weights(self, out_dir: Path, *, overwrite: bool = False, dtype: str | None = None) -> Path:
        return self._everywhere(SaveWeights(out_dir, overwrite, dtype))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self._everywhere(FullStateDict())

    def checkpoint_state_dict(self) -> dict[str, torch.Tensor]:
        return self._everywhere(CheckpointStateDict())

    def save_checkpoint(self, path: Path) -> Path:
        return self._everywhere(SaveCheckpoint(path))

    def load_checkpoint(self, path: Path) -> None:
        self._everywhere(LoadCheckpoint(path))

    # ---------------------------------------------------------------- the other ranks

    def ping_if_idle(self) -> None:
        """Send a no-op to every rank when no command went out for ``keepalive_s`` (blocking: call in a thread)."""
        if time.monotonic() - self._last >= self.keepalive_s:
            self._everywhere(Ping())

    def stop(self) -> None:
        """Tell every rank to leave :func:`follow` (best effort: a dead group is only logged)."""
        with self._lock:
            try:
                dist.broadcast_object_list([Stop()], src=0)
                dist.barrier()  # every rank got it before any tears the group down
            except (RuntimeError, dist.DistError) as error:
                log.warning("could not tell the other ranks to stop: %s", error)

    def _everywhere(self, command: Command) -> Any:
        with self._lock:
            try:
                dist.broadcast_object_list([command], src=0)
                result = command.run(self._trainer)
            except (RuntimeError, dist.DistError) as error:
                if isinstance(error, dist.DistError) or "gloo" in str(error).lower() or "nccl" in str(error).lower():
                    raise RankGroupError(f"{command.name}: a rank of the training group failed ({error})") from error
                raise
            self._last = time.monotonic()
            return result


# ------------------------------------------------------------------ ranks 1..N-1


def follow(trainer: Trainer, group: RankGroup) -> int:
    """Ranks 1..N-1: run rank 0's commands on ``trainer`` until it says stop; returns the exit code.

    0 after :class:`Stop`; 1 when a collective fails (rank 0 or another rank died or timed out: logged with the
    command that was running). A command that fails on its input (ValueError, e.g. TrainerInputError) is logged and
    skipped: rank 0 got the same error from the same samples.
    """
    name = "waiting for the first command"
    try:
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            command: Command = box[0]
            name = command.name
            if isinstance(command, Stop):
                dist.barrier()
                log.info("rank %d: rank 0 said stop", group.rank)
                return 0
            try:
                command.run(trainer)
            except ValueError as error:  # bad input: rank 0 got the same error from the same samples
                log.warning("rank %d: %s failed on its input: %s", group.rank, name, error)
    except (RuntimeError, dist.DistError) as error:
        log.error("rank %d: the training group failed during %s (a rank died or timed out): %s",
                  group.rank, name, error)
        return 1
