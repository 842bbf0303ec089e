"""One batch of prepared requests run to completion: arpo-serve's decode loop.

Role: :class:`BatchRun` takes the :class:`PreparedRequest` s of one batch through a left-padded prefill with
explicit M-RoPE positions (`arpo_async.model.inputs.forward_kwargs`), then one token per row and step with a KV
cache, both on the engine's device; each step's last-position logits come back to the CPU for the grammar mask,
jump-forward or :func:`arpo_serve.sampling.sample_token`, stop strings and tokens, aborts; it returns one
:class:`GenerationResult` per request. It reads the engine it runs on (:class:`BatchEngine`:
arpo_serve.engine.Engine) and changes nothing in it but the sampler's generator state.

Log-probs (``logprob_mode="model"``, the default): the log-prob of each sampled token under the unmasked model
distribution at temperature 1, log_softmax(logits)[token], before grammar mask, temperature, top-k/top-p. This
is what the trainer computes (learner.train.policy_forward). SGLang instead reports log_softmax(masked logits /
temperature) (before top-k/top-p; with SGLANG_RETURN_ORIGINAL_LOGPROB=1 before temperature but still after the grammar
mask); ``logprob_mode="sglang"`` reproduces that. Both agree at temperature 1 without a grammar.

Jump-forward (``jump_forward=True``, the default): where a request's grammar forces the next text
(`GrammarBackend.forced_prefix_ids`), the engine emits that text's canonical token ids one per decode step instead
of sampling, and where the grammar allows only stop tokens it emits the first of the model's end tokens. The
tokens are reported in ``output_ids`` and ``output_token_logprobs`` like sampled ones (as SGLang reports every
token); the learner finds them again from the grammar (``GrammarBackend.forced_token_mask``) and leaves them out
of the loss. Without it, forced text is sampled token by token under the mask, so the same fixed text comes out
as many different token sequences (issue 12: 25.2 sampled tokens per reply against 16.9 canonical ones).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from arpo_async.grammar import GrammarBackend
from arpo_async.model.inputs import PromptEncoder, forward_kwargs
from arpo_serve.sampling import SamplingParams, sample_token

__all__ = ["BatchEngine", "BatchRun", "GenerationResult", "PreparedRequest"]


@dataclass
class PreparedRequest:
    """A validated request, ready to batch: token ids with pads expanded, pixel tensors, a grammar matcher."""

    rid: str
    input_ids: list[int]
    pixels: dict
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    matcher: Any = None
    created: float = field(default_factory=time.monotonic)


@dataclass
class GenerationResult:
    """One finished request. logprobs[i] is the log-prob of output_ids[i] (see module docstring)."""

    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    input_logprobs: list[float | None]
    finish_reason: dict
    prompt_tokens: int
    weight_version: str
    text: str = ""


class BatchEngine(Protocol):
    """What a batch reads of the engine it runs on (arpo_serve.engine.Engine is one; typed here, not imported,
    because the engine imports this module)."""

    model: torch.nn.Module
    """The policy (Qwen2-VL / Qwen2.5-VL, transformers)."""
    encoder: PromptEncoder
    """Tokenizer side: decode, tokenize, image pad id."""
    grammars: GrammarBackend
    """Grammar masks and jump-forward's forced text."""
    end_token_ids: tuple[int, ...]
    """The model's end tokens (stop unless ``ignore_eos``)."""
    pad_id: int
    """Left padding of the prefill."""
    jump_forward: bool
    """Emit grammar-forced text as its canonical tokens (module docstring)."""
    logprob_mode: str
    """"model" or "sglang" (module docstring)."""
    weight_version: str
    """Stamped on every result of the batch."""
    device: torch.device
    """Where the model's forward passes run; the last position's logits come back to the CPU each step."""


class BatchRun:
    """State of one batch: left-padded prefill, then a decode loop with per-row sampling and stopping."""

    def __init__(self, engine: BatchEngine, requests: list[PreparedRequest], is_aborted: Callable[[str], bool],
                 generator: torch.Generator):
        self.e = engine
        self.reqs = requests
        self.is_aborted = is_aborted
        n = len(requests)
        self.out_ids: list[list[int]] = [[] for _ in range(n)]
        self.out_lp: list[list[float]] = [[] for _ in range(n)]
        self.in_lp: list[list[float | None]] = [[] for _ in range(n)]
        self.finish: list[dict | None] = [None] * n
        self.texts: list[str] = [""] * n
        self.generators = [
            torch.Generator().manual_seed(r.params.sampling_seed) if r.params.sampling_seed is not None
            else generator for r in requests
        ]
        self.stop_ids = [
            set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(engine.end_token_ids))
            for r in requests
        ]
        self.forced_queue: list[list[int]] = [[] for _ in range(n)]
        """Per row: canonical ids of forced text still to emit (jump-forward)."""

    def run(self) -> list[GenerationResult]:
        version = self.e.weight_version
        for i, r in enumerate(self.reqs):
            if r.params.max_new_tokens == 0:
                self.finish[i] = {"type": "length", "length": 0}
        logits, attention_mask, next_pos, cache = self._prefill()
        step_ids = torch.full((len(self.reqs),), self.e.pad_id, dtype=torch.long)
        while True:
            for i, r in enumerate(self.reqs):
                if self.finish[i] is None and self.is_aborted(r.rid):
                    self.finish[i] = {"type": "abort", "message": "Abort request."}
            active = [i for i in range(len(self.reqs)) if self.finish[i] is None]
            if not active:
                break
            self._sample_step(logits, active, step_ids)
            if all(self.finish[i] is not None for i in range(len(self.reqs))):
                break
            attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
            positions = next_pos.view(1, -1, 1).expand(3, -1, 1)
            out = self.e.model(input_ids=step_ids.view(-1, 1).to(self.e.device), attention_mask=attention_mask,
                               position_ids=positions, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits = out.logits[:, -1].float().cpu()
            next_pos = next_pos + 1
        return [self._result(i, version) for i in range(len(self.reqs))]

    def _prefill(self):
        lengths = [len(r.input_ids) for r in self.reqs]
        width = max(lengths)
        ids = torch.full((len(self.reqs), width), self.e.pad_id, dtype=torch.long)
        mask = torch.zeros((len(self.reqs), width), dtype=torch.long)
        for i, r in enumerate(self.reqs):
            ids[i, width - lengths[i]:] = torch.tensor(r.input_ids)
            mask[i, width - lengths[i]:] = 1
        pixels: dict = {}
        with_images = [r.pixels for r in self.reqs if r.pixels]
        if with_images:
            pixels = {
                "pixel_values": torch.cat([p["pixel_values"] for p in with_images]),
                "image_grid_thw": torch.cat([p["image_grid_thw"] for p in with_images]),
            }
        device = self.e.device
        pixels = {k: v.to(device) for k, v in pixels.items()}
        kw = forward_kwargs(self.e.model, ids.to(device), mask.to(device), pixels)
        next_pos = kw.pop("_next_position")
        out = self.e.model(**kw, use_cache=True)
        for i, r in enumerate(self.reqs):
            if r.return_logprob and r.logprob_start_len >= 0:
                self.in_lp[i] = self._input_logprobs(out.logits[i, width - lengths[i]:].float(), r)
        return out.logits[:, -1].float().cpu(), kw["attention_mask"], next_pos, out.past_key_values

    @staticmethod
    def _input_logprobs(logits: torch.Tensor, r: PreparedRequest) -> list[float | None]:
        logp = torch.log_softmax(logits[:-1], dim=-1)
        ids = torch.tensor(r.input_ids[1:], device=logits.device).unsqueeze(-1)
        values = [None] + logp.gather(-1, ids).squeeze(-1).tolist()
        return values[r.logprob_start_len:]

    def _sample_step(self, logits: torch.Tensor, active: list[int], step_ids: torch.Tensor) -> None:
        raw_logp = torch.log_softmax(logits, dim=-1)
        masked = logits.clone()
        self.e.grammars.mask_logits(masked, [self.reqs[i].matcher if i in active else None
                                             for i in range(len(self.reqs))])
        for i in active:
            r = self.reqs[i]
            token = self._forced_token(i, masked[i]) if self.e.jump_forward else None
            if token is None:
                token, tempered_logp = sample_token(masked[i], r.params, self.generators[i])
            else:
                tempered_logp = float(torch.log_softmax(masked[i] / max(r.params.temperature, 1e-6), dim=-1)[token])
            lp = raw_logp[i, token].item() if self.e.logprob_mode == "model" else tempered_logp
            self.out_ids[i].append(token)
            self.out_lp[i].append(lp)
            step_ids[i] = token
            if r.matcher is not None and not r.matcher.is_terminated():
                if not r.matcher.accept_token(token):  # cannot happen after masking; guards a backend bug
                    self.finish[i] = {"type": "abort", "message": f"grammar rejected token {token}"}
                    continue
            self._check_stop(i)

    def _forced_token(self, i: int, masked_row: torch.Tensor) -> int | None:
        """The token jump-forward emits for row ``i`` now, or None when the policy must choose (sample)."""
        r, queue = self.reqs[i], self.forced_queue[i]
        if r.matcher is None or r.matcher.is_terminated():
            return None
        if not queue:
            queue.extend(self.e.grammars.forced_prefix_ids(r.matcher, self.e.encoder.tokenize))
        if queue:
            token = queue.pop(0)
            if torch.isfinite(masked_row[token]):
                return token
            queue.clear()  # cannot happen for the grammar's own text; sample rather than emit a forbidden token
            return None
        allowed = torch.isfinite(masked_row).nonzero().flatten().tolist()
        ends = [t for t in self.e.end_token_ids if t in self.stop_ids[i]]
        if ends and allowed and set(allowed) <= set(ends):
            return ends[0]
        return None

    def _check_stop(self, i: int) -> None:
        r, token = self.reqs[i], self.out_ids[i][-1]
        if token in self.stop_ids[i]:
            self.finish[i] = {"type": "stop", "matched": token}
            return
        if r.params.stop:
            text = self.e.encoder.decode(self.out_ids[i], skip_special_tokens=r.params.skip_special_tokens)
            for s in r.params.stop:
                at = text.find(s)
                if at >= 0:
                    self.finish[i] = {"type": "stop", "matched": s}
                    self.texts[i] = text if r.params.no_stop_trim else text[:at]
                    return
        if len(self.out_ids[i]) >= r.params.max_new_tokens:
            self.finish[i] = {"type": "length", "length": r.params.max_new_tokens}

    def _result(self, i: int, version: str) -> GenerationResult:
        r, finish = self.reqs[i], self.finish[i]
        text = self.texts[i]
        if not (finish and finish["type"] == "stop" and isinstance(finish.get("matched"), str)):
            text = self.e.encoder.decode(self.out_ids[i], skip_special_tokens=r.params.skip_special_tokens)
        return GenerationResult(r.rid, self.out_ids[i], self.out_lp[i], self.in_lp[i], finish or {},
                                len(r.input_ids), version, text)
