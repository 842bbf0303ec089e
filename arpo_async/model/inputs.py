"""Model I/O shared by actors, `arpo-serve` and the learner's trainer: the one place that turns prompts and
screenshots into model inputs, so sampler and trainer see identical token ids and positions
("tokens in, tokens out").

Two halves:

- the light half (`smart_resize`, `PromptEncoder`) needs only ``tokenizers``, ``jinja2`` and the checkpoint's JSON
  files; it never imports torch or transformers, so actors stay light;
- the torch half (`load_policy`, `pixel_inputs`, `rope_positions`, `forward_kwargs`) imports torch lazily inside
  each function.

Invariant: for a prompt with images, ``PromptEncoder.encode`` emits exactly ``image_token_count(w, h)``
``<|image_pad|>`` ids per image, which is the number of vision embeddings the model produces for the
``image_grid_thw`` that `pixel_inputs` computes for the same image (both use `smart_resize`).
"""

from __future__ import annotations

import io
import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
IMAGE_PAD = "<|image_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
END_TOKENS = ("<|im_end|>", "<|endoftext|>")
SEGMENT_CACHE_SIZE = 16384
"""Text segments (between added tokens) whose token ids `PromptEncoder.tokenize` remembers; emptied when full."""


class ModelInputError(ValueError):
    """A prompt, image or checkpoint folder that cannot be turned into model inputs."""


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = DEFAULT_MIN_PIXELS,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> tuple[int, int]:
    """Qwen2-VL / Qwen2.5-VL image resize rule: returns ``(h, w)`` in pixels.

    Both sides become multiples of ``factor`` (patch 14 x merge 2 = 28), the area lands in
    ``[min_pixels, max_pixels]`` and the aspect ratio is kept as far as possible. Source: ``smart_resize`` in
    transformers ``models/qwen2_vl/image_processing_qwen2_vl.py`` (same as qwen-vl-utils' ``smart_resize``).
    Example: 1080x1920 with max_pixels 2,116,800 -> (1092, 1932), i.e. 39 x 69 = 2,691 image tokens.

    Raises:
        ModelInputError: a side is not positive, or the aspect ratio exceeds 200.
    """
    if height <= 0 or width <= 0:
        raise ModelInputError(f"image size must be positive, got {width}x{height}")
    if max(height, width) / min(height, width) > 200:
        raise ModelInputError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as {"content": ...} maps."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_chat_template(model_dir: Path, tokenizer_config: dict) -> str:
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    as_json = model_dir / "chat_template.json"
    if as_json.exists():
        return json.loads(as_json.read_text())["chat_template"]
    template = tokenizer_config.get("chat_template")
    if isinstance(template, str):
        return template
    raise ModelInputError(f"{model_dir} has no chat template (chat_template.jinja/.json or tokenizer_config.json)")


class PromptEncoder:
    """Chat messages + image sizes -> prompt token ids, with ``<|image_pad|>`` already expanded.

    Loads ``tokenizer.json``, ``tokenizer_config.json``, the chat template and ``preprocessor_config.json``
    from a Hugging Face checkpoint folder (the tiny model of `init_model` or a real UI-TARS / Qwen2.5-VL one).
    No torch, no transformers.

    Raises:
        ModelInputError: the folder lacks one of those files.
    """

    def __init__(self, model_dir: str | Path):
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        self.model_dir = Path(model_dir)
        try:
            self._tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
            tk_cfg = json.loads((self.model_dir / "tokenizer_config.json").read_text())
            pp_cfg = json.loads((self.model_dir / "preprocessor_config.json").read_text())
        except Exception as e:  # tokenizers raises a bare Exception on a bad tokenizer.json
            raise ModelInputError(f"cannot load tokenizer/preprocessor from {self.model_dir}: {e}") from e
        self._special_tokens = {
            k: _token_content(tk_cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        size = pp_cfg.get("size") or {}
        self.min_pixels: int = int(
            pp_cfg.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or DEFAULT_MIN_PIXELS
        )
        self.max_pixels: int = int(
            pp_cfg.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or DEFAULT_MAX_PIXELS
        )
        self.patch_size: int = int(pp_cfg.get("patch_size", 14))
        self.merge_size: int = int(pp_cfg.get("merge_size", 2))
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
        self._template = env.from_string(_read_chat_template(self.model_dir, tk_cfg))
        self.image_pad_id: int = self._require_id(IMAGE_PAD)
        self.vision_start_id: int = self._require_id(VISION_START)
        self._added_ids, self._added_split = self._added_token_splitter()
        self._segment_ids: dict[str, tuple[int, ...]] = {}
        self.eos_token_ids: list[int] = [
            i for i in (self._tokenizer.token_to_id(t) for t in END_TOKENS) if i is not None
        ]
        if not self.eos_token_ids:
            raise ModelInputError(f"tokenizer in {self.model_dir} has none of the end tokens {END_TOKENS}")

    def _added_token_splitter(self) -> tuple[dict[str, int], re.Pattern | None]:
        """(added token -> id, a regex whose ``split`` isolates added tokens), or (_, None) when splitting in
        Python could differ from the tokenizer: added tokens that strip whitespace, match single words only or
        match normalized text. Alternatives are sorted longest first, which makes the regex's leftmost match
        the tokenizer's leftmost-longest one."""
        added = list(self._tokenizer.get_added_tokens_decoder().values())
        ids = {a.content: self._tokenizer.token_to_id(a.content) for a in added}
        if not added or any(a.lstrip or a.rstrip or a.single_word or a.normalized for a in added):
            return ids, None
        alternatives = sorted(ids, key=len, reverse=True)
        return ids, re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")

    def _require_id(self, token: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ModelInputError(f"tokenizer in {self.model_dir} has no {token} token")
        return token_id

    @property
    def vocab_size(self) -> int:
        """Tokenizer vocabulary size including added tokens (the model's embedding may be larger)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """The ``(w, h)`` in pixels the model sees for a ``width`` x ``height`` screenshot (`smart_resize`)."""
        h, w = smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)
        return w, h

    def image_token_count(self, width: int, height: int) -> int:
        """Number of ``<|image_pad|>`` tokens for one image: (h/14) * (w/14) / merge**2."""
        w, h = self.resized_size(width, height)
        return (h // self.patch_size) * (w // self.patch_size) // (self.merge_size**2)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        """The chat template applied to ``messages`` (one ``<|image_pad|>`` per image, not yet expanded)."""
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self._special_tokens
        )

    def tokenize(self, text: str) -> list[int]:
        """Plain tokenisation, special tokens in ``text`` recognised, no BOS added (Qwen has none).

        Same ids as ``tokenizers.Tokenizer.encode(text, add_special_tokens=False)``, faster for chat prompts:
        the tokenizer cuts the text at added tokens (``<|im_start|>``, ``<|image_pad|>``, ...) and tokenizes the
        segments between them independently, so this does the cut itself and remembers each segment's ids.
        An episode's prompt repeats the instruction and the earlier replies every step: only the newest reply is
        tokenized again (1.3 ms -> 0.05 ms per 15-step prompt with the tiny tokenizer; bench_prompt_prefix.py).
        """
        if self._added_split is None:
            return self._tokenizer.encode(text, add_special_tokens=False).ids
        out: list[int] = []
        for i, part in enumerate(self._added_split.split(text)):
            if i % 2:  # split() puts the captured added tokens at odd positions
                out.append(self._added_ids[part])
            elif part:
                ids = self._segment_ids.get(part)
                if ids is None:
                    ids = tuple(self._tokenizer.encode(part, add_special_tokens=False).ids)
                    if len(self._segment_ids) >= SEGMENT_CACHE_SIZE:
                        self._segment_ids.clear()
                    self._segment_ids[part] = ids
                out.extend(ids)
        return out

    def expand_image_pads(self, ids: list[int], image_sizes: list[tuple[int, int]]) -> list[int]:
        """Replace the i-th single ``<|image_pad|>`` by ``image_token_count(*image_sizes[i])`` copies.

        Raises:
            ModelInputError: the number of ``<|image_pad|>`` tokens differs from ``len(image_sizes)``.
        """
        ids = list(ids)
        n_pads = ids.count(self.image_pad_id)
        if n_pads != len(image_sizes):
            raise ModelInputError(f"prompt has {n_pads} image placeholders but {len(image_sizes)} images")
        out: list[int] = []
        start = 0
        for size in image_sizes:  # list.index / slices: C loops over the ~1,000 text ids of a prompt
            pad = ids.index(self.image_pad_id, start)
            out += ids[start:pad]
            out += [self.image_pad_id] * self.image_token_count(*size)
            start = pad + 1
        out += ids[start:]
        return out

    def collapse_image_pads(self, ids: list[int]) -> list[int]:
        """The inverse of `expand_image_pads`: each run of consecutive ``<|image_pad|>`` ids becomes one id.

        This is the prompt form SGLang's ``/generate`` takes with ``input_ids`` + ``image_data`` (actors send it;
        arpo-serve takes both forms). SGLang 0.5.23 keeps these ids verbatim and replaces the i-th
        ``<|image_pad|>`` by its own pad count for image i (``SGLANG_MM_AVOID_RETOKENIZE``, on by default), which
        equals `image_token_count` of the image's real size (same smart_resize, same min/max pixels from
        preprocessor_config.json), so it runs exactly ``encode``'s ids, the ids the learner trains on, as long as
        ``encode`` was given the screenshots' real sizes (tests/integration/test_sglang_prompt_ids.py). Sent
        already expanded, SGLang refuses the request (with transformers 5.24: "The total number of <|image_pad|>
        tokens ... should be the same as the number of images"; with 5.19, its pinned version, the processor
        raises StopIteration in a worker thread and the request is never answered).
        """
        pad = self.image_pad_id
        return [t for i, t in enumerate(ids) if t != pad or i == 0 or ids[i - 1] != pad]

    def encode(self, messages: list[dict], image_sizes: list[tuple[int, int]]) -> list[int]:
        """Prompt token ids for HF chat-format ``messages`` with the generation prompt appended.

        Args:
            messages: ``[{"role": ..., "content": str | [{"type": "image"} | {"type": "text", "text": ...}]}]``.
            image_sizes: ``(width, height)`` in pixels of each image, in the order the images appear.
        Returns:
            token ids, each image's placeholder expanded to its `image_token_count`.
        Raises:
            ModelInputError: image placeholders and ``image_sizes`` disagree in number.
        """
        return self.expand_image_pads(self.tokenize(self.render(messages)), image_sizes)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """Token ids -> text (byte-level BPE decoding)."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _raise_template_error(message: str) -> None:
    raise ModelInputError(f"chat template error: {message}")


# ---------------------------------------------------------------- torch half


def load_policy(model_dir: str | Path, *, dtype: "torch.dtype | None" = None):
    """Load the policy and its image processor from a checkpoint folder.

    Args:
        model_dir: Hugging Face folder of a Qwen2.5-VL / Qwen2-VL checkpoint.
        dtype: parameter dtype, default ``torch.float32``.
    Returns:
        ``(model, image_processor)``; the model is in eval mode on the CPU.
    Raises:
        ModelInputError: the folder cannot be loaded.
    """
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    dtype = torch.float32 if dtype is None else dtype
    try:
        model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=dtype)
        image_processor = AutoImageProcessor.from_pretrained(str(model_dir))
    except (OSError, ValueError) as e:
        raise ModelInputError(f"cannot load policy from {model_dir}: {e}") from e
    model.eval()
    return model, image_processor


def decode_image(data: bytes):
    """PNG/JPEG bytes -> RGB PIL image. Raises ModelInputError on undecodable bytes."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise ModelInputError(f"cannot decode image ({len(data)} bytes): {e}") from e
    return image.convert("RGB")


def image_size(data: bytes) -> tuple[int, int]:
    """PNG/JPEG bytes -> ``(width, height)`` from the header alone: Pillow opens lazily and no pixel is decoded, so
    this costs microseconds whatever the image's size. Raises ModelInputError on bytes Pillow cannot identify, or
    an image over twice Pillow's ``MAX_IMAGE_PIXELS`` (its decompression-bomb error)."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # callers apply their own cap
            with Image.open(io.BytesIO(data)) as image:
                return image.size
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError) as e:
        raise ModelInputError(f"cannot read the image header ({len(data)} bytes): {e}") from e


def pixel_inputs(image_processor, images: list) -> dict:
    """Images (PNG/JPEG bytes or PIL images) -> ``{"pixel_values", "image_grid_thw"}`` tensors.

    Shapes: pixel_values [sum_i t*h*w patches, 3*2*14*14] float32; image_grid_thw [n_images, 3] int64
    (t=1, h and w in 14-pixel patches). Empty ``images`` gives an empty dict.
    """
    if not images:
        return {}
    pil = [decode_image(im) if isinstance(im, (bytes, bytearray, memoryview)) else im for im in images]
    out = image_processor(images=pil, return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def rope_positions(model, input_ids, attention_mask=None, image_grid_thw=None):
    """Qwen2-VL multimodal rotary positions (M-RoPE) for a (left-padded) batch.

    Args:
        model: a Qwen2.5-VL / Qwen2-VL ForConditionalGeneration.
        input_ids: [B, L] int64; attention_mask: [B, L] (1 = token, 0 = padding) or None;
        image_grid_thw: [n_images, 3] or None.
    Returns:
        ``(position_ids [3, B, L], next_position [B])``; ``next_position`` is the position of the next generated
        token (text positions simply count up from there). Source: ``get_rope_index`` of transformers'
        Qwen2.5-VL model, called statelessly so batches and the trainer never share its cached ``rope_deltas``.
    """
    import inspect

    import torch

    inner = model.model
    kwargs: dict[str, Any] = {"image_grid_thw": image_grid_thw, "attention_mask": attention_mask}
    if "mm_token_type_ids" in inspect.signature(inner.get_rope_index).parameters:
        kwargs["mm_token_type_ids"] = mm_token_type_ids(model, input_ids)
    position_ids, _ = inner.get_rope_index(input_ids, **kwargs)
    if attention_mask is not None:
        masked = position_ids.masked_fill(attention_mask[None].to(torch.bool).logical_not(), -1)
        next_position = masked.amax(dim=(0, 2)) + 1
    else:
        next_position = position_ids.amax(dim=(0, 2)) + 1
    return position_ids, next_position


def mm_token_type_ids(model, input_ids):
    """[B, L] int: 1 where ``input_ids`` is the image pad token, 2 for the video pad, else 0."""
    import torch

    cfg = model.config
    out = torch.zeros_like(input_ids, dtype=torch.int32)
    out[input_ids == cfg.image_token_id] = 1
    out[input_ids == cfg.video_token_id] = 2
    return out


def forward_kwargs(model, input_ids, attention_mask=None, pixels: dict | None = None) -> dict:
    """Keyword arguments for a full (prefill or training) forward pass of ``model``: ids, mask, explicit
    M-RoPE ``position_ids`` from `rope_positions`, pixels. Also returns the next position under
    ``"_next_position"`` (pop it before calling the model)."""
    pixels = pixels or {}
    position_ids, next_position = rope_positions(
        model, input_ids, attention_mask, pixels.get("image_grid_thw")
    )
    kw = {"input_ids": input_ids, "position_ids": position_ids, **pixels}
    if attention_mask is not None:
        kw["attention_mask"] = attention_mask
    kw["_next_position"] = next_position
    return kw


def check_image_pads(model, ids, pixels: dict) -> None:
    """Raise ModelInputError unless ``ids`` ([B, L]) hold exactly as many image pad tokens as the vision tower
    makes embeddings for ``pixels["image_grid_thw"]`` (h * w / merge^2 per image; 0 without images)."""
    n_pads = int((ids == model.config.image_token_id).sum())
    grid = pixels.get("image_grid_thw")
    merge = model.config.vision_config.spatial_merge_size
    expected = 0 if grid is None else int((grid.prod(-1) // merge**2).sum())
    if n_pads != expected:
        raise ModelInputError(f"prompt has {n_pads} image pad tokens but the images need {expected}")
