"""A :class:`~actors.policy.Policy` that asks any OpenAI-compatible chat-completions server for each reply.

Role: lets our episode loop score models served by vLLM, SGLang (its ``/v1`` routes), arpo-serve or a hosted API.
The loop hands every policy the chat-templated prompt as token ids (Qwen2.5-VL template, one ``<|image_pad|>``
per image) plus the images' bytes; a chat server wants chat messages instead, so :func:`chat_messages_from_ids`
rebuilds them from the ids exactly (decode, split into ``<|im_start|>role\\n...<|im_end|>`` turns, one OpenAI
image part per ``<|vision_start|><|image_pad|><|vision_end|>``), and :class:`OpenAIChatPolicy` posts them to
``/v1/chat/completions``.

API shape: the OpenAI API reference, "Chat > Create chat completion"
(https://platform.openai.com/docs/api-reference/chat/create): request ``model``, ``messages`` (content parts
``{"type": "text", "text"}`` and ``{"type": "image_url", "image_url": {"url"}}``), ``temperature``, ``top_p``,
``max_tokens``; response ``choices[0].message.content`` and ``choices[0].finish_reason``. SGLang's extra request
field ``regex`` (constrained decoding; SGLang docs, "Structured Outputs" / "OpenAI APIs - Vision", and its
``ChatCompletionRequest`` in python/sglang/srt/entrypoints/openai/protocol.py) is sent only with ``send_regex``.

Errors (so the episode ends ABORTED with a reason, as with PolicyClient): a server that stays unreachable, times
out or answers 5xx through every retry is ``PolicyUnavailable``; a 4xx answer, an oversized or malformed body is
``PolicyRequestError`` at once (retrying cannot fix it).

Invariant: the Generation returned carries text only (no sampled ids or log-probs: evaluation, not training) and
``prompt_tokens`` 0, because the server's token count is of its own template and image processing, not of the
ids the episode would train on (the loop aborts the episode on a mismatch of a non-zero count).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

import aiohttp

from arpo_async.inference_client import (
    Generation,
    HttpClient,
    PolicyRequestError,
    PolicyUnavailable,
    RetryPolicy,
    error_message,
    RetryableError,
    image_data_uri,
)
from arpo_async.model.inputs import IMAGE_PAD, VISION_END, VISION_START, PromptEncoder
from arpo_async.text import loads_json
from actors.policy import text_generation

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END
"""How the Qwen2.5-VL chat template renders one image (before the pad is expanded)."""
GENERATION_PROMPT = IM_START + "assistant\n"
"""What ``add_generation_prompt=True`` appends; dropped from the rebuilt messages (the server adds its own)."""
MAX_RESPONSE_BYTES = 8 * 1024 * 1024
"""Largest response body read from a chat server (a reply of a few hundred tokens is a few KiB)."""
FINISH_REASONS = ("stop", "length", "abort")
"""finish_reason values passed on to the Generation; any other (OpenAI's ``content_filter``, ``tool_calls``)
reads as "stop"."""

_TURN = re.compile(re.escape(IM_START) + r"([^\n]*)\n(.*?)" + re.escape(IM_END) + r"\n?", re.S)


class Decoder(Protocol):
    """What :func:`chat_messages_from_ids` needs of a tokenizer: ``PromptEncoder``, ``tokenizers.Tokenizer`` and
    transformers' tokenizers all have it."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def chat_messages_from_text(text: str, image_urls: Sequence[str]) -> list[dict]:
    """A chat-templated prompt (Qwen2.5-VL / ChatML text) -> OpenAI chat messages.

    Args:
        text: ``<|im_start|>role\\ncontent<|im_end|>\\n`` turns, an image as
            ``<|vision_start|><|image_pad|><|vision_end|>``; a trailing ``<|im_start|>assistant\\n`` (the generation
            prompt) is dropped.
        image_urls: one URL per image placeholder, in prompt order (data URIs here).
    Returns:
        ``[{"role": str, "content": [part, ...]}]`` with parts ``{"type": "text", "text": str}`` and
        ``{"type": "image_url", "image_url": {"url": str}}`` in prompt order (empty text between parts left
        out; a turn with nothing in it has content ``""``). Rendering them with the same chat template gives
        ``text`` back (an ``image_url`` part renders as the image placeholder).
    Raises:
        ValueError: text outside a turn, a stray image token, or placeholders and ``image_urls`` disagree in number.
    """
    if text.endswith(GENERATION_PROMPT):
        text = text[:-len(GENERATION_PROMPT)]
    if text.count(IMAGE_PLACEHOLDER) != len(image_urls):
        raise ValueError(f"the prompt has {text.count(IMAGE_PLACEHOLDER)} image placeholders but {len(image_urls)} "
                         f"images (one {IMAGE_PAD} per image: PromptEncoder.collapse_image_pads)")
    messages: list[dict] = []
    used, pos = 0, 0
    for turn in _TURN.finditer(text):
        if turn.start() != pos:
            raise ValueError(f"prompt text outside a chat turn at character {pos}: {text[pos:turn.start()][:80]!r}")
        pos = turn.end()
        role, body = turn.group(1), turn.group(2)
        pieces = body.split(IMAGE_PLACEHOLDER)
        parts: list[dict] = []
        for i, piece in enumerate(pieces):
            if any(token in piece for token in (IMAGE_PAD, VISION_START, VISION_END)):
                raise ValueError(f"a {role} turn has an image token outside {IMAGE_PLACEHOLDER}")
            if piece:
                parts.append({"type": "text", "text": piece})
            if i < len(pieces) - 1:
                parts.append({"type": "image_url", "image_url": {"url": image_urls[used]}})
                used += 1
        messages.append({"role": role, "content": parts or ""})
    if pos != len(text):
        raise ValueError(f"prompt text outside a chat turn at character {pos}: {text[pos:][:80]!r}")
    return messages


def chat_messages_from_ids(input_ids: Sequence[int], images: Sequence[bytes], tokenizer: Decoder) -> list[dict]:
    """Prompt token ids (one ``<|image_pad|>`` per image) + image bytes -> OpenAI chat messages.

    Decodes ``input_ids`` with special tokens kept and parses the text with :func:`chat_messages_from_text`;
    image ``i`` becomes ``data:image/png;base64,...`` (``image/jpeg`` for JPEG bytes) at the ``i``-th placeholder.

    Args:
        input_ids: length P, as ``PromptEncoder.collapse_image_pads(PromptEncoder.encode(...))`` gives them.
        images: PNG or JPEG bytes, one per placeholder, in prompt order.
        tokenizer: anything with ``decode(ids, skip_special_tokens=False)`` (e.g. a PromptEncoder).
    Raises:
        ValueError: an image is neither PNG nor JPEG, or the text is not a chat prompt (see
            :func:`chat_messages_from_text`).
    """
    text = tokenizer.decode(list(input_ids), skip_special_tokens=False)
    return chat_messages_from_text(text, [image_data_uri(b) for b in images])


def chat_completions_url(url: str) -> str:
    """The chat-completions endpoint for a server URL: ``http://host:port`` and an OpenAI-style base URL
    ``http://host:port/v1`` both give ``.../v1/chat/completions``; a URL already ending in ``/chat/completions``
    is kept."""
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")


def completion_text(body: Any, url: str) -> tuple[str, str]:
    """A chat-completion response -> ``(choices[0].message.content, finish_reason)``.

    ``finish_reason`` is one of :data:`FINISH_REASONS` ("stop" for any other value or none).
    Raises:
        PolicyRequestError: the body is not that shape (``status`` 0, ``body`` the parsed JSON).
    """
    try:
        choice = body["choices"][0]
        content = choice["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise PolicyRequestError(f"malformed chat completion from {url}: no choices[0].message.content",
                                 url=url, body=body) from None
    if not isinstance(content, str):
        raise PolicyRequestError(f"malformed chat completion from {url}: choices[0].message.content is "
                                 f"{type(content).__name__}, not a string", url=url, body=body)
    reason = choice.get("finish_reason") if isinstance(choice, dict) else None
    return content, reason if reason in FINISH_REASONS else "stop"


class OpenAIChatPolicy(HttpClient):
    """The episode loop's :class:`~actors.policy.Policy` on an OpenAI-compatible ``/v1/chat/completions`` server.

    Args:
        url: the server: ``http://host:port``, an OpenAI base URL ending in ``/v1``, or the full endpoint
            (:func:`chat_completions_url`).
        model: the ``model`` field of every request (the server's model name, e.g. from ``GET /v1/models``).
        tokenizer: the policy's tokenizer, to read the prompt ids back: a ``PromptEncoder``, a checkpoint folder
            (a PromptEncoder is loaded from it), or any object with ``decode(ids, skip_special_tokens=False)``.
        api_key: sent as ``Authorization: Bearer <api_key>`` when not empty.
        retry: attempts, backoff and timeouts (``request_timeout_s`` bounds each request, ``connect_timeout_s``
            its TCP connect); connection errors, timeouts and 5xx answers are retried.
        send_regex: send ``sampling_params["regex"]`` as SGLang's ``regex`` field (most servers lack it; off by
            default, so the reply is then unconstrained).
        extra_body: more JSON fields for every request (server-specific knobs such as ``top_k`` or ``seed``);
            they override the fields built here.
        max_response_bytes: a larger response body is a PolicyRequestError.
        max_connections: concurrent connections to the server.

    Create it inside the running event loop; close it with ``aclose`` or ``async with``.
    """

    def __init__(self, url: str, model: str, tokenizer: PromptEncoder | Decoder | str | Path, *, api_key: str = "",
                 retry: RetryPolicy = RetryPolicy(), send_regex: bool = False,
                 extra_body: Mapping[str, Any] | None = None, max_response_bytes: int = MAX_RESPONSE_BYTES,
                 max_connections: int = 256) -> None:
        if not model:
            raise ValueError("OpenAIChatPolicy needs the server's model name")
        self.url = chat_completions_url(url)
        self.model = model
        self.tokenizer: Decoder = PromptEncoder(tokenizer) if isinstance(tokenizer, (str, Path)) else tokenizer
        self.retry = retry
        self.send_regex = send_regex
        self.extra_body = dict(extra_body or {})
        self.max_response_bytes = max_response_bytes
        self._headers = {"Content-Type": "application/json",
                         **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def __repr__(self) -> str:
        return f"OpenAIChatPolicy({self.url!r}, model={self.model!r})"

    def request_body(self, input_ids: Sequence[int], images: Sequence[bytes], sampling_params: Mapping) -> dict:
        """The JSON body for one step: ``model``, ``messages`` (:func:`chat_messages_from_ids`), ``temperature``,
        ``top_p`` and ``max_tokens`` (from ``max_new_tokens``) when ``sampling_params`` has them, ``regex`` with
        ``send_regex``, then ``extra_body``. Raises ValueError like chat_messages_from_ids."""
        body: dict[str, Any] = {"model": self.model,
                                "messages": chat_messages_from_ids(input_ids, images, self.tokenizer)}
        for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("max_new_tokens", "max_tokens")):
            if sampling_params.get(ours) is not None:
                body[theirs] = sampling_params[ours]
        if self.send_regex and sampling_params.get("regex") is not None:
            body["regex"] = sampling_params["regex"]
        return {**body, **self.extra_body}

    async def generate(self, *, input_ids: list[int], images: Sequence[bytes], sampling_params: dict,
                       rid: str, episode_id: str) -> Generation:
        """Ask the server for the next reply of an episode (``rid`` and ``episode_id`` are not sent: the API has
        no such fields).

        Args:
            input_ids: prompt token ids, length P, one ``<|image_pad|>`` per image (the loop's form).
            images: PNG or JPEG bytes, one per image placeholder, in prompt order.
            sampling_params: SGLang sampling params; ``temperature``, ``top_p``, ``max_new_tokens`` (and ``regex``
                with ``send_regex``) are sent, the rest ignored.
        Returns:
            ``text_generation(content)``: the reply text, no sampled ids, ``prompt_tokens`` 0 (module docstring),
            ``latency_s`` of the successful attempt, ``attempts``, ``url`` the endpoint, the server's
            ``finish_reason`` ("stop", "length" or "abort") and ``meta_info`` ``{"id", "model", "usage"}`` as
            the server gave them.
        Raises:
            PolicyUnavailable: unreachable, timed out or 5xx through every retry.
            PolicyRequestError: a 4xx answer (``status``, ``body``), or a 2xx body that is oversized, not JSON or
                has no string ``choices[0].message.content`` (``status`` 0).
            ValueError: the prompt ids are not a chat prompt for these images, or an image is neither PNG nor JPEG.
        """
        # base64 + JSON of megabytes of screenshots: off the event loop
        payload = await asyncio.to_thread(
            lambda: json.dumps(self.request_body(input_ids, images, sampling_params)).encode())
        try:
            async for attempt in self.retry.retrying():  # ends after a success; the last failure is re-raised
                with attempt:
                    answer, elapsed = await self._post(payload)
        except RetryableError as exc:
            raise PolicyUnavailable(f"{self.url} unavailable after {self.retry.attempts} attempts: {exc}") from exc
        text, finish_reason = completion_text(answer, self.url)
        meta = {k: answer.get(k) for k in ("id", "model", "usage")}
        return dataclasses.replace(text_generation(text, prompt_tokens=0, latency_s=elapsed),
                                   finish_reason=finish_reason, attempts=attempt.retry_state.attempt_number,
                                   url=self.url, meta_info=meta)

    async def _post(self, payload: bytes) -> tuple[Any, float]:
        """One POST -> (parsed JSON, seconds). Raises RetryableError (connection error, timeout, 5xx) or
        PolicyRequestError (4xx, oversized or non-JSON body)."""
        started = time.perf_counter()
        try:
            async with self._http().post(self.url, data=payload, headers=self._headers) as resp:
                status = resp.status
                raw = await self._read_bounded(resp)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise RetryableError(f"{type(exc).__name__}: {exc}") from exc
        elapsed = time.perf_counter() - started
        text = raw.decode("utf-8", errors="replace") if raw is not None else ""
        if status >= 500:
            raise RetryableError(f"HTTP {status}: {error_message(text)}")
        if raw is None:
            raise PolicyRequestError(f"{self.url} answered more than {self.max_response_bytes} bytes",
                                     status=status if status >= 400 else 0, url=self.url)
        if status >= 400:
            raise PolicyRequestError(f"{self.url} answered HTTP {status}: {error_message(text)}", status=status,
                                     url=self.url, body=_json_or_text(text))
        try:
            return loads_json(text), elapsed
        except (ValueError, RecursionError):  # not JSON, or nested deeper than the parser goes
            raise PolicyRequestError(f"{self.url} answered HTTP {status} with a body that is not JSON: "
                                     f"{text.strip()[:200]!r}", url=self.url, body=text) from None

    async def _read_bounded(self, resp: aiohttp.ClientResponse) -> bytes | None:
        """The response body, or None once it passes ``max_response_bytes`` (the rest is not read)."""
        if (resp.content_length or 0) > self.max_response_bytes:
            return None
        chunks, size = [], 0
        async for chunk in resp.content.iter_chunked(64 * 1024):
            size += len(chunk)
            if size > self.max_response_bytes:
                return None
            chunks.append(chunk)
        return b"".join(chunks)


def _json_or_text(text: str) -> Any:
    try:
        return loads_json(text) if text else None
    except (ValueError, RecursionError):
        return text
