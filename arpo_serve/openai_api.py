"""The OpenAI-compatible routes of `arpo-serve`: POST /v1/chat/completions and GET /v1/models.

Role: lets OpenAI-style clients (``actors.openai_policy.OpenAIChatPolicy``, the ``openai`` package, ``arpo eval
--openai-url``) use the tiny policy as they would SGLang's or vLLM's ``/v1`` routes. A chat request is turned into
what /generate runs: the model's chat template renders the messages with one ``<|image_pad|>`` per image, the
prompt is tokenized, and `Engine.prepare` checks it and its images against the same bounds as /generate
(context length, image count and pixels, checked from the headers before any pixel is decoded).

Shapes: the OpenAI API reference, "Chat > Create chat completion" and "Models > List models"
(https://platform.openai.com/docs/api-reference/chat/create, .../models/list); SGLang's extra request fields
(``regex``, ``ebnf``, ``top_k``, ``min_p``, ``stop_token_ids``, ``ignore_eos``, ``no_stop_trim``,
``skip_special_tokens``, ``rid``) as its ``ChatCompletionRequest`` names them (python/sglang/srt/entrypoints/openai/
protocol.py). Images come only as ``data:`` URLs: arpo-serve fetches nothing and reads no host files here.
Bad requests get 400 with ``{"error": {"message"}}`` (app.py's middleware), as on every other route.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from arpo_serve.app_keys import ENGINE_KEY, SCHEDULER_KEY
from arpo_serve.engine import Engine, GenerationResult, PreparedRequest, RequestError, SamplingParams
from arpo_serve.protocol import decode_image_data
from arpo_serve.route_helpers import ClientGone, compiled_grammars, json_body, run_while_connected

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
"""Message roles the chat template renders."""
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "stop": "stop", "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos",
                   "no_stop_trim": "no_stop_trim", "skip_special_tokens": "skip_special_tokens",
                   "regex": "regex", "ebnf": "ebnf", "seed": "sampling_seed"}
"""Chat request field -> SamplingParams field (``max_tokens`` / ``max_completion_tokens`` are handled apart)."""


def served_model_name(engine: Engine) -> str:
    """The model's name on the /v1 routes: its folder, as /get_model_info's ``served_model_name`` (SGLang's
    default is the model path too)."""
    return str(engine.model_dir)


def _image_bytes(part: dict) -> bytes:
    """An ``image_url`` content part -> image bytes. Only ``data:`` URLs; RequestError otherwise."""
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str):
        raise RequestError("an image_url part needs image_url.url (a data: URL)")
    if not url.startswith("data:"):
        raise RequestError("image_url must be a data: URL (data:image/png;base64,...): arpo-serve fetches no URLs "
                           "and reads no host files on /v1/chat/completions")
    return decode_image_data(url)


def template_messages(messages: Any) -> tuple[list[dict], list[bytes]]:
    """OpenAI chat ``messages`` -> (messages for the chat template, image bytes in prompt order).

    Text parts stay ``{"type": "text", "text"}``, each ``image_url`` part becomes ``{"type": "image"}`` (one
    ``<|image_pad|>`` in the rendered prompt); string content stays a string.
    Raises:
        RequestError: not a non-empty list of ``{"role": system|user|assistant, "content": str | [part]}``, an
            unknown part type, or an image that is not a base64 ``data:`` URL.
    """
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    out: list[dict] = []
    images: list[bytes] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise RequestError(f"messages[{i}] must be an object with role one of {ROLES}")
        content = message.get("content")
        if content is None or isinstance(content, str):
            out.append({"role": message["role"], "content": content or ""})
            continue
        if not isinstance(content, list):
            raise RequestError(f"messages[{i}].content must be a string or a list of content parts")
        parts: list[dict] = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url":
                images.append(_image_bytes(part))
                parts.append({"type": "image"})
            else:
                raise RequestError(f"messages[{i}].content has a part that is neither text (with a string text) "
                                   f"nor image_url: {str(part)[:100]}")
        out.append({"role": message["role"], "content": parts})
    return out, images


def sampling_params(body: dict) -> SamplingParams:
    """The chat request's sampling fields -> SamplingParams (``max_completion_tokens``, else ``max_tokens``, is
    ``max_new_tokens``; ``seed`` is ``sampling_seed``). Raises RequestError on a bad value, ``n`` other than 1 or
    ``stream``."""
    if body.get("stream"):
        raise RequestError("stream=true is not supported by arpo-serve")
    if body.get("n", 1) != 1:
        raise RequestError("n must be 1 on arpo-serve")
    params = {ours: body[theirs] for theirs, ours in SAMPLING_FIELDS.items() if body.get(theirs) is not None}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        params["max_new_tokens"] = max_tokens
    return SamplingParams.from_json(params)


def prepare_chat(engine: Engine, body: dict, compiled=None) -> PreparedRequest:
    """Blocking: validate a chat request, render and tokenize its prompt (one pad per image), and prepare it as
    /generate would (`Engine.prepare`: bounds, pad expansion, pixels, grammar; ``compiled``: its compiled grammar,
    if already waited for). Raises RequestError."""
    messages, images = template_messages(body.get("messages"))
    params = sampling_params(body)
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise RequestError("rid must be a string")
    ids = engine.encoder.tokenize(engine.encoder.render(messages))
    return engine.prepare(rid or f"chatcmpl-{uuid.uuid4().hex}", ids, images, params, compiled=compiled)


def chat_completion(result: GenerationResult, model: str) -> dict:
    """OpenAI's chat.completion object for one finished request (``finish_reason`` "stop", "length" or, for a
    request the server aborted, "abort" as SGLang reports it)."""
    completion = len(result.output_ids)
    return {
        "id": result.rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                     "finish_reason": result.finish_reason.get("type") or "stop"}],
        "usage": {"prompt_tokens": result.prompt_tokens, "completion_tokens": completion,
                  "total_tokens": result.prompt_tokens + completion},
    }


async def chat_completions(request: web.Request) -> web.Response:
    """POST /v1/chat/completions {model, messages, temperature?, top_p?, max_tokens?, ...} -> chat.completion.
    ``model`` is not checked (SGLang serves its one model whatever the name). A client that disconnects aborts
    its request, as on /generate."""
    engine = request.app[ENGINE_KEY]
    body = await json_body(request)
    [compiled] = await compiled_grammars(request, [sampling_params(body)])  # waits holding no thread
    prepared = await asyncio.to_thread(prepare_chat, engine, body, compiled)
    try:
        [result] = await run_while_connected(request, request.app[SCHEDULER_KEY], [prepared])
    except ClientGone as e:
        log.info("%s", e)
        return web.Response(status=499)  # nobody reads it
    return web.json_response(chat_completion(result, served_model_name(engine)))


async def list_models(request: web.Request) -> web.Response:
    """GET /v1/models -> ``{"object": "list", "data": [{"id", "object": "model", "created", "owned_by",
    "root", "max_model_len"}]}`` (SGLang's ModelCard fields)."""
    engine = request.app[ENGINE_KEY]
    name = served_model_name(engine)
    return web.json_response({"object": "list", "data": [{
        "id": name, "object": "model", "created": int(time.time()), "owned_by": "arpo-serve", "root": name,
        "max_model_len": engine.max_context_tokens}]})


def add_openai_routes(router: web.UrlDispatcher) -> None:
    """Register POST /v1/chat/completions and GET /v1/models."""
    router.add_post("/v1/chat/completions", chat_completions)
    router.add_get("/v1/models", list_models)
