"""OpenAIChatPolicy (actors.openai_policy) and arpo-serve's OpenAI routes (arpo_serve.openai_api): prompt ids read
back into chat messages, a real episode step's prompt answered by the real arpo-serve on /v1/chat/completions, the
errors the episode loop turns into ABORTED (loopback stand-ins for unreachable, refusing and malformed servers),
and the route's refusals and /v1/models."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json

import aiohttp
import pytest
from aiohttp import web
from PIL import Image

from actors.episode import EpisodeRunner
from actors.openai_policy import OpenAIChatPolicy, chat_completions_url, chat_messages_from_ids
from actors.policy import Policy, PolicyTimeout, as_policy
from actors.uitars import action_regex, build_messages
from arpo_async.prompt import add_box_tokens
from arpo_async.config import load_config
from arpo_async.inference_client import PolicyRequestError, PolicyUnavailable, RetryPolicy
from arpo_async.model.inputs import PromptEncoder
from tests.support import catch_all_http_server, free_port

SCREEN = (320, 200)
INSTRUCTION = "Click the green button"
REPLY = "Thought: the button\nAction: click(start_box='(10,20)')"
SAMPLING = {"max_new_tokens": 12, "temperature": 1.0, "top_p": 0.9, "regex": action_regex(max_thought_chars=8)}
FAST_RETRY = RetryPolicy(attempts=2, base_delay_s=0.01, max_delay_s=0.02, request_timeout_s=10.0,
                         connect_timeout_s=1.0)
COMPLETION = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": REPLY}, "finish_reason": "length"}],
              "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}


def _image(color: str, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", SCREEN, color).save(buf, fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def encoder(tiny_model) -> PromptEncoder:
    return PromptEncoder(tiny_model)


@pytest.fixture(scope="module")
def step(encoder) -> dict:
    """The second step of an episode as the loop builds it: 2 screenshots (a PNG, a JPEG), one earlier reply."""
    prompt = build_messages(INSTRUCTION, [REPLY], history_images=2)
    expanded = encoder.encode(prompt.messages, [SCREEN, SCREEN])
    return {"prompt": prompt, "expanded": expanded, "input_ids": encoder.collapse_image_pads(expanded),
            "images": [_image("red", "PNG"), _image("blue", "JPEG")]}


def _image_parts(messages: list[dict]) -> list[dict]:
    return [p for m in messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image_url"]


def test_ids_to_messages_round_trip(encoder, step):
    messages = chat_messages_from_ids(step["input_ids"], step["images"], encoder)

    assert [m["role"] for m in messages] == ["system", "user", "user", "assistant", "user"]
    urls = [p["image_url"]["url"] for p in _image_parts(messages)]
    assert [u.split(",")[0] for u in urls] == ["data:image/png;base64", "data:image/jpeg;base64"]
    assert [base64.b64decode(u.split(",", 1)[1]) for u in urls] == step["images"]
    assert messages[3]["content"] == [{"type": "text", "text": add_box_tokens(REPLY)}]
    assert messages[0]["content"] == step["prompt"].messages[0]["content"]
    # rendered again with the model's template (image parts as placeholders), they are the very same ids
    as_template = [{"role": m["role"], "content": [{"type": "image"} if p["type"] == "image_url" else p
                                                   for p in m["content"]]} for m in messages]
    assert encoder.encode(as_template, [SCREEN, SCREEN]) == step["expanded"]
    assert encoder.tokenize(encoder.render(messages)) == step["input_ids"]


def test_ids_to_messages_refuses_a_count_mismatch(encoder, step):
    with pytest.raises(ValueError, match="2 image placeholders but 1 images"):
        chat_messages_from_ids(step["input_ids"], step["images"][:1], encoder)
    with pytest.raises(ValueError, match="outside a chat turn"):
        chat_messages_from_ids(encoder.tokenize("no chat here"), [], encoder)


async def test_endpoint_url_forms_and_policy_protocol(encoder):
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/chat/completions"):
        assert chat_completions_url(url) == "http://h:1/v1/chat/completions"
    policy = OpenAIChatPolicy("http://h:1", "m", encoder)
    assert isinstance(policy, Policy) and as_policy(policy) is policy


async def test_generate_on_real_arpo_serve(tiny_serve, tiny_model, step):
    async with OpenAIChatPolicy(tiny_serve.url, str(tiny_model), tiny_model) as policy:
        body = policy.request_body(step["input_ids"], step["images"], SAMPLING)
        gen = await policy.generate(input_ids=step["input_ids"], images=step["images"], sampling_params=SAMPLING,
                                    rid="r-0", episode_id="e-0")

    assert len(_image_parts(body["messages"])) == 2
    assert (body["max_tokens"], body["temperature"], body["top_p"]) == (12, 1.0, 0.9)
    assert "regex" not in body
    assert isinstance(gen.text, str) and gen.output_ids == [] and gen.prompt_tokens == 0
    assert gen.finish_reason in ("stop", "length") and gen.attempts == 1 and gen.latency_s > 0
    usage = gen.meta_info["usage"]
    # the server ran exactly the ids the learner would train on: both images arrived, with the same pad counts
    assert usage["prompt_tokens"] == len(step["expanded"])
    assert 1 <= usage["completion_tokens"] <= 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_unreachable_server_is_unavailable_after_retries(tiny_model, step):
    async with OpenAIChatPolicy(f"http://127.0.0.1:{free_port()}", "m", tiny_model, retry=FAST_RETRY) as policy:
        with pytest.raises(PolicyUnavailable, match="after 2 attempts"):
            await policy.generate(input_ids=step["input_ids"], images=step["images"], sampling_params=SAMPLING,
                                  rid="r", episode_id="e")


def _stand_in(status: int, body: str | dict, seen: list[dict]):
    """A loopback chat server answering every request with ``status`` and ``body``; records each request."""
    async def handler(request: web.Request) -> web.Response:
        seen.append({"path": request.path, "headers": dict(request.headers), "json": await request.json()})
        payload = json.dumps(body) if isinstance(body, dict) else body
        return web.Response(status=status, body=payload, content_type="application/json")

    return catch_all_http_server(handler)


@pytest.mark.parametrize("status, body, attempts, error, match", [
    (503, {"error": {"message": "overloaded"}}, 2, PolicyUnavailable, "HTTP 503: overloaded"),
    (400, {"error": {"message": "prompt too long"}}, 1, PolicyRequestError, "HTTP 400: prompt too long"),
    (401, {"error": {"message": "bad key"}}, 1, PolicyRequestError, "HTTP 401: bad key"),
    (200, "<html>not json</html>", 1, PolicyRequestError, "not JSON"),
    (200, {"choices": []}, 1, PolicyRequestError, r"no choices\[0\]\.message\.content"),
    (200, {"choices": [{"message": {"content": None}}]}, 1, PolicyRequestError, "NoneType, not a string"),
    (200, "x" * (64 * 1024 + 1), 1, PolicyRequestError, "more than 65536 bytes"),
])
async def test_refusing_and_malformed_servers(tiny_model, step, status, body, attempts, error, match):
    seen: list = []
    async with _stand_in(status, body, seen) as url:
        async with OpenAIChatPolicy(url, "m", tiny_model, retry=FAST_RETRY,
                                    max_response_bytes=64 * 1024) as policy:
            with pytest.raises(error, match=match) as caught:
                await policy.generate(input_ids=step["input_ids"], images=step["images"],
                                      sampling_params=SAMPLING, rid="r", episode_id="e")
    assert len(seen) == attempts
    if error is PolicyRequestError and status >= 400:
        assert caught.value.status == status and caught.value.body == body


async def test_a_server_slower_than_the_timeout_is_unavailable(tiny_model, step):
    calls = []

    async def slow(request: web.Request) -> web.Response:
        calls.append(request.path)
        await asyncio.sleep(2)
        return web.json_response(COMPLETION)

    retry = dataclasses.replace(FAST_RETRY, request_timeout_s=0.3)
    async with catch_all_http_server(slow) as url:
        async with OpenAIChatPolicy(url, "m", tiny_model, retry=retry) as policy:
            with pytest.raises(PolicyUnavailable, match="TimeoutError"):
                await policy.generate(input_ids=step["input_ids"], images=step["images"],
                                      sampling_params=SAMPLING, rid="r", episode_id="e")
    assert len(calls) == 2


async def test_a_never_answering_server_is_cut_at_the_episode_policy_deadline(encoder, step):
    """A server that accepts the request and never answers (request timeout 600 s, 6 tries): the episode's policy
    call ends at actors.policy_timeout_s with PolicyTimeout, a PolicyUnavailable (so the episode is ABORTED), after
    one request. On b190f2c there was no such key and the call waited up to 6 x 600 s."""
    requests: list[str] = []
    release = asyncio.Event()

    async def never_answers(request: web.Request) -> web.Response:
        requests.append(request.path)
        await release.wait()  # held open until the test ends
        return web.Response(status=503)

    actors = load_config(None, ["actors.policy_timeout_s=0.5"]).actors
    async with catch_all_http_server(never_answers) as url:
        try:
            async with OpenAIChatPolicy(url, "m", encoder, retry=RetryPolicy(attempts=6)) as policy:
                runner = EpisodeRunner(encoder, policy, actors)
                async with asyncio.timeout(120):  # the test's own bound, far below one request's 600 s
                    with pytest.raises(PolicyTimeout, match=r"at .*/v1/chat/completions for request r-0 within "
                                                            r"actors\.policy_timeout_s = 0\.5 s") as caught:
                        await runner._generate(input_ids=step["input_ids"], images=step["images"],
                                               sampling_params=SAMPLING, rid="r-0", episode_id="e-0")
        finally:
            release.set()
    assert isinstance(caught.value, PolicyUnavailable)
    assert requests == ["/v1/chat/completions"]


async def test_request_fields_key_and_regex(tiny_model, step):
    seen: list = []
    async with _stand_in(200, COMPLETION, seen) as url:
        async with OpenAIChatPolicy(url + "/v1", "served-name", PromptEncoder(tiny_model), api_key="k3y",
                                    send_regex=True, extra_body={"top_k": 5}) as policy:
            gen = await policy.generate(input_ids=step["input_ids"], images=step["images"],
                                        sampling_params=SAMPLING, rid="r", episode_id="e")
    [request] = seen
    assert request["path"] == "/v1/chat/completions"
    assert request["headers"]["Authorization"] == "Bearer k3y"
    sent = request["json"]
    assert sent["model"] == "served-name" and sent["regex"] == SAMPLING["regex"] and sent["top_k"] == 5
    assert len(_image_parts(sent["messages"])) == 2
    assert (gen.text, gen.finish_reason, gen.prompt_tokens) == (REPLY, "length", 0)
    assert gen.url == url + "/v1/chat/completions"


async def _post(url: str, path: str, payload: dict | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        method = http.post(url + path, json=payload) if payload is not None else http.get(url + path)
        async with method as resp:
            return resp.status, await resp.json()


@pytest.mark.parametrize("image_url", ["http://example.com/a.png", "/etc/hostname", "file:///etc/hostname"])
async def test_chat_route_refuses_image_urls_and_host_paths(tiny_serve, image_url):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                             {"type": "text", "text": "what is this?"}]}]
    status, body = await _post(tiny_serve.url, "/v1/chat/completions", {"model": "m", "messages": messages})
    assert status == 400 and "data: URL" in body["error"]["message"]


async def test_chat_route_text_only_and_models(tiny_serve, tiny_model):
    status, body = await _post(tiny_serve.url, "/v1/chat/completions", {
        "model": "anything", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3,
        "temperature": 0})
    assert status == 200, body
    assert body["object"] == "chat.completion" and body["model"] == str(tiny_model)
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length") and body["usage"]["completion_tokens"] <= 3

    status, body = await _post(tiny_serve.url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "n": 2})
    assert status == 400 and "n must be 1" in body["error"]["message"]

    status, body = await _post(tiny_serve.url, "/v1/models")
    assert status == 200 and body["object"] == "list"
    assert [(m["id"], m["object"]) for m in body["data"]] == [(str(tiny_model), "model")]
