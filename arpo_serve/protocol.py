"""SGLang's /generate request and response shapes, for `arpo-serve`.

Role: turn a JSON body into validated single requests and a `GenerationResult` into SGLang's response map. Field
names follow sglang's ``GenerateReqInput`` (python/sglang/srt/managers/io_struct.py) and the meta_info its
tokenizer manager returns: ``text``, ``output_ids``, ``meta_info`` {``id``, ``finish_reason``, ``prompt_tokens``,
``completion_tokens``, ``cached_tokens``, ``weight_version``, ``e2e_latency``, and with ``return_logprob``
``input_token_logprobs`` / ``output_token_logprobs`` as ``[logprob, token_id, text or null]`` triples}.

A body is a single request, or a batch when ``text`` is a list of strings or ``input_ids`` a list of lists; then
``image_data``, ``sampling_params``, ``rid``, ``return_logprob`` and ``logprob_start_len`` may be lists of the
same length (or one value for all) and the response is a list.
"""

from __future__ import annotations

import base64
import binascii
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from arpo_serve.engine import GenerationResult, RequestError, SamplingParams


@dataclass(frozen=True)
class GenerateInput:
    """One /generate request after JSON validation (images still encoded)."""

    rid: str
    text: str | None
    input_ids: list[int] | None
    image_data: list[str] = field(default_factory=list)
    sampling_params: SamplingParams = SamplingParams()
    return_logprob: bool = False
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False


def parse_generate(body: Any) -> tuple[list[GenerateInput], bool]:
    """Validate a /generate body. Returns ``(requests, is_batch)``. Raises RequestError naming the bad field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if body.get("stream"):
        raise RequestError("stream=true is not supported by arpo-serve")
    if body.get("input_embeds") is not None:
        raise RequestError("input_embeds is not supported by arpo-serve")
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise RequestError("exactly one of text or input_ids must be given")
    if text is not None:
        is_batch = isinstance(text, list)
        prompts = text if is_batch else [text]
        if not prompts or not all(isinstance(t, str) for t in prompts):
            raise RequestError("text must be a string or a non-empty list of strings")
    else:
        if not isinstance(input_ids, list) or not input_ids:
            raise RequestError("input_ids must be a non-empty list of integers (or of lists)")
        is_batch = isinstance(input_ids[0], list)
        prompts = input_ids if is_batch else [input_ids]
        for ids in prompts:
            if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
                raise RequestError("input_ids must be a non-empty list of integers (or of lists)")
    n = len(prompts)
    images = _per_item(body.get("image_data"), n, is_batch, "image_data", is_list_value=True)
    params = _per_item(body.get("sampling_params"), n, is_batch, "sampling_params")
    rids = _per_item(body.get("rid"), n, is_batch, "rid")
    logprob = _per_item(body.get("return_logprob"), n, is_batch, "return_logprob")
    starts = _per_item(body.get("logprob_start_len"), n, is_batch, "logprob_start_len")
    with_text = bool(body.get("return_text_in_logprobs", False))
    out = []
    for i in range(n):
        start = -1 if starts[i] is None else starts[i]
        if type(start) is not int or start < -1:
            raise RequestError("logprob_start_len must be an integer >= -1")
        rid = rids[i] if rids[i] is not None else uuid.uuid4().hex
        if not isinstance(rid, str):
            raise RequestError("rid must be a string")
        out.append(GenerateInput(
            rid=rid,
            text=prompts[i] if text is not None else None,
            input_ids=prompts[i] if input_ids is not None else None,
            image_data=_image_list(images[i]),
            sampling_params=SamplingParams.from_json(params[i]),
            return_logprob=bool(logprob[i]),
            logprob_start_len=start,
            return_text_in_logprobs=with_text,
        ))
    return out, is_batch


def _per_item(value: Any, n: int, is_batch: bool, name: str, *, is_list_value: bool = False) -> list:
    """Spread a field over the batch: one value for all, or a list with one value per item."""
    if not is_batch:
        return [value]
    if isinstance(value, list) and (not is_list_value or value == [] or len(value) == n):
        if len(value) != n:
            raise RequestError(f"{name} has {len(value)} entries for a batch of {n}")
        return value
    return [value] * n


def _image_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise RequestError("image_data must be a string or a list of strings (base64, data URI or file path)")


def decode_image_data(item: str, image_root: Path | None = None) -> bytes:
    """An ``image_data`` entry -> image bytes: a data URI, plain base64, or a local file named by an absolute path
    or a ``file://`` URI (as SGLang's ``load_image``) that lies under ``image_root`` (symlinks resolved). URLs are
    refused: arpo-serve fetches nothing. Raises RequestError.

    Whether an entry is base64 is decided from the string alone, never by looking at the disk, and a file outside
    ``image_root`` (or any file when it is None, the default) is refused with one message whether it exists or
    not, so a refusal tells a client nothing about the host's files."""
    if item.startswith(("http://", "https://")):
        raise RequestError("image URLs are not supported by arpo-serve; send base64 data")
    if item.startswith("data:"):
        _, _, payload = item.partition(",")
        return _base64(payload)
    if not item.startswith(("/", "file://")):
        return _base64(item)
    try:
        return base64.b64decode(item, validate=True)  # plain base64 may start with "/" (JPEG: "/9j/")
    except (binascii.Error, ValueError):
        pass
    path = unquote(urlparse(item).path) if item.startswith("file://") else item
    if image_root is None:
        raise RequestError("image_data names a local file, and arpo-serve reads no local files unless "
                           "serve.image_root (--image-root) is set: send the image as base64 or a data URI")
    resolved = Path(path).resolve()
    if not resolved.is_relative_to(image_root):
        raise RequestError(f"image_data names a file outside serve.image_root ({image_root}): arpo-serve reads "
                           "local images only under it; send the image as base64 or a data URI")
    try:
        return resolved.read_bytes()
    except OSError as e:  # under the allowed folder only: naming why is safe there
        raise RequestError(f"cannot read image_data file {path}: {e.strerror}") from e


def _base64(payload: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RequestError(f"image_data is neither base64 nor a file path: {e}") from e


def generate_response(req: GenerateInput, result: GenerationResult, input_ids: list[int], e2e_latency: float,
                      decode_token) -> dict:
    """SGLang's /generate response map for one finished request.

    ``input_ids`` are the prompt ids as run (pads expanded); ``decode_token(id) -> str`` gives logprob texts."""
    meta: dict[str, Any] = {
        "id": result.rid,
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": len(result.output_ids),
        "cached_tokens": 0,
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "weight_version": result.weight_version,
        "e2e_latency": e2e_latency,
    }
    if req.return_logprob:
        text = decode_token if req.return_text_in_logprobs else (lambda _id: None)
        meta["output_token_logprobs"] = [[lp, t, text(t)] for lp, t in zip(result.output_logprobs, result.output_ids)]
        meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
        start = max(req.logprob_start_len, 0)
        meta["input_token_logprobs"] = [
            [lp, t, text(t)] for lp, t in zip(result.input_logprobs, input_ids[start:])
        ] if req.logprob_start_len >= 0 else []
    return {"text": result.text, "output_ids": result.output_ids, "meta_info": meta}


def error_body(message: str) -> dict:
    """SGLang's error shape (http_server.py ``_create_error_response``)."""
    return {"error": {"message": message}}
