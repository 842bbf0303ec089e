"""GRPO trainer: the optimizer step on the trainer's state; one call = one optimizer step.

Owns the loss, the micro-batches and the step; the policy, its AdamW optimizer and the count of optimizer steps are
the state it extends (learner.train.train_state.TrainState, which also reads and writes them). Everything here is
synchronous, blocking torch work: the learner process calls :meth:`Trainer.train_step` and
:meth:`Trainer.save_weights` through ``asyncio.to_thread``, one call at a time (the trainer is not thread-safe).

Loss (ARPO, arXiv 2505.16282; AReaL's decoupled PPO, arXiv 2505.24298; ARPO / EasyR1 ``compute_policy_loss``;
DAPO token-level averaging, arXiv 2503.14476):
``L = sum over samples and their generated tokens of w * l_ppo(pi_theta / pi_old, A) / total generated tokens``,
with the off-policy correction chosen by ``learner.correction`` (:func:`learner.algo.grpo.corrected_token_loss`):
"arpo" (pi_old = pi_prox, w = 1), "decoupled" (AReaL: pi_old = pi_prox, w = pi_prox / pi_behav, tokens above the
cap filtered out), "tis" (slime: pi_old = pi_prox, w = min(pi_prox / pi_behav, cap)) or "behaviour" (pi_old =
pi_behav, w = 1). pi_behav is the sampler's log-prob reported with every token; pi_prox is the policy before the
optimizer step. ``train_step`` takes pi_prox from the same forward pass that carries the gradient (detached):
the weights have not changed yet, so these are exactly the pre-update log-probs and cost no extra forward pass.
``train_batch`` splits a batch into several optimizer steps with pi_prox computed once, before the first
(ARPO: 2 optimizer steps per rollout batch), which is where the clip against pi_prox acts.

Demonstrations (arpo_async.demos: a success another policy produced, injected by the success replay) have no
pi_behav of ours. Their tokens take pi_behav = pi_prox, the policy's own log-probs before the update: the
correction weight is then exactly 1 in every mode (never the huge weight pi_prox / pi_behav of a zero log-prob),
and the ratio pi_theta / pi_prox is clipped like any other token's: a demonstration token stops pushing once its
probability has risen by the clip range within a batch's optimizer steps, however unlikely it was. LUFFY mixes
off-policy traces into GRPO groups the same way (Yan et al., "Learning to Reason under Off-Policy Guidance", arXiv
2504.14945: the behaviour probability of an off-policy token, unknown, is set to 1), with a policy-shaping function
and no clip where we keep the clip; ARPO's own replay keeps the log-probs recorded when the success was sampled.

Invariants: the loss is computed only on tokens the policy generated (``output_ids``), on exactly the ids the
sampler produced; the policy runs without dropout (eval mode) so its log-probs are comparable to the sampler's.

The Trainer and the lead of several ranks (learner.train.lead_trainer.LeadTrainer) are the two
implementations of the training-engine seam (learner.train.train_engine.TrainEngine). The error types
(learner.train.trainer_errors) and the sample type (learner.algo.train_sample) are re-exported here.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from arpo_async.config import LearnerConfig
from learner.algo.grpo import corrected_token_loss
from learner.algo.kl_schedule import UpdateControl
from learner.algo.train_sample import TrainSample, sample_problem
from learner.train.distributed import RankGroup
from learner.train.microbatch import MicroBatchBudgetError, step_plan
from learner.train.policy_forward import PixelCache, check_pad_id, collate, image_pad_problem
from learner.train.train_state import TrainState
from learner.train.trainer_errors import TrainerConfigError, TrainerError, TrainerInputError

log = logging.getLogger("arpo.learner.trainer")

__all__ = ["TrainSample", "Trainer", "TrainerConfigError", "TrainerError", "TrainerInputError"]


def resolve_device(name: str) -> torch.device:
    """``learner.device`` -> a torch device ("auto": cuda when available, else cpu).

    Raises:
        TrainerConfigError: "cuda" on a machine where torch sees no CUDA device (names learner.device).
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainerConfigError("learner.device = \"cuda\" but torch sees no CUDA device on this machine "
                                 f"(torch {torch.__version__}); use \"cpu\" or \"auto\"")
    return torch.device(name)


def _check_samples(samples: Sequence[TrainSample], proximal: Sequence[Sequence[float]] | None) -> None:
    if not samples:
        raise TrainerInputError("train_step needs at least one sample")
    if proximal is not None and len(proximal) != len(samples):
        raise TrainerInputError(f"{len(proximal)} proximal log-prob lists for {len(samples)} samples")


_SUMMED_STATS = ("clip_frac", "dual_clip_frac", "ratio_mean", "approx_kl", "is_weight_mean", "is_capped_frac",
                 "behaviour_kl", "entropy")


class Trainer(TrainState):
    """The trainer's state (policy, AdamW, step count: :class:`~learner.train.train_state.TrainState`) and the
    GRPO step on it: :meth:`train_step` takes one optimizer step on a batch of TrainSamples. Implements
    learner.train.train_engine.TrainEngine on one rank, and each rank's share of it on several.

    Args:
        model_dir: a Hugging Face checkpoint folder (Qwen2-VL / Qwen2.5-VL layout: weights, config, tokenizer,
            chat template, image processor), e.g. from ``create_tiny_model``. Its processor files are copied into
            every folder :meth:`save_weights` writes.
        config: the run's learner section; the trainer reads its optimizer, loss and hardware keys (lr,
            weight_decay, grad_clip, eps_low/eps_high, dual_clip, correction and its caps, device, dtype,
            torch_threads, gradient_checkpointing, max_tokens_per_microbatch, logprob_chunk_tokens).
        group: this process's rank in a sharded run (learner.train.distributed); None = one rank. With several ranks
            the policy is sharded with FSDP2, every rank must make the same calls with the same samples (rank 0
            drives the others through ``learner.train.lead_trainer.LeadTrainer``), and each computes its share.

    Sets ``torch.set_num_threads(config.torch_threads)`` for the whole process. The weights stay float32 (the
    master copy the optimizer updates); ``dtype = "bfloat16"`` computes in bf16 (autocast on one rank,
    FSDP2's mixed precision on several).

    Raises:
        TrainerConfigError: ``device = "cuda"`` without CUDA.
        arpo_async.model.inputs.ModelInputError: the folder cannot be loaded.
    """

    def __init__(self, model_dir: Path, config: LearnerConfig, group: RankGroup | None = None) -> None:
        super().__init__(model_dir, config, group or RankGroup(device=resolve_device(config.device)))
        self.pad_id = check_pad_id(self.model)
        self.pixels = PixelCache(self.image_processor)

    # ------------------------------------------------------------------ log-probs

    def _autocast(self):
        if self.bf16 and not self.group.sharded:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _forward(self, samples: Sequence[TrainSample]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """fp32 log-probs of each sample's output tokens under the current weights and the policy's (detached)
        entropy at each of them (learner.train.policy_forward.CompletionLogprobs), one [T_i] tensor each."""
        batch = collate(self.model, samples, self.pixels, self.pad_id).to(self.device)
        with self._autocast():
            flat, entropy = self.module(batch, with_entropy=True)
        return list(flat.split(batch.counts)), list(entropy.split(batch.counts))

    def _plan(self, samples: Sequence[TrainSample]) -> tuple[list[list[int]], int]:
        """This rank's micro-batches (index lists) and the passes every rank runs (learner.train.microbatch)."""
        lengths = [len(s.prompt_ids) + len(s.output_ids) for s in samples]
        try:
            plans, passes = step_plan(lengths, self.group.world, self.config.max_tokens_per_microbatch)
        except MicroBatchBudgetError as error:  # the setting, not the sample, is wrong: stop with the key named
            raise TrainerConfigError(str(error)) from error
        return plans[self.group.rank], passes

    def usable(self, samples: Sequence[TrainSample], proximal: Sequence[Sequence[float]] | None = None
               ) -> tuple[list[TrainSample], list[Sequence[float]] | None, list[str]]:
        """Split off the samples that cannot be trained on: malformed ones (:func:`sample_problem`) and ones whose
        screenshots do not decode or do not match their image pad tokens. (A sample longer than
        ``max_tokens_per_microbatch`` is not dropped: the setting is wrong, and the step raises TrainerConfigError.)
        Returns (kept samples, their proximal log-probs, one reason per dropped sample)."""
        kept, kept_prox, dropped = [], [] if proximal is not None else None, []
        for i, sample in enumerate(samples):
            problem = sample_problem(sample, None if proximal is None else proximal[i])
            if problem is None:
                problem = image_pad_problem(self.model, sample, self.pixels)
            if problem is not None:
                dropped.append(f"sample {i}: {problem}")
                continue
            kept.append(sample)
            if kept_prox is not None:
                kept_prox.append(proximal[i])
        if dropped:
            log.warning("dropped %d of %d samples the trainer cannot use: %s", len(dropped), len(samples),
                        "; ".join(dropped[:5]))
        return kept, kept_prox, dropped

    @staticmethod
    def _pass(mine: list[list[int]], k: int) -> tuple[list[int], bool]:
        """Pass k of this rank: (its samples, whether it counts). A rank with fewer micro-batches than the
        others repeats its last one (or sample 0 when it has none) with weight 0, to join the collectives."""
        if k < len(mine):
            return mine[k], True
        return (mine[-1] if mine else [0]), False

    @torch.no_grad()
    def compute_logprobs(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """Log-probs of each sample's output tokens under the current weights, without gradient.

        Use: proximal log-probs for decoupled PPO (computed before the update), or checks against the sampler.
        With several ranks each computes its share and the results are exchanged (all ranks get all).

        Returns:
            One list of T_i floats (nats) per sample.
        Raises:
            TrainerConfigError: a sample longer than ``max_tokens_per_microbatch``.
        """
        mine, passes = self._plan(samples)
        found: dict[int, list[float]] = {}
        for k in range(passes):
            idx, real = self._pass(mine, k)
            values, _ = self._forward([samples[i] for i in idx])
            if real:
                found.update((i, v.tolist()) for i, v in zip(idx, values))
        if self.group.sharded:
            gathered: list[dict[int, list[float]] | None] = [None] * self.group.world
            dist.all_gather_object(gathered, found)
            for part in gathered:
                found.update(part or {})
        return [found[i] for i in range(len(samples))]

    # ------------------------------------------------------------------ training

    def _microbatch_loss(self, samples: Sequence[TrainSample], logprobs: Sequence[torch.Tensor],
                         entropy: Sequence[torch.Tensor], proximal: Sequence[Sequence[float]] | None):
        """(loss_sum, stats, replayed_stats) of a micro-batch's kept tokens, in one vectorised call of
        learner.algo.grpo.corrected_token_loss, ``stats`` with the kept tokens' mean ``entropy`` added;
        ``replayed_stats`` covers the replayed samples' tokens (None if none)."""
        lp = torch.cat(list(logprobs))
        as_tensor = lambda v, dtype=lp.dtype: torch.as_tensor(v).to(lp.device, dtype)  # noqa: E731
        counts = [len(s.output_ids) for s in samples]
        per_token = lambda values: np.repeat(np.asarray(values), counts)  # noqa: E731 - one value per sample
        prox = lp.detach() if proximal is None else as_tensor(np.concatenate([np.asarray(p, np.float64)
                                                                              for p in proximal]))
        behaviour = as_tensor(np.concatenate([s.behaviour_logprobs for s in samples]))
        demo = as_tensor(per_token([s.demonstration for s in samples]), torch.bool)
        if bool(demo.any()):  # no behaviour log-probs of ours: the pre-update policy's (weight 1, module docstring)
            behaviour = torch.where(demo, prox, behaviour)
        advantages = as_tensor(per_token([float(s.advantage) for s in samples]))
        keep = as_tensor(np.concatenate([np.ones(n, bool) if s.loss_mask is None else np.asarray(s.loss_mask, bool)
                                         for s, n in zip(samples, counts)]), torch.bool)
        replayed = as_tensor(per_token([s.replayed for s in samples]), torch.bool) & keep
        kwargs = dict(mode=self.config.correction, eps_low=self.config.eps_low, eps_high=self.config.eps_high,
                      dual_clip=self.config.dual_clip, cap=self.config.correction_cap)
        loss_sum, stats = corrected_token_loss(lp[keep], prox[keep], behaviour[keep], advantages[keep], **kwargs)
        kept_entropy = torch.cat(list(entropy))[keep]
        stats["entropy"] = float(kept_entropy.mean()) if kept_entropy.numel() else 0.0
        replayed_stats = None
        if bool(replayed.any()):
            _, replayed_stats = corrected_token_loss(lp.detach()[replayed], prox[replayed], behaviour[replayed],
                                                     advantages[replayed], **kwargs)
        return loss_sum, stats, replayed_stats

    def compute_gradients(
        self, samples: Sequence[TrainSample], *, proximal_logprobs: Sequence[Sequence[float]] | None = None
    ) -> tuple[dict[str, float], float, int]:
        """The gradient of :meth:`train_step`'s loss, accumulated into the parameters' ``.grad`` (no step).

        Zeroes the gradients, then runs this rank's micro-batches (forward, loss / the step's token count,
        backward). Arguments and errors as :meth:`train_step`.

        Returns:
            ``(sums, weight_max, passes)``: the loss and the token-weighted stats summed over all ranks'
            samples, the largest importance weight, and the forward/backward passes each rank ran.
        """
        _check_samples(samples, proximal_logprobs)
        mine, passes = self._plan(samples)
        loss_tokens = sum(s.loss_tokens for s in samples)
        total_tokens = max(1, loss_tokens)
        self.optimizer.zero_grad(set_to_none=True)

        # loss, the token-weighted stats, replayed tokens and their weight: summed over this rank's samples
        sums = dict.fromkeys(("loss", *_SUMMED_STATS, "replayed_tokens", "replayed_weight"), 0.0)
        weight_max = 0.0
        for k in range(passes):
            idx, real = self._pass(mine, k)
            if self.group.sharded:  # reduce-scatter the gradients once, after the last pass
                self.module.set_requires_gradient_sync(k == passes - 1)
            chosen = [samples[i] for i in idx]
            loss_sum, stats, replayed = self._microbatch_loss(
                chosen, *self._forward(chosen),
                None if proximal_logprobs is None else [proximal_logprobs[i] for i in idx])
            # FSDP2 averages gradients over ranks: x world makes it the sum (learner.train.distributed.shard_policy)
            (loss_sum * (self.group.world / total_tokens if real else 0.0)).backward()
            if not real:
                continue
            sums["loss"] += float(loss_sum.detach()) / total_tokens
            for key in _SUMMED_STATS:
                sums[key] += stats[key] * stats["tokens"]
            weight_max = max(weight_max, stats["is_weight_max"])
            if replayed is not None:
                sums["replayed_tokens"] += replayed["tokens"]
                sums["replayed_weight"] += replayed["is_weight_mean"] * replayed["tokens"]

        if self.group.sharded:
            sums, weight_max = self._reduce_stats(sums, weight_max)
        return sums, weight_max, passes

    def train_step(
        self, samples: Sequence[TrainSample], *, proximal_logprobs: Sequence[Sequence[float]] | None = None
    ) -> dict[str, float]:
        """One optimizer step on ``samples``: corrected clipped token loss, backward, grad-norm clip, AdamW step.

        ``loss = sum_i corrected_token_loss(logp_i, prox_i, behav_i, A_i).loss_sum / sum_i T_i`` (DAPO token-level
        mean over the whole batch; the correction mode is ``config.correction``). Where a sample has a
        ``loss_mask``, only its True tokens enter the sum and T_i counts only them. ``prox_i`` is
        ``proximal_logprobs[i]`` if given (pass them when one batch is split over several steps, see
        :meth:`train_batch`), else the detached log-probs of this step's own forward pass, which are the
        pre-update policy's. ``behav_i`` is the sample's ``behaviour_logprobs``.

        Micro-batches and ranks: the samples are split over ranks by token count and each rank's share packed
        into micro-batches under ``max_tokens_per_microbatch`` (learner.train.microbatch); each micro-batch's loss is
        its samples' ``loss_sum`` divided by the token count of the *whole step* (all ranks), gradients are
        accumulated and summed over ranks, so the step equals the one-pass, one-rank step for any budget and
        world size (up to float rounding).

        Args:
            samples: the batch, at least one sample, each with T_i >= 1 output tokens (every rank: the same).
            proximal_logprobs: optional per-sample pre-update log-probs (same lengths as ``output_ids``).

        Returns:
            ``{"loss", "grad_norm" (before clipping), "clip_frac", "dual_clip_frac", "ratio_mean", "approx_kl",
            "is_weight_mean", "is_capped_frac", "behaviour_kl", "entropy" (nats per token, at the weights the step
            starts from; token-weighted over the batch), "is_weight_max",
            "replayed_tokens", "replayed_is_weight_mean" (token-weighted over replayed samples; 0 when none),
            "tokens", "samples", "microbatches" (forward/backward passes per rank), "seconds", "skipped" (1.0
            when the gradient was not finite and no step was taken, else 0.0)}``.

        Samples that cannot be used (mismatched lengths, non-finite numbers, screenshots that do not decode or do
        not match their image pad tokens) are dropped with a warning and counted in ``dropped_samples``.

        Raises:
            TrainerInputError: an empty batch, or no usable sample in it.
            TrainerConfigError: a sample longer than ``max_tokens_per_microbatch`` (names the key).
            arpo_async.model.inputs.ModelInputError: a sample's image pad tokens do not match its images, or an
                image cannot be decoded.
        """
        start = time.perf_counter()
        _check_samples(samples, proximal_logprobs)
        samples, proximal_logprobs, dropped = self.usable(samples, proximal_logprobs)
        if not samples:
            raise TrainerInputError("no usable sample in the batch: " + "; ".join(dropped[:5]))
        sums, weight_max, passes = self.compute_gradients(samples, proximal_logprobs=proximal_logprobs)
        loss_tokens = sum(s.loss_tokens for s in samples)
        total_tokens = max(1, loss_tokens)
        grad_norm = self._clip_gradients()
        skipped = not math.isfinite(grad_norm)
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            self.steps += 1
        self.optimizer.zero_grad(set_to_none=True)

        result = {"loss": sums["loss"], "grad_norm": grad_norm}
        result.update({key: sums[key] / total_tokens for key in _SUMMED_STATS})
        result.update(
            is_weight_max=weight_max,
            replayed_tokens=sums["replayed_tokens"],
            replayed_is_weight_mean=(sums["replayed_weight"] / sums["replayed_tokens"]
                                     if sums["replayed_tokens"] else 0.0),
            tokens=float(loss_tokens),
            samples=float(len(samples)),
            microbatches=float(passes),
            dropped_samples=float(len(dropped)),
            seconds=time.perf_counter() - start,
            skipped=1.0 if skipped else 0.0,
        )
        return result

    def _reduce_stats(self, sums: dict[str, float], weight_max: float) -> tuple[dict[str, float], float]:
        """Sum the per-rank stats over ranks (max for ``weight_max``)."""
        keys = list(sums)
        summed = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(summed)
        peak = torch.tensor([weight_max], dtype=torch.float64, device=self.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return dict(zip(keys, summed.tolist())), float(peak)

    def _clip_gradients(self) -> float:
        """Clip the global gradient norm to ``grad_clip`` (0: no clip); returns the norm before clipping."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2: the norm over every rank's shard
            norm = norm.full_tensor()
        return float(norm)

    def train_batch(self, samples: Sequence[TrainSample], *, minibatches: int = 1) -> dict[str, float]:
        """Train on one batch with ``minibatches`` optimizer steps, clipping every step against the same pi_prox.

        With ``minibatches == 1`` this is :meth:`train_step` (pi_prox from its own forward pass). Otherwise the
        pre-update log-probs of the whole batch are computed first, without gradient (:meth:`compute_logprobs`,
        one extra forward pass per sample), and the samples are split in order into ``minibatches`` contiguous
        chunks, chunk j holding samples ``[j*n//m, (j+1)*n//m)``, one optimizer step each (ARPO: 2 optimizer steps
        per rollout batch, old log-probs recomputed once before them).

        With ``learner.target_kl > 0`` the pre-update log-probs are computed this way for one step too, and after
        the last step the batch is scored again (one more forward pass): the KL between the two sets the
        learning rate of the next batch (learner.algo.kl_schedule). With ``learner.max_kl > 0`` (a copy of the
        parameters is kept for it) an update whose KL is above ``max_kl`` is halved, and the batch scored again,
        until it is not (TRPO's backtracking line search: learner.algo.kl_schedule.UpdateControl).

        Returns:
            The stats of :meth:`train_step`, token-weighted over the steps for means and fractions; ``loss`` the
            token-weighted mean loss; ``grad_norm`` and ``is_weight_max`` the largest; ``tokens``, ``samples``,
            ``seconds``, ``replayed_tokens``, ``skipped`` summed; plus ``optimizer_steps``, ``lr`` (the learning
            rate of these steps) and, with ``target_kl`` or ``max_kl``, ``policy_kl`` (nats per trained token,
            :func:`learner.algo.kl_schedule.batch_kl`, of the update kept) and ``step_scale`` (the share of the
            optimizer's update kept: 1, 1/2, 1/4, ...).

        Raises:
            TrainerInputError: as :meth:`train_step`, or ``minibatches`` < 1 or more than the samples.
        """
        if minibatches < 1 or minibatches > max(1, len(samples)):
            raise TrainerInputError(f"minibatches must be in [1, {len(samples)}], got {minibatches}")
        lr, adaptive = self.lr, self.config.target_kl > 0 or self.config.max_kl > 0
        if minibatches == 1 and not adaptive:
            return dict(self.train_step(samples), optimizer_steps=1.0, lr=lr)
        _check_samples(samples, None)
        samples, _, dropped = self.usable(samples)
        if len(samples) < minibatches:
            raise TrainerInputError(f"{len(samples)} usable samples for {minibatches} minibatches: "
                                    + "; ".join(dropped[:5]))
        start = time.perf_counter()
        proximal = self.compute_logprobs(samples)
        control = UpdateControl(self.config, [p for p in self.module.parameters() if p.requires_grad],
                                lambda: self.compute_logprobs(samples)) if adaptive else None
        bounds = [k * len(samples) // minibatches for k in range(minibatches + 1)]
        parts = [self.train_step(samples[a:b], proximal_logprobs=proximal[a:b])
                 for a, b in itertools.pairwise(bounds)]
        tokens = sum(p["tokens"] for p in parts)
        replayed = sum(p["replayed_tokens"] for p in parts)
        result = {key: sum(p[key] * p["tokens"] for p in parts) / max(tokens, 1.0)
                  for key in ("loss", *_SUMMED_STATS)}
        result.update(
            grad_norm=max(p["grad_norm"] for p in parts),
            is_weight_max=max(p["is_weight_max"] for p in parts),
            replayed_tokens=replayed,
            replayed_is_weight_mean=(sum(p["replayed_is_weight_mean"] * p["replayed_tokens"] for p in parts)
                                     / replayed if replayed else 0.0),
            tokens=tokens,
            samples=float(len(samples)),
            microbatches=sum(p["microbatches"] for p in parts),
            dropped_samples=float(len(dropped)),
            seconds=time.perf_counter() - start,
            skipped=sum(p["skipped"] for p in parts),
            optimizer_steps=float(minibatches),
            lr=lr,
        )
        if control is not None:  # learner.algo.kl_schedule.UpdateControl: the next rate, and the update kept
            self.lr, kept = control.after(proximal, [s.loss_mask for s in samples], lr)
            result.update(kept)
        return result
