"""GRPO trainer: owns the policy being trained and its AdamW optimizer; one call = one optimizer step.

Owns the torch model (loaded with :func:`arpo_async.model.inputs.load_policy`), the optimizer and the count of
optimizer steps taken. Everything here is synchronous, blocking torch work: the learner process calls
:meth:`Trainer.train_step` and :meth:`Trainer.save_weights` through ``asyncio.to_thread``, one call at a time
(the trainer is not thread-safe).

Loss (REFERENCE.md section 1; ARPO / EasyR1 ``compute_policy_loss``; DAPO token-level averaging):
``L = sum over samples and their generated tokens of clipped_token_loss / total generated tokens of the batch``,
with ratio = pi_theta / pi_old. With one epoch on sampler data, pi_old is the behaviour policy (the sampler's
log-probs, which the sampler reported with every token). ``train_step`` takes an optional ``proximal_logprobs``
argument so decoupled PPO (AReaL) can pass the pre-update policy's log-probs instead.

Invariants: the loss is computed only on tokens the policy generated (``output_ids``), on exactly the ids the
sampler produced; the policy runs without dropout (eval mode) so its log-probs are comparable to the sampler's;
weight folders are written to a temporary sibling and renamed into place, so a reader never sees half a folder.
"""

from __future__ import annotations

import math
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import torch

from arpo_async.model.inputs import load_policy, token_logprobs
from learner.grpo import clipped_token_loss

__all__ = ["TrainSample", "Trainer", "TrainerConfig", "TrainerConfigError", "TrainerError", "TrainerInputError"]

# Files besides the weights that make a checkpoint folder loadable by transformers, arpo-serve and SGLang:
# tokenizer, chat template and image/video processor configs. Copied from the source model folder when present.
_PROCESSOR_FILES: tuple[str, ...] = (
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

_CHECKPOINT_SCHEMA = 1


class TrainerError(RuntimeError):
    """Base class of the trainer's errors (also raised for file-system conflicts when saving)."""


class TrainerConfigError(TrainerError, ValueError):
    """A TrainerConfig field is out of range."""


class TrainerInputError(TrainerError, ValueError):
    """A batch or sample cannot be trained on (empty, mismatched lengths, non-finite numbers)."""


@dataclass
class TrainSample:
    """One generated reply to train on: the exact tokens the sampler saw and produced, and the rollout's advantage.

    Attributes:
        prompt_ids: the prompt token ids as sent to the sampler (image pad tokens already expanded), length P.
        images: the screenshots the prompt references, encoded image bytes (PNG/JPEG), in prompt order.
        output_ids: the generated token ids, length T >= 1; the loss covers exactly these tokens.
        behaviour_logprobs: the sampler's log-prob of each output token (nats), length T.
        advantage: the rollout's group-relative advantage, broadcast to all T tokens.
    """

    prompt_ids: list[int]
    images: list[bytes]
    output_ids: list[int]
    behaviour_logprobs: list[float]
    advantage: float


@dataclass(frozen=True)
class TrainerConfig:
    """Optimizer and loss settings of the trainer (defaults: ARPO's reference run, REFERENCE.md section 1)."""

    lr: float = 1e-6
    """AdamW learning rate, constant (ARPO: 1e-6 for a 7B model; a tiny random model needs far more)."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay (ARPO: 0.01)."""
    grad_clip: float = 1.0
    """Clip the global gradient L2 norm to this before each step (ARPO: 1.0); 0 disables clipping."""
    eps_low: float = 0.2
    """PPO clip range below 1: ratio floor 1 - eps_low (ARPO: 0.2)."""
    eps_high: float = 0.3
    """PPO clip-higher range above 1: ratio ceiling 1 + eps_high (ARPO: 0.3; DAPO: 0.28)."""
    dual_clip: float = 3.0
    """Dual-clip constant c > 1: a token with A < 0 loses at most -c*A (ARPO: 3.0)."""
    micro_batch: int = 1
    """Samples forwarded before each backward pass. Gradients accumulate, so the step is the same for any value;
    larger holds more activation graphs in memory at once (1 = least memory)."""
    torch_threads: int = 1
    """torch intra-op threads for this process (torch.set_num_threads); leave cores for the desktops."""

    def __post_init__(self) -> None:
        checks = (
            ("lr", self.lr > 0 and math.isfinite(self.lr), "must be a finite number > 0"),
            ("weight_decay", self.weight_decay >= 0, "must be >= 0"),
            ("grad_clip", self.grad_clip >= 0, "must be >= 0 (0 disables clipping)"),
            ("eps_low", 0 <= self.eps_low < 1, "must be in [0, 1)"),
            ("eps_high", self.eps_high >= 0, "must be >= 0"),
            ("dual_clip", self.dual_clip > 1, "must be > 1"),
            ("micro_batch", self.micro_batch >= 1, "must be >= 1"),
            ("torch_threads", self.torch_threads >= 1, "must be >= 1"),
        )
        for name, ok, rule in checks:
            if not ok:
                raise TrainerConfigError(f"TrainerConfig.{name} = {getattr(self, name)!r}: {rule}")


def _check_samples(samples: Sequence[TrainSample], proximal: Sequence[Sequence[float]] | None) -> None:
    if not samples:
        raise TrainerInputError("train_step needs at least one sample")
    if proximal is not None and len(proximal) != len(samples):
        raise TrainerInputError(f"{len(proximal)} proximal log-prob lists for {len(samples)} samples")
    for i, sample in enumerate(samples):
        n = len(sample.output_ids)
        if n == 0:
            raise TrainerInputError(f"sample {i} has no output tokens")
        if not sample.prompt_ids:
            raise TrainerInputError(f"sample {i} has no prompt tokens")
        if len(sample.behaviour_logprobs) != n:
            raise TrainerInputError(
                f"sample {i}: {n} output tokens but {len(sample.behaviour_logprobs)} behaviour log-probs"
            )
        if proximal is not None and len(proximal[i]) != n:
            raise TrainerInputError(f"sample {i}: {n} output tokens but {len(proximal[i])} proximal log-probs")
        if not math.isfinite(sample.advantage):
            raise TrainerInputError(f"sample {i}: advantage {sample.advantage!r} is not finite")
        old = sample.behaviour_logprobs if proximal is None else proximal[i]
        if not all(math.isfinite(x) for x in old):
            raise TrainerInputError(f"sample {i}: old log-probs must be finite")


class Trainer:
    """Policy + AdamW; :meth:`train_step` takes one optimizer step on a batch of TrainSamples.

    Args:
        model_dir: a Hugging Face checkpoint folder (Qwen2-VL / Qwen2.5-VL layout: weights, config, tokenizer,
            chat template, image processor), e.g. from ``create_tiny_model``. Its processor files are copied into
            every folder :meth:`save_weights` writes.
        config: optimizer and loss settings.

    Sets ``torch.set_num_threads(config.torch_threads)`` for the whole process.
    """

    def __init__(self, model_dir: Path, config: TrainerConfig) -> None:
        self.model_dir = Path(model_dir)
        self.config = config
        torch.set_num_threads(config.torch_threads)
        self.model, self.image_processor = load_policy(self.model_dir)
        self.model.eval()  # no dropout: log-probs must be comparable with the sampler's
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=config.lr, weight_decay=config.weight_decay
        )
        self.steps = 0
        """Optimizer steps taken (restored by load_checkpoint)."""

    # ------------------------------------------------------------------ log-probs

    def _logprobs(self, sample: TrainSample) -> torch.Tensor:
        """log pi_theta of the sample's output tokens under the current weights, shape (T,), float32."""
        out = token_logprobs(self.model, self.image_processor, sample.prompt_ids, sample.images, sample.output_ids)
        return out.float()

    @torch.no_grad()
    def compute_logprobs(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """Log-probs of each sample's output tokens under the current weights, without gradient.

        Use: proximal log-probs for decoupled PPO (computed before the update), or checks against the sampler.

        Returns:
            One list of T_i floats (nats) per sample.
        """
        return [self._logprobs(sample).tolist() for sample in samples]

    # ------------------------------------------------------------------ training

    def train_step(
        self, samples: Sequence[TrainSample], *, proximal_logprobs: Sequence[Sequence[float]] | None = None
    ) -> dict[str, float]:
        """One optimizer step on ``samples``: token-level clipped PPO loss, backward, grad-norm clip, AdamW step.

        ``loss = sum_i clipped_token_loss(logp_i, old_i, A_i).loss_sum / sum_i T_i`` (DAPO token-level mean over
        the whole batch), where ``old_i`` is ``proximal_logprobs[i]`` if given, else the sample's behaviour
        log-probs (one epoch on sampler data: ratio = pi_theta / pi_behaviour). Gradients of ``micro_batch``
        samples are accumulated per backward pass; the result does not depend on ``micro_batch``.

        Args:
            samples: the batch, at least one sample, each with T_i >= 1 output tokens.
            proximal_logprobs: optional per-sample old log-probs (same lengths as ``output_ids``).

        Returns:
            ``{"loss", "grad_norm" (before clipping), "clip_frac", "dual_clip_frac", "ratio_mean", "approx_kl"
            (token-weighted over the batch), "tokens", "samples", "seconds", "skipped" (1.0 when the gradient was
            not finite and no step was taken, else 0.0)}``.

        Raises:
            TrainerInputError: an empty batch, an empty sample, mismatched lengths, or non-finite numbers.
            arpo_async.model.inputs.ModelInputError: a sample's image pad tokens do not match its images, or an
                image cannot be decoded.
        """
        _check_samples(samples, proximal_logprobs)
        start = time.perf_counter()
        total_tokens = sum(len(s.output_ids) for s in samples)
        self.model.eval()
        self.optimizer.zero_grad(set_to_none=True)

        loss_total = 0.0
        weighted = {"clip_frac": 0.0, "dual_clip_frac": 0.0, "ratio_mean": 0.0, "approx_kl": 0.0}
        pending: torch.Tensor | None = None
        for i, sample in enumerate(samples):
            logprobs = self._logprobs(sample)
            old_values = sample.behaviour_logprobs if proximal_logprobs is None else proximal_logprobs[i]
            old = torch.tensor(old_values, dtype=logprobs.dtype)
            advantages = torch.full_like(old, float(sample.advantage))
            loss_sum, stats = clipped_token_loss(
                logprobs,
                old,
                advantages,
                eps_low=self.config.eps_low,
                eps_high=self.config.eps_high,
                dual_clip=self.config.dual_clip,
            )
            scaled = loss_sum / total_tokens
            pending = scaled if pending is None else pending + scaled
            loss_total += float(scaled.detach())
            for key in weighted:
                weighted[key] += stats[key] * stats["tokens"]
            if (i + 1) % self.config.micro_batch == 0 or i + 1 == len(samples):
                pending.backward()
                pending = None

        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        skipped = not math.isfinite(grad_norm)
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            self.steps += 1
        self.optimizer.zero_grad(set_to_none=True)

        result = {"loss": loss_total, "grad_norm": grad_norm}
        result.update({key: value / total_tokens for key, value in weighted.items()})
        result.update(
            tokens=float(total_tokens),
            samples=float(len(samples)),
            seconds=time.perf_counter() - start,
            skipped=1.0 if skipped else 0.0,
        )
        return result

    # ------------------------------------------------------------------ weights for inference servers

    def save_weights(self, out_dir: Path, *, overwrite: bool = False) -> Path:
        """Write the current weights as a complete Hugging Face checkpoint folder, atomically.

        The folder holds ``config.json``, ``generation_config.json``, ``model.safetensors`` (``save_pretrained``,
        safetensors) and the tokenizer, chat-template and processor files copied from the source model folder,
        so SGLang's ``/update_weights_from_disk``, ``arpo-serve`` and ``load_policy`` can load it. It is written
        to a temporary sibling folder and renamed to ``out_dir``.

        Args:
            out_dir: the folder to create.
            overwrite: replace an existing ``out_dir`` (the old folder is moved aside, then deleted).

        Returns:
            ``out_dir`` as a Path.

        Raises:
            TrainerError: ``out_dir`` exists and ``overwrite`` is False.
        """
        out_dir = Path(out_dir)
        if out_dir.exists() and not overwrite:
            raise TrainerError(f"weights folder {out_dir} already exists (pass overwrite=True to replace it)")
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            self.model.save_pretrained(tmp, safe_serialization=True)
            for name in _PROCESSOR_FILES:
                source = self.model_dir / name
                if source.is_file():
                    shutil.copy2(source, tmp / name)
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

    # ------------------------------------------------------------------ checkpoints (model + optimizer)

    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state plus the step count and config (tensors and plain python values only)."""
        return {
            "schema": _CHECKPOINT_SCHEMA,
            "steps": self.steps,
            "config": asdict(self.config),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore model, optimizer and step count from :meth:`state_dict`'s output.

        The optimizer's hyper-parameters come from the checkpoint (as torch restores them); this trainer's
        config is kept for the loss.

        Raises:
            TrainerError: unknown schema or a state that does not fit this model.
        """
        if state.get("schema") != _CHECKPOINT_SCHEMA:
            raise TrainerError(f"unsupported trainer checkpoint schema {state.get('schema')!r}")
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.steps = int(state["steps"])
        except (KeyError, RuntimeError, ValueError) as error:
            raise TrainerError(f"checkpoint does not fit this model: {type(error).__name__}: {error}") from error

    def save_checkpoint(self, path: Path) -> Path:
        """``torch.save`` :meth:`state_dict` to ``path`` (written to a temporary file, then renamed)."""
        path = Path(path)
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
            TrainerError: the checkpoint does not fit this model.
        """
        state = torch.load(Path(path), map_location="cpu", weights_only=True)
        self.load_state_dict(state)

