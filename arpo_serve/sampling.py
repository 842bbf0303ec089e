"""What a request asks of the sampler (:class:`SamplingParams`, SGLang's ``sampling_params``) and the sampler itself.

Role: validates a request's sampling parameters (:class:`RequestError`, HTTP 400, names the field) and draws one
token from a logits row as SGLang's sampler does (:func:`sample_token`: temperature, top-k, top-p, min-p). Pure:
no model, no state; arpo_serve.decode calls it once per row and decode step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from arpo_async.grammar import GrammarSpec

__all__ = ["RequestError", "SamplingParams", "sample_token"]


class RequestError(ValueError):
    """A generate request that is malformed or inconsistent (HTTP 400)."""


@dataclass(frozen=True)
class SamplingParams:
    """SGLang's ``sampling_params`` (python/sglang/srt/sampling/sampling_params.py), the part we honour."""

    max_new_tokens: int | None = None
    """Most tokens to generate; None (not sent) = SGLang's default 128. `Engine.prepare` caps it to what fits in
    the context and refuses a sent value that does not fit, as SGLang does."""
    temperature: float = 1.0
    """Softmax temperature; < 1e-6 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 = all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p x the top probability."""
    stop: tuple[str, ...] = ()
    """Stop strings; the text is cut before the match (output_ids keep every sampled token)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop tokens besides the model's end tokens."""
    ignore_eos: bool = False
    """Do not stop on the model's end tokens."""
    skip_special_tokens: bool = True
    """Drop special tokens from the returned text."""
    no_stop_trim: bool = False
    """Keep a matched stop string in the text."""
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None
    sampling_seed: int | None = None
    """Seeds this request's sampler; None = the server's generator."""

    @classmethod
    def from_json(cls, obj: Any) -> "SamplingParams":
        """Validate a JSON ``sampling_params`` map. Raises RequestError with the offending field."""
        if obj is None:
            return cls()
        if not isinstance(obj, dict):
            raise RequestError("sampling_params must be an object")
        known = {f for f in cls.__dataclass_fields__}
        kw: dict[str, Any] = {}
        for key, value in obj.items():
            if key not in known or value is None:
                continue  # SGLang has many more knobs (n, penalties, ...); unknown ones are ignored
            kw[key] = value
        try:
            if "stop" in kw:
                kw["stop"] = (kw["stop"],) if isinstance(kw["stop"], str) else tuple(str(s) for s in kw["stop"])
            if "stop_token_ids" in kw:
                kw["stop_token_ids"] = tuple(int(t) for t in kw["stop_token_ids"])
            for k in ("max_new_tokens", "top_k"):
                if k in kw:
                    kw[k] = _as_int(kw[k], k)
            for k in ("temperature", "top_p", "min_p"):
                if k in kw:
                    kw[k] = float(kw[k])
            if "sampling_seed" in kw:
                kw["sampling_seed"] = _as_int(kw["sampling_seed"], "sampling_seed")
            if "json_schema" in kw and not isinstance(kw["json_schema"], str):
                kw["json_schema"] = json.dumps(kw["json_schema"])
        except (TypeError, ValueError) as e:
            raise RequestError(f"invalid sampling_params: {e}") from e
        params = cls(**kw)
        params.validate()
        return params

    def validate(self) -> None:
        """Raises RequestError on out-of-range values."""
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise RequestError("max_new_tokens must be >= 0")
        if self.temperature < 0:
            raise RequestError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise RequestError("top_p must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise RequestError("top_k must be -1 or >= 1")
        if not 0 <= self.min_p <= 1:
            raise RequestError("min_p must be in [0, 1]")
        if sum(x is not None for x in (self.regex, self.ebnf, self.json_schema)) > 1:
            raise RequestError("only one of regex, ebnf, json_schema may be set")

    @property
    def grammar(self) -> GrammarSpec | None:
        """The grammar constraint, if any."""
        if self.regex is None and self.ebnf is None and self.json_schema is None:
            return None
        return GrammarSpec(regex=self.regex, ebnf=self.ebnf, json_schema=self.json_schema)


def _as_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise RequestError(f"{name} must be an integer, got {value!r}")
    return int(value)


def sample_token(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> tuple[int, float]:
    """Sample one token from a (grammar-masked) logits row [V]. Returns (token, log_softmax(logits/T)[token]).

    Order as in SGLang's sampler: temperature, then top-k, top-p, min-p renormalisation; temperature < 1e-6 is
    greedy (SGLang's threshold)."""
    if p.temperature < 1e-6:
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, dim=-1)[token])
    scaled = logits / p.temperature
    tempered_logp = torch.log_softmax(scaled, dim=-1)
    probs = tempered_logp.exp()
    if p.top_k > 0 and p.top_k < probs.numel():
        kth = torch.topk(probs, p.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=0)
        drop = (cum - sorted_probs) > p.top_p * cum[-1]
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    if p.min_p > 0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, torch.zeros_like(probs))
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(tempered_logp[token])
