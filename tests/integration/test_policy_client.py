"""PolicyClient against the real arpo-serve (a subprocess on a free port with the tiny model), and against a
loopback aiohttp server standing in for a misbehaving SGLang (5xx, malformed answers, weight_versions spans)."""

from __future__ import annotations

import asyncio
import io
import math
import time
from pathlib import Path

import pytest

from arpo_async.inference_client import (
    Generation,
    PolicyClient,
    PolicyRequestError,
    PolicyUnavailable,
    RetryPolicy,
    image_data_uri,
)
from arpo_async.sglang_engine import SGLangEngine
from actors.uitars import action_regex, build_messages, parse_reply
from tests.support import ServeProcess, free_port

SCREEN = (1280, 720)
SMALL_REGEX = action_regex(max_thought_chars=8, max_coord_digits=3, max_text_chars=6)
SAMPLING = {"max_new_tokens": 160, "temperature": 1.0, "regex": SMALL_REGEX}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from arpo_async.model.init_model import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("policy-client") / "tiny")


@pytest.fixture(scope="module")
def encoder(tiny_model):
    from arpo_async.model.inputs import PromptEncoder

    return PromptEncoder(tiny_model)


def _screenshot(seed: int) -> bytes:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", SCREEN, "white")
    draw = ImageDraw.Draw(img)
    draw.rectangle([50 + seed * 40, 60, 300 + seed * 40, 200], fill=(20 * seed % 255, 90, 200))
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()


def _check_generation(g: Generation) -> None:
    n = len(g.output_ids)
    assert n > 0 and len(g.logprobs) == n and len(g.token_versions) == n
    assert all(math.isfinite(lp) and lp <= 0.0 for lp in g.logprobs)
    assert g.token_versions == [g.weight_version] * n


# ------------------------------------------------------------------------------------------- real arpo-serve

async def test_regex_constrained_episode_parses_every_step(tiny_serve, encoder):
    """Two steps of an episode: prompt -> tokens + screenshots -> /generate (regex) -> parse_reply."""
    shots = [_screenshot(0), _screenshot(1)]
    replies: list[str] = []
    async with PolicyClient([tiny_serve.url]) as client:
        info = await SGLangEngine(client, tiny_serve.url).server_info()
        for step in range(2):
            prompt = build_messages("open the file menu", replies, history_images=2)
            images = [shots[i] for i in prompt.image_indices]
            input_ids = encoder.encode(prompt.messages, [SCREEN] * len(images))
            g = await client.generate(input_ids=input_ids, images=images, sampling_params=SAMPLING,
                                      rid=f"ep1-{step}", episode_id="ep1")
            _check_generation(g)
            assert (g.finish_reason, g.attempts, g.url) == ("stop", 1, tiny_serve.url)
            assert g.prompt_tokens == len(input_ids)
            assert g.weight_version == int(info["weight_version"])
            parsed = parse_reply(g.text, resized_size=encoder.resized_size(*SCREEN), screen_size=SCREEN)
            for a in parsed.actions:
                if a.point is not None:
                    assert 0 <= a.point[0] <= SCREEN[0] - 1 and 0 <= a.point[1] <= SCREEN[1] - 1
            replies.append(g.text)
        assert prompt.image_indices == [0, 1]


async def test_request_errors_are_4xx_and_not_retried(tiny_serve, encoder):
    prompt = build_messages("task", [])
    ids = encoder.encode(prompt.messages, [SCREEN])
    slow_retry = RetryPolicy(attempts=5, base_delay_s=5.0, max_delay_s=5.0)
    async with PolicyClient([tiny_serve.url], retry=slow_retry) as client:
        started = time.monotonic()
        with pytest.raises(PolicyRequestError) as err:  # one image placeholder, two images
            await client.generate(input_ids=ids, images=[_screenshot(0), _screenshot(1)],
                                  sampling_params=SAMPLING, rid="bad-1", episode_id="e")
        assert err.value.status == 400 and "image" in str(err.value)
        with pytest.raises(PolicyRequestError) as err:
            await client.generate(input_ids=ids, images=[_screenshot(0)],
                                  sampling_params={"max_new_tokens": 4, "regex": "(unclosed"},
                                  rid="bad-2", episode_id="e")
        assert err.value.status == 400
        # a retry would have waited 5 s first
        assert time.monotonic() - started < 4.0
    with pytest.raises(ValueError, match="neither PNG nor JPEG"):
        image_data_uri(b"GIF89a...")


async def test_weight_publisher_calls(tiny_serve, tiny_model, encoder):
    prompt = build_messages("task", [])
    ids = encoder.encode(prompt.messages, [SCREEN])
    async with PolicyClient([tiny_serve.url]) as client:
        engine = SGLangEngine(client, tiny_serve.url)
        assert await client.health() and await engine.healthy()
        assert (await engine.pause()).ok
        reply = await engine.load_weights_from_disk(str(tiny_model), 7)
        assert (await engine.resume()).ok
        assert reply.ok, reply
        assert (await engine.server_info())["weight_version"] == "7" and await engine.weight_version() == 7
        g = await client.generate(input_ids=ids, images=[_screenshot(0)], sampling_params=SAMPLING,
                                  rid="after-update", episode_id="e")
        _check_generation(g)
        assert g.weight_version == 7 and set(g.token_versions) == {7}
        refused = await engine.load_weights_from_disk(str(tiny_model / "missing"), 8)
        assert not refused.ok and refused.message
        assert await engine.weight_version() == 7
        with pytest.raises(ValueError, match="pause mode"):
            await engine.pause(mode="nap")


async def test_server_down_then_back_on_the_same_port(tiny_model, encoder, tmp_path):
    proc = ServeProcess(tiny_model, free_port(), tmp_path)
    proc.start()
    prompt = build_messages("task", [])
    ids = encoder.encode(prompt.messages, [SCREEN])
    request = dict(input_ids=ids, images=[_screenshot(0)], sampling_params=SAMPLING, episode_id="e")
    try:
        async with PolicyClient([proc.url], retry=RetryPolicy(attempts=3, base_delay_s=0.05,
                                                              max_delay_s=0.1)) as short:
            _check_generation(await short.generate(rid="up", **request))
            proc.stop()
            assert not await short.health()
            with pytest.raises(PolicyUnavailable, match=r"unavailable after 3 attempts"):
                await short.generate(rid="down", **request)

        # Down at the first attempt (connection refused at once); the server needs seconds to come back, well
        # inside this window of about 60 s of retries.
        patient = RetryPolicy(attempts=120, base_delay_s=0.1, max_delay_s=0.5)
        async with PolicyClient([proc.url], retry=patient) as client:
            pending = asyncio.create_task(client.generate(rid="retried", **request))
            await asyncio.to_thread(proc.start)
            g = await asyncio.wait_for(pending, timeout=120)
            _check_generation(g)
            assert g.attempts > 1 and g.finish_reason == "stop"
            assert await client.health()
    finally:
        proc.stop()


def test_server_for_is_stable_and_spreads_episodes():
    urls = ["http://a:1", "http://b:2/", "http://c:3"]
    one, two = PolicyClient(urls), PolicyClient(list(urls))
    picks = [one.server_for(f"episode-{i}") for i in range(300)]
    assert picks == [two.server_for(f"episode-{i}") for i in range(300)]
    assert set(picks) == {"http://a:1", "http://b:2", "http://c:3"}
    assert one.server_for("episode-7") == one.server_for("episode-7")
    with pytest.raises(ValueError, match="at least one"):
        PolicyClient([])
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)
