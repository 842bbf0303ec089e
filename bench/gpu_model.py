"""The GPU timing model of bench/bench_gpu_model.py: its parameters (bench/gpu_timing.toml) and its formulas.

Role: pure functions of the parameters, in modelled seconds; nothing here sleeps or touches the product. The
asyncio stand-ins that apply it (a modelled SGLang server, trainer, publisher and desktop) are in
bench/gpu_stand_ins.py. Only bench/ uses this model: the product's code paths carry no timing model.

Formulas (sources in bench/gpu_timing.toml):
  prefill of t text and i image tokens      (t + image_token_factor x i) x prefill_s_per_token
  one decode iteration over running seqs    decode_base_s + decode_s_per_context_token x (their context tokens)
  one training batch of n tokens, m steps   n x (1 + logprob_forward_fraction) / (gpus x tokens_per_s_per_gpu)
                                            + m x step_overhead_s
  episode steps                             max_steps with probability budget_share, else k in 1..max_steps
                                            with P(k) proportional to k^-length_alpha
  app action                                log-uniform in [action_s_min, action_s_max]
"""

from __future__ import annotations

import dataclasses
import math
import random
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

DEFAULT_PATH = Path(__file__).resolve().parent / "gpu_timing.toml"


@dataclass(frozen=True)
class InferenceModel:
    """One SGLang server on one H100 (the [inference] table; units: seconds, tokens)."""

    servers: int
    prefill_s_per_token: float
    image_token_factor: float
    decode_base_s: float
    decode_s_per_context_token: float
    chunk_tokens: int
    kv_cache_tokens: int
    image_tokens: int
    output_tokens: int

    def prefill_s(self, text_tokens: float, image_tokens: float) -> float:
        """GPU seconds to prefill ``text_tokens`` text and ``image_tokens`` image tokens (compute-bound)."""
        return (text_tokens + self.image_token_factor * image_tokens) * self.prefill_s_per_token

    def decode_iteration_s(self, context_tokens: float) -> float:
        """Seconds of one decode iteration whose running sequences hold ``context_tokens`` in all (weights read
        once, every sequence's KV cache read once: memory-bound)."""
        return self.decode_base_s + self.decode_s_per_context_token * context_tokens

    def decode_token_s_saturated(self, context: float) -> float:
        """GPU seconds per output token of a sequence of ``context`` tokens when the KV cache is full of such
        sequences (the server's most efficient decode: the weight read shared by kv_cache_tokens / context)."""
        batch = max(1.0, self.kv_cache_tokens / max(context, 1.0))
        return self.decode_base_s / batch + self.decode_s_per_context_token * context


@dataclass(frozen=True)
class TrainingModel:
    """FSDP training on ``gpus`` H100s plus the weight sync (the [training] table)."""

    gpus: int
    tokens_per_s_per_gpu: float
    logprob_forward_fraction: float
    step_overhead_s: float
    weight_sync_s: float

    def batch_s(self, tokens: float, optimizer_steps: int) -> float:
        """Seconds to train one batch of ``tokens`` tokens with ``optimizer_steps`` optimizer steps (the
        pre-update log-probs recomputed once, as learner.train.trainer.Trainer.train_batch does)."""
        rate = self.gpus * self.tokens_per_s_per_gpu
        return tokens * (1.0 + self.logprob_forward_fraction) / rate + optimizer_steps * self.step_overhead_s


@dataclass(frozen=True)
class EpisodeModel:
    """OSWorld-like episode lengths and app-action latencies (the [episode] table)."""

    max_steps: int
    length_alpha: float
    budget_share: float
    action_s_min: float
    action_s_max: float
    reset_s: float
    success_share: float

    def steps(self, rng: random.Random) -> int:
        """Steps of one episode (1..max_steps; see the module docstring)."""
        if rng.random() < self.budget_share:
            return self.max_steps
        ks = range(1, self.max_steps + 1)
        return rng.choices(ks, weights=[k ** -self.length_alpha for k in ks])[0]

    def action_s(self, rng: random.Random) -> float:
        """Seconds of one app action, log-uniform in [action_s_min, action_s_max]."""
        lo, hi = math.log(self.action_s_min), math.log(self.action_s_max)
        return math.exp(rng.uniform(lo, hi))

    def mean_steps(self) -> float:
        """Expected steps per episode."""
        ks = range(1, self.max_steps + 1)
        weights = [k ** -self.length_alpha for k in ks]
        zipf = sum(k * w for k, w in zip(ks, weights)) / sum(weights)
        return self.budget_share * self.max_steps + (1 - self.budget_share) * zipf

    def mean_action_s(self) -> float:
        """Expected seconds of one app action ((hi - lo) / ln(hi / lo) for a log-uniform law)."""
        return (self.action_s_max - self.action_s_min) / math.log(self.action_s_max / self.action_s_min)


@dataclass(frozen=True)
class GpuTimingModel:
    """The whole model: inference, training, episodes and the time scale (modelled seconds per real second)."""

    inference: InferenceModel
    training: TrainingModel
    episode: EpisodeModel
    time_scale: float

    def scaled(self, section: str, key: str, factor: float) -> GpuTimingModel:
        """This model with ``section.key`` multiplied by ``factor`` (integers rounded, at least 1), for the
        sensitivity table. Raises AttributeError for an unknown parameter."""
        part = getattr(self, section) if section != "run" else None
        if part is None:
            return dataclasses.replace(self, time_scale=self.time_scale * factor)
        value = getattr(part, key)
        new = max(1, round(value * factor)) if isinstance(value, int) else value * factor
        return dataclasses.replace(self, **{section: dataclasses.replace(part, **{key: new})})


SECTIONS = {"inference": InferenceModel, "training": TrainingModel, "episode": EpisodeModel}


def load_model(path: Path = DEFAULT_PATH, overrides: Iterable[str] = ()) -> GpuTimingModel:
    """Read the model from a TOML file, then apply ``section.key=value`` overrides.

    Raises:
        ValueError: a missing or unknown section or key, a malformed override, or a value that is not a
            positive number (budget_share and success_share may be 0..1, logprob_forward_fraction >= 0).
    """
    data: dict[str, Any] = tomllib.loads(Path(path).read_text())
    for item in overrides:
        key, sep, raw = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot:
            raise ValueError(f"override {item!r} must look like section.key=value")
        data.setdefault(section, {})[name] = tomllib.loads(f"v = {raw.strip()}")["v"]
    parts = {}
    for section, cls in SECTIONS.items():
        table = data.get(section, {})
        names = {f.name for f in dataclasses.fields(cls)}
        if set(table) != names:
            raise ValueError(f"[{section}] needs exactly {sorted(names)}; missing {sorted(names - set(table))}, "
                             f"unknown {sorted(set(table) - names)}")
        for name, value in table.items():
            low = 0.0 if name in ("budget_share", "success_share", "logprob_forward_fraction") else None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                    value < low if low is not None else value <= 0):
                raise ValueError(f"{section}.{name} must be a {'non-negative' if low is not None else 'positive'} "
                                 f"number, got {value!r}")
        parts[section] = cls(**table)
    scale = data.get("run", {}).get("time_scale", 1.0)
    if not isinstance(scale, (int, float)) or scale <= 0:
        raise ValueError(f"run.time_scale must be a positive number, got {scale!r}")
    return GpuTimingModel(**parts, time_scale=float(scale))
