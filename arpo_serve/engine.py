"""The inference engine behind `arpo-serve`: the policy on the CPU, one batch at a time.

Role: owns the model, its image processor, the grammar backend and the weight version. ``generate_batch`` runs a
whole batch of prepared requests to completion with its own decode loop (left-padded prefill with explicit
M-RoPE positions from `arpo_async.model.inputs`, then one token per step with a KV cache); ``load_weights`` (a
checkpoint folder) and ``load_tensors`` (named tensors) check every name and shape, then copy the new weights in,
all or nothing. Both are blocking and must be called from one worker thread, never concurrently (the
scheduler guarantees that), so a request never sees its weights change: every token of a result carries the
same ``weight_version``.

Log-probs (``logprob_mode="model"``, the default): the log-prob of each sampled token under the unmasked model
distribution at temperature 1, log_softmax(logits)[token], before grammar mask, temperature, top-k/top-p. This
is what the trainer computes (learner.policy_forward). SGLang instead reports log_softmax(masked logits / temperature)
(before top-k/top-p; with SGLANG_RETURN_ORIGINAL_LOGPROB=1 before temperature but still after the grammar mask);
``logprob_mode="sglang"`` reproduces that. Both agree at temperature 1 without a grammar.

Jump-forward (``jump_forward=True``, the default): where a request's grammar forces the next text
(`GrammarBackend.forced_prefix_ids`), the engine emits that text's canonical token ids one per decode step instead
of sampling, and where the grammar allows only stop tokens it emits the first of the model's end tokens. The
tokens are reported in ``output_ids`` and ``output_token_logprobs`` like sampled ones (as SGLang reports every
token); the learner finds them again from the grammar (``GrammarBackend.forced_token_mask``) and leaves them out
of the loss. Without it, forced text is sampled token by token under the mask, so the same fixed text comes out
as many different token sequences (issue 12: 25.2 sampled tokens per reply against 16.9 canonical ones).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from arpo_async.model.checkpoint_names import checkpoint_name_map
from arpo_async.model.inputs import (
    ModelInputError,
    PromptEncoder,
    forward_kwargs,
    image_size,
    load_policy,
    pixel_inputs,
)
from arpo_async.grammar import GrammarBackend, GrammarSpec
from arpo_async.weight_sync import tensor_checksum

log = logging.getLogger(__name__)

LOGPROB_MODES = ("model", "sglang")
PIXEL_CACHE_SIZE = 512
"""Screenshots whose pixel inputs are kept (about 0.2 MB each for the tiny model, 12 MB for 1932x1092)."""
DEFAULT_MAX_NEW_TOKENS = 128
"""max_new_tokens of a request that sends none (SGLang's default)."""
MAX_IMAGE_PIXELS = 7680 * 4320
"""Largest image decoded, in pixels (an 8K screen, about 100 MB as RGB; Qwen2.5-VL's processor shrinks anything above
its max_pixels, 12.8 M, anyway). Checked from the image header before any pixel is decoded."""
MAX_REQUEST_PIXELS = 4 * MAX_IMAGE_PIXELS
"""Most pixels over all images of one request (15 history screenshots of 1920x1080 are 31 M)."""
MAX_IMAGES_PER_REQUEST = 64
"""Most images in one request (SGLang's ``limit_mm_data_per_request``, which it leaves unset)."""


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
                import json

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


class Engine:
    """The policy plus everything needed to run batches of requests on the CPU.

    Args:
        model_dir: Hugging Face checkpoint folder.
        seed: seeds the server-level sampler (requests may bring their own ``sampling_seed``).
        weight_version: initial weight version string.
        logprob_mode: "model" (unmasked, temperature 1; default) or "sglang" (masked, tempered).
        jump_forward: emit grammar-forced text as its canonical tokens instead of sampling it (module docstring).
    Raises:
        ModelInputError: the checkpoint cannot be loaded.
    """

    def __init__(self, model_dir: str | Path, *, seed: int = 0, weight_version: str = "0",
                 logprob_mode: str = "model", jump_forward: bool = True):
        from transformers import AutoTokenizer

        if logprob_mode not in LOGPROB_MODES:
            raise ValueError(f"logprob_mode must be one of {LOGPROB_MODES}")
        self.model_dir = Path(model_dir)
        self.model, self.image_processor = load_policy(self.model_dir)
        self.encoder = PromptEncoder(self.model_dir)
        self.weight_version = str(weight_version)
        self.logprob_mode = logprob_mode
        self.jump_forward = jump_forward
        self.vocab_size = int(self.model.config.text_config.vocab_size)
        self.max_context_tokens = int(self.model.config.text_config.max_position_embeddings)
        self.end_token_ids = tuple(self.encoder.eos_token_ids)
        self.pad_id = self.end_token_ids[-1]
        self.grammars = GrammarBackend(
            AutoTokenizer.from_pretrained(str(self.model_dir)), self.vocab_size, self.end_token_ids
        )
        self._generator = torch.Generator().manual_seed(seed)
        self._thread_guard = threading.Lock()
        self._pixel_cache: OrderedDict[bytes, dict] = OrderedDict()
        self._pixel_lock = threading.Lock()
        self.checkpoint_names = checkpoint_name_map(self.model)
        """Checkpoint name -> module name of every weight this engine serves (the names it loads by)."""

    # ------------------------------------------------------------ request preparation (any thread)

    def prepare(self, rid: str, input_ids: list[int], images: list[bytes], params: SamplingParams, *,
                return_logprob: bool = False, logprob_start_len: int = -1,
                return_text_in_logprobs: bool = False) -> PreparedRequest:
        """Validate one request and compute its pixel inputs (blocking: image decoding and resizing).

        ``input_ids`` may carry one ``<|image_pad|>`` per image (expanded here) or the already expanded pads.
        Everything that bounds the work is checked before any pixel is decoded: the prompt length against the
        context (also from the image headers, the prompt as it will run), the image count and each image's size
        (`MAX_IMAGES_PER_REQUEST`, `MAX_IMAGE_PIXELS`, `MAX_REQUEST_PIXELS`). The returned request's
        ``max_new_tokens`` is capped to the context (`fit_context`).
        Raises RequestError on out-of-vocabulary ids, a prompt or images over those bounds, image/pad mismatch,
        undecodable images or a bad grammar.
        """
        if not input_ids:
            raise RequestError("the prompt is empty")
        if any((not isinstance(t, int)) or t < 0 or t >= self.vocab_size for t in input_ids):
            raise RequestError(f"input_ids must be integers in [0, {self.vocab_size})")
        self.fit_context(params, len(input_ids))  # the prompt as sent; expansion only makes it longer
        sizes = self._image_sizes(input_ids, images)
        pad_counts = [self.encoder.image_token_count(w, h) for w, h in sizes]
        params = self.fit_context(params, _expanded_length(input_ids, self.encoder.image_pad_id, pad_counts))
        pixels = self._pixels(images)
        input_ids = self._expand_pads(input_ids, pixels)
        matcher = None
        if params.grammar is not None:
            try:
                matcher = self.grammars.matcher(params.grammar)
            except ValueError as e:
                raise RequestError(str(e)) from e
        return PreparedRequest(rid, input_ids, pixels, params, return_logprob, logprob_start_len,
                               return_text_in_logprobs, matcher)

    def fit_context(self, params: SamplingParams, n_input: int) -> SamplingParams:
        """``params`` with ``max_new_tokens`` capped so that ``n_input`` prompt tokens and the output fit in the
        context; raises RequestError when they cannot.

        As SGLang 0.5.23 with its defaults (context_len = the text config's ``max_position_embeddings``, C): its
        tokenizer manager (``_validate_one_request``) refuses a prompt of >= C tokens, and a sent max_new_tokens
        with prompt + max_new_tokens > C; its scheduler (``init_req_max_new_tokens``, ``validate_input_length``)
        caps max_new_tokens to max_req_len - prompt - 1 (max_req_len = C - 1) and refuses a prompt of
        >= max_req_len - 5 tokens. Error texts are SGLang's.
        """
        context = self.max_context_tokens
        if n_input >= context:
            raise RequestError(f"The input ({n_input} tokens) is longer than the model's context length "
                               f"({context} tokens).")
        sent = params.max_new_tokens
        if sent is not None and sent + n_input > context:
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of {context} tokens. You "
                f"requested a total of {sent + n_input} tokens: {n_input} tokens from the input messages and "
                f"{sent} tokens for the completion. Please reduce the number of tokens in the input messages or "
                "the completion to fit within the limit.")
        max_req_len = context - 1
        if n_input >= max_req_len - 5:
            raise RequestError(f"Input length ({n_input} tokens) exceeds the maximum allowed length "
                               f"({max_req_len - 5} tokens). Use a shorter input.")
        wanted = DEFAULT_MAX_NEW_TOKENS if sent is None else sent
        return replace(params, max_new_tokens=max(0, min(wanted, max_req_len - n_input - 1)))

    def _image_sizes(self, input_ids: list[int], images: list[bytes]) -> list[tuple[int, int]]:
        """(width, height) of each image from its header alone; raises RequestError, before any pixel is decoded,
        for too many images (more than the prompt's pads, or `MAX_IMAGES_PER_REQUEST`), an unreadable header or
        too many pixels (`MAX_IMAGE_PIXELS` per image, `MAX_REQUEST_PIXELS` in all)."""
        if len(images) > MAX_IMAGES_PER_REQUEST:  # SGLang's _validate_mm_limits text
            raise RequestError(f"Image count {len(images)} exceeds limit {MAX_IMAGES_PER_REQUEST} per request.")
        n_pads = input_ids.count(self.encoder.image_pad_id)
        if len(images) > n_pads:
            raise RequestError(f"{len(images)} images were sent but the prompt has {n_pads} <|image_pad|> tokens: "
                               "at most one image per pad")
        sizes = []
        for i, data in enumerate(images):
            try:
                width, height = image_size(data)
            except ModelInputError as e:
                raise RequestError(f"image {i}: {e}") from e
            if width * height > MAX_IMAGE_PIXELS:
                raise RequestError(f"image {i} is {width}x{height} = {width * height:,} pixels; arpo-serve takes "
                                   f"images of at most {MAX_IMAGE_PIXELS:,} pixels (7680x4320)")
            sizes.append((width, height))
        total = sum(w * h for w, h in sizes)
        if total > MAX_REQUEST_PIXELS:
            raise RequestError(f"the images hold {total:,} pixels in all; arpo-serve takes at most "
                               f"{MAX_REQUEST_PIXELS:,} pixels per request")
        return sizes

    def _pixels(self, images: list[bytes]) -> dict:
        """Pixel inputs of ``images``, each image processed once and cached by content hash (actors resend the
        episode's earlier screenshots with every step). Per-image processing equals batched processing: the
        Qwen2-VL image processor patches each image independently and concatenates."""
        if not images:
            return {}
        parts = []
        for data in images:
            key = hashlib.blake2b(data, digest_size=16).digest()
            with self._pixel_lock:
                hit = self._pixel_cache.get(key)
                if hit is not None:
                    self._pixel_cache.move_to_end(key)
            if hit is None:
                try:
                    hit = pixel_inputs(self.image_processor, [data])
                except ModelInputError as e:
                    raise RequestError(str(e)) from e
                with self._pixel_lock:
                    self._pixel_cache[key] = hit
                    while len(self._pixel_cache) > PIXEL_CACHE_SIZE:
                        self._pixel_cache.popitem(last=False)
            parts.append(hit)
        return {
            "pixel_values": torch.cat([p["pixel_values"] for p in parts]),
            "image_grid_thw": torch.cat([p["image_grid_thw"] for p in parts]),
        }

    def _expand_pads(self, input_ids: list[int], pixels: dict) -> list[int]:
        pad = self.encoder.image_pad_id
        grid = pixels.get("image_grid_thw")
        merge = self.encoder.merge_size
        counts = [] if grid is None else [int(t * h * w) // merge**2 for t, h, w in grid.tolist()]
        if _expanded_length(input_ids, pad, counts) == len(input_ids):
            return list(input_ids)
        out: list[int] = []
        it = iter(counts)
        for t in input_ids:
            out.extend([t] * next(it) if t == pad else [t])
        return out

    # ------------------------------------------------------------ batches (worker thread only)

    @torch.inference_mode()
    def generate_batch(self, requests: Sequence[PreparedRequest],
                       is_aborted: Callable[[str], bool] = lambda rid: False) -> list[GenerationResult]:
        """Run ``requests`` together to completion. Blocking; one caller at a time.

        ``is_aborted(rid)`` is polled once per decode step; an aborted request ends with finish_reason abort and
        keeps the tokens generated so far.
        """
        with self._thread_guard:
            return _BatchRun(self, list(requests), is_aborted).run()

    def load_weights(self, model_path: str | Path, load_format: str | None = None) -> tuple[bool, str]:
        """Load every ``*.safetensors`` file of ``model_path`` into the live model (same architecture).

        Returns ``(success, message)``; on failure the model is unchanged. Keys saved by transformers 4.x
        (``model.layers.*``, ``visual.*``) are mapped to this model's names.
        """
        from safetensors.torch import load_file

        if load_format not in (None, "auto", "safetensors"):
            return False, f"unsupported load_format {load_format!r} (use 'auto' or 'safetensors')"
        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            return False, f"no *.safetensors files in {model_path}"
        incoming: dict[str, torch.Tensor] = {}
        try:
            for f in files:
                incoming.update(load_file(str(f)))
        except (OSError, RuntimeError, ValueError) as e:
            return False, f"cannot read weights from {model_path}: {e}"
        ok, message = self.load_tensors(incoming, complete=True)
        if not ok:
            return False, message
        return True, f"Succeeded to update model weights from {model_path}."

    def load_tensors(self, tensors: dict[str, "torch.Tensor"], *, complete: bool = False) -> tuple[bool, str]:
        """Load ``tensors`` (checkpoint names -> tensors) into the live model; all or nothing.

        Names are checkpoint names (``model.layers...``, ``visual...``: what save_pretrained writes), the only
        names SGLang 0.5.23's Qwen2.5-VL ``load_weights`` loads; a module name such as
        ``model.language_model.layers...`` is refused (SGLang would fail the update or skip it silently).
        ``complete``: every weight of the model must be among them (a whole checkpoint); otherwise any subset
        (one bucket of a distributed update). Everything is checked and converted into new tensors first, then
        copied in while no batch runs: on failure the model is unchanged.

        Returns:
            ``(success, message)``; the message names up to 5 unknown, missing or misshapen names.
        """
        with self._thread_guard:
            own = self.model.state_dict()
            unknown = [k for k in tensors if k not in self.checkpoint_names]
            missing = [k for k in self.checkpoint_names if k not in tensors] if complete else []
            bad_shape = [k for k, v in tensors.items() if k in self.checkpoint_names
                         and tuple(v.shape) != tuple(own[self.checkpoint_names[k]].shape)]
            if unknown or missing or bad_shape:
                hint = (" (module names; send checkpoint names as save_pretrained writes them)"
                        if any(k.startswith(("model.language_model.", "model.visual.")) for k in unknown) else "")
                return False, (f"weights do not fit the model: unknown {unknown[:5]}{hint}, missing {missing[:5]}, "
                               f"wrong shape {bad_shape[:5]}")
            staged = {self.checkpoint_names[k]: v.detach().to(own[self.checkpoint_names[k]].dtype, copy=True)
                      for k, v in tensors.items()}
            with torch.no_grad():
                for name, tensor in staged.items():
                    own[name].copy_(tensor)
        return True, f"Succeeded to update {len(staged)} weights."

    def checksums(self) -> dict[str, str]:
        """SGLang's ``/weights_checker`` checksum of every served weight, keyed by checkpoint name
        (arpo_async.weight_sync.tensor_checksum). Runs while no batch runs."""
        with self._thread_guard:
            own = self.model.state_dict()
            return {ck: tensor_checksum(own[name]) for ck, name in self.checkpoint_names.items()}


def _expanded_length(input_ids: list[int], pad: int, counts: list[int]) -> int:
    """Length of ``input_ids`` once its ``pad`` tokens stand for images of ``counts`` pads each: unchanged when the
    pads are already expanded (sum(counts) of them), else one pad per image. Raises RequestError otherwise."""
    n_pads = input_ids.count(pad)
    if n_pads == sum(counts):
        return len(input_ids)
    if n_pads == len(counts):
        return len(input_ids) - n_pads + sum(counts)
    raise RequestError(
        f"prompt has {n_pads} <|image_pad|> tokens but {len(counts)} images were sent: expected "
        f"{len(counts)} (one per image) or {sum(counts)} (already expanded)"
    )


class _BatchRun:
    """State of one batch: left-padded prefill, then a decode loop with per-row sampling and stopping."""

    def __init__(self, engine: Engine, requests: list[PreparedRequest], is_aborted: Callable[[str], bool]):
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
            else engine._generator for r in requests
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
            out = self.e.model(input_ids=step_ids.view(-1, 1), attention_mask=attention_mask,
                               position_ids=positions, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits = out.logits[:, -1].float()
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
        kw = forward_kwargs(self.e.model, ids, mask, pixels)
        next_pos = kw.pop("_next_position")
        out = self.e.model(**kw, use_cache=True)
        all_logits = out.logits.float()
        for i, r in enumerate(self.reqs):
            if r.return_logprob and r.logprob_start_len >= 0:
                self.in_lp[i] = self._input_logprobs(all_logits[i, width - lengths[i]:], r)
        return all_logits[:, -1], mask, next_pos, out.past_key_values

    @staticmethod
    def _input_logprobs(logits: torch.Tensor, r: PreparedRequest) -> list[float | None]:
        logp = torch.log_softmax(logits[:-1], dim=-1)
        ids = torch.tensor(r.input_ids[1:]).unsqueeze(-1)
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
                token, tempered_logp = _sample(masked[i], r.params, self.generators[i])
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


def _sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> tuple[int, float]:
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
