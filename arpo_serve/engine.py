"""The inference engine behind `arpo-serve`: the policy on the CPU (or one CUDA device), one batch at a time.

Role: owns the model, its image processor, the grammar backend and the weight version. ``generate_batch`` runs a
whole batch of prepared requests to completion with its own decode loop (left-padded prefill with explicit
M-RoPE positions from `arpo_async.model.inputs`, then one token per step with a KV cache); ``load_weights`` (a
checkpoint folder) and ``load_tensors`` (named tensors) check every name and shape, then copy the new weights in,
all or nothing. Both are blocking and must be called from one worker thread, never concurrently (the
scheduler guarantees that), so a request never sees its weights change: every token of a result carries the
same ``weight_version``.

Not here: the decode loop, its log-prob modes and jump-forward (arpo_serve.decode), and sampling parameters and
the one-token sampler (arpo_serve.sampling). The request and result types are re-exported here, where the server's
modules import them from.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch
import xgrammar as xgr

from arpo_async.model.checkpoint_names import checkpoint_name_map
from arpo_async.model.inputs import ModelInputError, PromptEncoder, image_size, load_policy, pixel_inputs
from arpo_async.grammar import GrammarBackend, GrammarBusy
from arpo_async.weight_sync import dtype_from_name, tensor_checksum
from arpo_serve.decode import BatchRun, GenerationResult, PreparedRequest
from arpo_serve.sampling import RequestError, SamplingParams

__all__ = ["LOGPROB_MODES", "Engine", "GenerationResult", "PreparedRequest", "RequestError", "SamplingParams"]

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


class Engine:
    """The policy plus everything needed to run batches of requests on the CPU or one CUDA device.

    Args:
        model_dir: Hugging Face checkpoint folder.
        seed: seeds the server-level sampler (requests may bring their own ``sampling_seed``).
        weight_version: initial weight version string.
        logprob_mode: "model" (unmasked, temperature 1; default) or "sglang" (masked, tempered).
        jump_forward: emit grammar-forced text as its canonical tokens instead of sampling it (module docstring).
        dtype: the dtype the weights are held in ("float32" or "bfloat16", as SGLang's --dtype); logits are
            computed in float32 either way. Weights received later are cast to it.
        device: "cpu" or "cuda" (the current CUDA device): where the model's forward passes run. Sampling, grammar
            masks and log-probs stay on the CPU: the last position's logits are copied back each decode step.
    Raises:
        ModelInputError: the checkpoint cannot be loaded.
        ValueError: an unknown log-prob mode, or "cuda" where torch sees no CUDA device.
    """

    def __init__(self, model_dir: str | Path, *, seed: int = 0, weight_version: str = "0",
                 logprob_mode: str = "model", jump_forward: bool = True, dtype: str = "float32",
                 device: str = "cpu"):
        from transformers import AutoTokenizer

        if logprob_mode not in LOGPROB_MODES:
            raise ValueError(f"logprob_mode must be one of {LOGPROB_MODES}")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device \"cuda\" but torch sees no CUDA device (torch {torch.__version__})")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        """Where the forward passes run (the weight group's tensors go through it with nccl)."""
        self.model_dir = Path(model_dir)
        self.model, self.image_processor = load_policy(self.model_dir, dtype=dtype_from_name(dtype))
        self.model.to(self.device)
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
                return_text_in_logprobs: bool = False, compiled=None) -> PreparedRequest:
        """Validate one request and compute its pixel inputs (blocking: image decoding and resizing).

        ``input_ids`` may carry one ``<|image_pad|>`` per image (expanded here) or the already expanded pads.
        Everything that bounds the work is checked before any pixel is decoded: the prompt length against the
        context (also from the image headers, the prompt as it will run), the image count and each image's size
        (`MAX_IMAGES_PER_REQUEST`, `MAX_IMAGE_PIXELS`, `MAX_REQUEST_PIXELS`). The returned request's
        ``max_new_tokens`` is capped to the context (`fit_context`). ``compiled``: the request's grammar as
        ``GrammarBackend.compile_async`` gave it (the routes wait for it there, holding no thread); None compiles
        it here (blocking).
        Raises GrammarBusy when there is no room to compile the grammar now, and RequestError on out-of-vocabulary
        ids, a prompt or images over those bounds, image/pad mismatch, undecodable images or a bad grammar.
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
        self._check_image_runs(input_ids, pixels)
        matcher = None
        if params.grammar is not None:
            try:
                if compiled is None:
                    compiled = self.grammars.compile(params.grammar)
                matcher = xgr.GrammarMatcher(compiled)
            except GrammarBusy:
                raise
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

    def _check_image_runs(self, input_ids: list[int], pixels: dict) -> None:
        """Raise RequestError unless the expanded prompt holds one run of ``<|image_pad|>`` per image, of that
        image's token count, each right after a ``<|vision_start|>`` (as the chat template writes them): the
        model's M-RoPE positions find each image from its vision-start token, and a prompt laid out otherwise
        would fail inside the batch, taking every request of it down."""
        pad, start = self.encoder.image_pad_id, self.encoder.vision_start_id
        counts = self._pad_counts(pixels)
        runs, position = [], 0  # (start, length) of each run of pads
        for is_pad, group in itertools.groupby(input_ids, key=lambda token: token == pad):
            length = sum(1 for _ in group)
            if is_pad:
                runs.append((position, length))
            position += length
        if [n for _, n in runs] != counts:
            raise RequestError(f"the prompt's <|image_pad|> runs hold {[n for _, n in runs]} tokens but its "
                               f"{len(counts)} images take {counts}: one run of pads per image, each after its "
                               "own <|vision_start|>")
        if any(s == 0 or input_ids[s - 1] != start for s, _ in runs):
            raise RequestError("every image's <|image_pad|> tokens must follow a <|vision_start|> token, as the "
                               "chat template writes them")

    def _pad_counts(self, pixels: dict) -> list[int]:
        """The ``<|image_pad|>`` tokens each image of ``pixels`` takes (its patch grid over merge_size**2)."""
        grid = pixels.get("image_grid_thw")
        return [] if grid is None else [int(t * h * w) // self.encoder.merge_size**2 for t, h, w in grid.tolist()]

    def _expand_pads(self, input_ids: list[int], pixels: dict) -> list[int]:
        pad = self.encoder.image_pad_id
        counts = self._pad_counts(pixels)
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
            return BatchRun(self, list(requests), is_aborted, self._generator).run()

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
