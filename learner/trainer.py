"""GRPO trainer: owns the policy being trained and its AdamW optimizer; one call = one optimizer step.

Owns the torch model (loaded with :func:`arpo_async.model.inputs.load_policy`), the optimizer and the count of
optimizer steps taken. Everything here is synchronous, blocking torch work: the learner process calls
:meth:`Trainer.train_step` and :meth:`Trainer.save_weights` through ``asyncio.to_thread``, one call at a time
(the trainer is not thread-safe).

Loss (REFERENCE.md sections 1 and 5; ARPO / EasyR1 ``compute_policy_loss``; DAPO token-level averaging):
``L = sum over samples and their generated tokens of w * l_ppo(pi_theta / pi_old, A) / total generated tokens``,
with the off-policy correction chosen by ``TrainerConfig.correction`` (:func:`learner.grpo.corrected_token_loss`):
"arpo" (pi_old = pi_prox, w = 1), "decoupled" (AReaL: pi_old = pi_prox, w = pi_prox / pi_behav, tokens above the
cap filtered out), "tis" (slime: pi_old = pi_prox, w = min(pi_prox / pi_behav, cap)) or "behaviour" (pi_old =
pi_behav, w = 1). pi_behav is the sampler's log-prob reported with every token; pi_prox is the policy before the
optimizer step. ``train_step`` takes pi_prox from the same forward pass that carries the gradient (detached):
the weights have not changed yet, so these are exactly the pre-update log-probs and cost no extra forward pass.
``train_batch`` splits a batch into several optimizer steps with pi_prox computed once, before the first
(ARPO: 2 optimizer steps per rollout batch), which is where the clip against pi_prox acts.

Invariants: the loss is computed only on tokens the policy generated (``output_ids``), on exactly the ids the
sampler produced; the policy runs without dropout (eval mode) so its log-probs are comparable to the sampler's;
weight folders are written to a temporary sibling and renamed into place, so a reader never sees half a folder.
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from arpo_async.model.inputs import load_policy, token_logprobs
from learner.grpo import CORRECTION_MODES, corrected_token_loss

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
        replayed: True when the step belongs to a trajectory the replay buffer injected (its behaviour
            log-probs are those recorded when it was sampled); only used to report its correction separately.
        loss_mask: length T, True for the tokens the loss covers; False for tokens the action grammar forced
            (`learner.forced_tokens`). None = every token. A sample with no True token adds nothing to the loss.
    """

    prompt_ids: list[int]
    images: list[bytes]
    output_ids: list[int]
    behaviour_logprobs: list[float]
    advantage: float
    replayed: bool = False
    loss_mask: list[bool] | None = None

    @property
    def loss_tokens(self) -> int:
        """Tokens the loss covers (T, or the True entries of ``loss_mask``)."""
        return len(self.output_ids) if self.loss_mask is None else sum(map(bool, self.loss_mask))


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
    correction: str = "decoupled"
    """Off-policy correction: "arpo" (none; ratio against the recomputed pre-update policy), "decoupled" (AReaL),
    "tis" (slime truncated IS) or "behaviour" (plain PPO ratio against the sampler's log-probs)."""
    decoupled_cap: float = 5.0
    """"decoupled": tokens with pi_prox / pi_behav above this are filtered out (AReaL example configs: 5.0)."""
    tis_cap: float = 2.0
    """"tis": the weight pi_prox / pi_behav is truncated at this (slime --tis-clip default: 2.0)."""

    @property
    def correction_cap(self) -> float:
        """The cap of the selected correction mode (unused by "arpo" and "behaviour")."""
        return self.tis_cap if self.correction == "tis" else self.decoupled_cap

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
            ("correction", self.correction in CORRECTION_MODES, f"must be one of {CORRECTION_MODES}"),
            ("decoupled_cap", self.decoupled_cap > 1 and math.isfinite(self.decoupled_cap),
             "must be a finite number > 1"),
            ("tis_cap", self.tis_cap > 0 and math.isfinite(self.tis_cap), "must be a finite number > 0"),
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
        if sample.loss_mask is not None and len(sample.loss_mask) != n:
            raise TrainerInputError(f"sample {i}: {n} output tokens but a loss mask of {len(sample.loss_mask)}")
        if proximal is not None and len(proximal[i]) != n:
            raise TrainerInputError(f"sample {i}: {n} output tokens but {len(proximal[i])} proximal log-probs")
        if not math.isfinite(sample.advantage):
            raise TrainerInputError(f"sample {i}: advantage {sample.advantage!r} is not finite")
        if not all(math.isfinite(x) for x in sample.behaviour_logprobs):
            raise TrainerInputError(f"sample {i}: behaviour log-probs must be finite")
        if proximal is not None and not all(math.isfinite(x) for x in proximal[i]):
            raise TrainerInputError(f"sample {i}: proximal log-probs must be finite")


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
        """One optimizer step on ``samples``: corrected clipped token loss, backward, grad-norm clip, AdamW step.

        ``loss = sum_i corrected_token_loss(logp_i, prox_i, behav_i, A_i).loss_sum / sum_i T_i`` (DAPO token-level
        mean over the whole batch; the correction mode is ``config.correction``). Where a sample has a
        ``loss_mask``, only its True tokens enter the sum and T_i counts only them. ``prox_i`` is
        ``proximal_logprobs[i]`` if given (pass them when one batch is split over several steps, see
        :meth:`train_batch`), else the detached log-probs of this step's own forward pass, which are the
        pre-update policy's. ``behav_i`` is the sample's ``behaviour_logprobs``. Gradients of ``micro_batch``
        samples are accumulated per backward pass; the result does not depend on ``micro_batch``.

        Args:
            samples: the batch, at least one sample, each with T_i >= 1 output tokens.
            proximal_logprobs: optional per-sample pre-update log-probs (same lengths as ``output_ids``).

        Returns:
            ``{"loss", "grad_norm" (before clipping), "clip_frac", "dual_clip_frac", "ratio_mean", "approx_kl",
            "is_weight_mean", "is_capped_frac", "behaviour_kl" (token-weighted over the batch), "is_weight_max",
            "replayed_tokens", "replayed_is_weight_mean" (token-weighted over replayed samples; 0 when none),
            "tokens", "samples", "seconds", "skipped" (1.0 when the gradient was not finite and no step was
            taken, else 0.0)}``.

        Raises:
            TrainerInputError: an empty batch, an empty sample, mismatched lengths, or non-finite numbers.
            arpo_async.model.inputs.ModelInputError: a sample's image pad tokens do not match its images, or an
                image cannot be decoded.
        """
        _check_samples(samples, proximal_logprobs)
        start = time.perf_counter()
        loss_tokens = sum(s.loss_tokens for s in samples)
        total_tokens = max(1, loss_tokens)
        self.model.eval()
        self.optimizer.zero_grad(set_to_none=True)

        loss_total = 0.0
        weighted = dict.fromkeys(
            ("clip_frac", "dual_clip_frac", "ratio_mean", "approx_kl", "is_weight_mean", "is_capped_frac",
             "behaviour_kl"), 0.0)
        weight_max = 0.0
        replayed_tokens = 0.0
        replayed_weight = 0.0
        pending: torch.Tensor | None = None
        for i, sample in enumerate(samples):
            logprobs = self._logprobs(sample)
            if proximal_logprobs is None:
                proximal = logprobs.detach()
            else:
                proximal = torch.tensor(proximal_logprobs[i], dtype=logprobs.dtype)
            behaviour = torch.tensor(sample.behaviour_logprobs, dtype=logprobs.dtype)
            if sample.loss_mask is not None:
                keep = torch.tensor(sample.loss_mask, dtype=torch.bool)
                logprobs, proximal, behaviour = logprobs[keep], proximal[keep], behaviour[keep]
            advantages = torch.full_like(behaviour, float(sample.advantage))
            loss_sum, stats = corrected_token_loss(
                logprobs,
                proximal,
                behaviour,
                advantages,
                mode=self.config.correction,
                eps_low=self.config.eps_low,
                eps_high=self.config.eps_high,
                dual_clip=self.config.dual_clip,
                cap=self.config.correction_cap,
            )
            scaled = loss_sum / total_tokens
            pending = scaled if pending is None else pending + scaled
            loss_total += float(scaled.detach())
            for key in weighted:
                weighted[key] += stats[key] * stats["tokens"]
            weight_max = max(weight_max, stats["is_weight_max"])
            if sample.replayed:
                replayed_tokens += stats["tokens"]
                replayed_weight += stats["is_weight_mean"] * stats["tokens"]
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
            is_weight_max=weight_max,
            replayed_tokens=replayed_tokens,
            replayed_is_weight_mean=replayed_weight / replayed_tokens if replayed_tokens else 0.0,
            tokens=float(loss_tokens),
            samples=float(len(samples)),
            seconds=time.perf_counter() - start,
            skipped=1.0 if skipped else 0.0,
        )
        return result

    def train_batch(self, samples: Sequence[TrainSample], *, minibatches: int = 1) -> dict[str, float]:
        """Train on one batch with ``minibatches`` optimizer steps, clipping every step against the same pi_prox.

        With ``minibatches == 1`` this is :meth:`train_step` (pi_prox from its own forward pass). Otherwise the
        pre-update log-probs of the whole batch are computed first, without gradient (:meth:`compute_logprobs`,
        one extra forward pass per sample), and the samples are split in order into ``minibatches`` contiguous
        chunks, chunk j holding samples ``[j*n//m, (j+1)*n//m)``, one optimizer step each (ARPO: 2 optimizer steps per rollout batch,
        old log-probs recomputed once before them).

        Returns:
            The stats of :meth:`train_step`, token-weighted over the steps for means and fractions; ``loss`` the
            token-weighted mean loss; ``grad_norm`` and ``is_weight_max`` the largest; ``tokens``, ``samples``,
            ``seconds``, ``replayed_tokens``, ``skipped`` summed; plus ``optimizer_steps``.

        Raises:
            TrainerInputError: as :meth:`train_step`, or ``minibatches`` < 1 or more than the samples.
        """
        if minibatches < 1 or minibatches > max(1, len(samples)):
            raise TrainerInputError(f"minibatches must be in [1, {len(samples)}], got {minibatches}")
        if minibatches == 1:
            return dict(self.train_step(samples), optimizer_steps=1.0)
        _check_samples(samples, None)
        start = time.perf_counter()
        proximal = self.compute_logprobs(samples)
        bounds = [k * len(samples) // minibatches for k in range(minibatches + 1)]
        parts = [self.train_step(samples[a:b], proximal_logprobs=proximal[a:b])
                 for a, b in itertools.pairwise(bounds)]
        tokens = sum(p["tokens"] for p in parts)
        replayed = sum(p["replayed_tokens"] for p in parts)
        result = {key: sum(p[key] * p["tokens"] for p in parts) / max(tokens, 1.0)
                  for key in ("loss", "clip_frac", "dual_clip_frac", "ratio_mean", "approx_kl", "is_weight_mean",
                              "is_capped_frac", "behaviour_kl")}
        result.update(
            grad_norm=max(p["grad_norm"] for p in parts),
            is_weight_max=max(p["is_weight_max"] for p in parts),
            replayed_tokens=replayed,
            replayed_is_weight_mean=(sum(p["replayed_is_weight_mean"] * p["replayed_tokens"] for p in parts)
                                     / replayed if replayed else 0.0),
            tokens=tokens,
            samples=float(len(samples)),
            seconds=time.perf_counter() - start,
            skipped=sum(p["skipped"] for p in parts),
            optimizer_steps=float(minibatches),
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

