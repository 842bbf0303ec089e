"""The real `arpo-serve` (a subprocess on a free port, a fresh tiny model) against SGLang's API contract:
response shapes, log-probs equal to the trainer's `token_logprobs`, regex-constrained decoding, batching of
concurrent requests, weight updates with versions, pause/continue/abort, and 400s for bad requests."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import aiohttp
import pytest
import torch
from PIL import Image

from arpo_async.model.init_model import create_tiny_model
from arpo_async.model.inputs import PromptEncoder, load_policy
from tests.reference_logprobs import token_logprobs
from tests.support import free_port, until

REPO_ROOT = Path(__file__).resolve().parents[2]
ACTION_REGEX = (
    r"Thought: [a-z ]{1,20}\nAction: (click\(start_box='\([0-9]{1,4},[0-9]{1,4}\)'\)|"
    r"type\(content='[a-z0-9 ]{1,16}'\)|hotkey\(key='[a-z ]{1,12}'\)|wait\(\)|finished\(content='[a-z ]{0,12}'\))"
)
DEADLINE_S = 60



def _png(size=(1280, 720), color=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("serve") / "policy", seed=0)


@pytest.fixture(scope="module")
def server(model_dir):
    """Base URL of a running arpo-serve; waits for its ready line (deadline), stops it afterwards."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "arpo_serve.main", "--model", str(model_dir), "--port", str(port),
         "--max-batch", "16", "--seed", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO_ROOT,
    )
    ready, lines = threading.Event(), []

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("arpo-serve ready"):
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        if not ready.wait(DEADLINE_S):
            pytest.fail("arpo-serve did not become ready:\n" + "".join(lines[-30:]))
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def prompt(model_dir) -> dict:
    """A typical actor request: two screenshots, pads expanded, as base64 image_data."""
    encoder = PromptEncoder(model_dir)
    images = [_png(), _png(color=(20, 90, 200))]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "open the file menu"}, {"type": "image"}]},
        {"role": "assistant", "content": "Thought: click file\nAction: click(start_box='(10,20)')"},
        {"role": "user", "content": [{"type": "image"}]},
    ]
    ids = encoder.encode(messages, [(1280, 720)] * 2)
    return {"input_ids": ids, "images": images, "image_data": [base64.b64encode(b).decode() for b in images]}


async def _post(session: aiohttp.ClientSession, url: str, body=None, *, data: bytes | None = None):
    async with session.post(url, json=body if data is None else None, data=data) as resp:
        return resp.status, (await resp.json(content_type=None) if resp.content_length != 0 else None)


async def _server_state(session, server) -> dict:
    async with session.get(f"{server}/get_server_info") as resp:
        assert resp.status == 200
        return (await resp.json())["internal_states"][0]


async def _wait_for_queue(session, server, depth: int) -> None:
    """Wait (deadline) until `depth` requests are queued on the paused server."""
    await until(lambda: _server_state(session, server), DEADLINE_S, f"{depth} requests queued",
                ok=lambda state: state["queue_depth"] >= depth, every_s=0.02)


async def test_generate_shape_and_logprobs_match_trainer(server, model_dir, prompt):
    body = {"input_ids": prompt["input_ids"], "image_data": prompt["image_data"], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 40, "temperature": 1.0, "ignore_eos": True}}
    async with aiohttp.ClientSession() as s:
        status, out = await _post(s, f"{server}/generate", body)
    assert status == 200, out
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 40}
    assert meta["prompt_tokens"] == len(prompt["input_ids"]) and meta["completion_tokens"] == 40
    assert isinstance(meta["weight_version"], str) and isinstance(meta["id"], str)
    triples = meta["output_token_logprobs"]
    assert [t for _, t, _ in triples] == out["output_ids"] and all(txt is None for _, _, txt in triples)

    model, image_processor = load_policy(model_dir)
    with torch.no_grad():
        reference = token_logprobs(model, image_processor, prompt["input_ids"], prompt["images"], out["output_ids"])
    served = torch.tensor([lp for lp, _, _ in triples])
    assert torch.max(torch.abs(served - reference)) < 1e-4


async def test_sampling_seed_reproduces_and_text_prompt_expands_pads(server, prompt, model_dir):
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>open<|im_end|>\n<|im_start|>assistant\n"
    body = {"text": text, "image_data": "data:image/png;base64," + prompt["image_data"][0],
            "sampling_params": {"max_new_tokens": 12, "sampling_seed": 7, "ignore_eos": True}}
    async with aiohttp.ClientSession() as s:
        (st1, a), (st2, b) = await asyncio.gather(_post(s, f"{server}/generate", body),
                                                  _post(s, f"{server}/generate", body))
    assert st1 == st2 == 200
    assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == 12
    pads = PromptEncoder(model_dir).image_token_count(1280, 720)
    assert pads > 1 and a["meta_info"]["prompt_tokens"] > pads  # the single pad became one per image token


async def test_regex_constrained_outputs_always_match(server, prompt, model_dir):
    end_ids = PromptEncoder(model_dir).eos_token_ids
    body = {"input_ids": prompt["input_ids"], "image_data": prompt["image_data"],
            "sampling_params": {"max_new_tokens": 200, "temperature": 1.0, "regex": ACTION_REGEX}}
    async with aiohttp.ClientSession() as s:
        results = await asyncio.gather(*[_post(s, f"{server}/generate", body) for _ in range(20)])
    texts = set()
    for status, out in results:
        assert status == 200, out
        assert re.fullmatch(ACTION_REGEX, out["text"]), out["text"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        assert out["output_ids"][-1] in end_ids  # the grammar ended with an end token, kept in output_ids
        texts.add(out["text"])
    assert len(texts) > 1  # sampled, not a constant


async def test_concurrent_requests_are_batched(server, prompt):
    body = {"input_ids": prompt["input_ids"], "image_data": prompt["image_data"],
            "sampling_params": {"max_new_tokens": 16}}
    async with aiohttp.ClientSession() as s:
        assert (await _post(s, f"{server}/pause_generation", {"mode": "in_place"}))[0] == 200
        before = await _server_state(s, server)
        tasks = [asyncio.create_task(_post(s, f"{server}/generate", body)) for _ in range(8)]
        await _wait_for_queue(s, server, 8)
        assert not any(t.done() for t in tasks)  # paused: nothing ran
        assert (await _post(s, f"{server}/continue_generation", {}))[0] == 200
        results = await asyncio.gather(*tasks)
        after = await _server_state(s, server)
    assert all(status == 200 and out["meta_info"]["completion_tokens"] > 0 for status, out in results)
    assert after["batches"] == before["batches"] + 1 and after["last_batch_size"] == 8


async def test_batch_body_returns_a_list(server, prompt):
    body = {"input_ids": [prompt["input_ids"], prompt["input_ids"][:-5]],
            "image_data": [prompt["image_data"], prompt["image_data"]],
            "sampling_params": [{"max_new_tokens": 3}, {"max_new_tokens": 5}], "rid": ["a", "b"]}
    async with aiohttp.ClientSession() as s:
        status, out = await _post(s, f"{server}/generate", body)
    assert status == 200 and isinstance(out, list)
    assert [o["meta_info"]["id"] for o in out] == ["a", "b"]
    assert [o["meta_info"]["completion_tokens"] for o in out] in ([3, 5], [3, 1], [3, 2], [3, 3], [3, 4])


async def test_update_weights_changes_logprobs_and_version(server, model_dir, prompt, tmp_path):
    from transformers import AutoModelForImageTextToText

    changed = tmp_path / "changed"
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(changed)

    body = {"input_ids": prompt["input_ids"], "image_data": prompt["image_data"], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}}
    async with aiohttp.ClientSession() as s:
        _, before = await _post(s, f"{server}/generate", body)
        status, upd = await _post(s, f"{server}/update_weights_from_disk",
                                  {"model_path": str(changed), "weight_version": "41"})
        assert status == 200 and upd["success"] is True and set(upd) == {"success", "message", "num_paused_requests"}
        try:
            _, after = await _post(s, f"{server}/generate", body)
            async with s.get(f"{server}/get_model_info") as resp:
                info = await resp.json()
        finally:
            status, _ = await _post(s, f"{server}/update_weights_from_disk",
                                    {"model_path": str(model_dir), "weight_version": "42"})
            assert status == 200
        _, restored = await _post(s, f"{server}/generate", body)

    assert after["meta_info"]["weight_version"] == "41" and info["weight_version"] == "41"
    lp = lambda out: [x for x, _, _ in out["meta_info"]["output_token_logprobs"]]  # noqa: E731
    assert max(abs(a - b) for a, b in zip(lp(before), lp(after))) > 1e-3
    assert restored["output_ids"] == before["output_ids"] and restored["meta_info"]["weight_version"] == "42"
    assert max(abs(a - b) for a, b in zip(lp(before), lp(restored))) < 1e-5
    _, image_processor = load_policy(model_dir)
    with torch.no_grad():  # `model` holds the changed weights the server loaded
        reference = token_logprobs(model.eval(), image_processor, prompt["input_ids"], prompt["images"],
                                   after["output_ids"])
    assert torch.max(torch.abs(torch.tensor(lp(after)) - reference)) < 1e-4


async def test_pause_abort_request_and_continue(server, prompt):
    body = {"input_ids": prompt["input_ids"], "image_data": prompt["image_data"], "rid": "to-abort",
            "sampling_params": {"max_new_tokens": 4}}
    async with aiohttp.ClientSession() as s:
        status, out = await _post(s, f"{server}/pause_generation", {"mode": "retract"})
        assert status == 200 and out["status"] == "ok"
        aborted = asyncio.create_task(_post(s, f"{server}/generate", body))
        kept = asyncio.create_task(_post(s, f"{server}/generate", {**body, "rid": "to-keep"}))
        await _wait_for_queue(s, server, 2)
        assert (await _post(s, f"{server}/abort_request", {"rid": "to-abort"}))[0] == 200
        status, out = await aborted
        assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
        assert not kept.done()
        assert (await _post(s, f"{server}/continue_generation"))[0] == 200
        status, out = await kept
        assert status == 200 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
        async with s.get(f"{server}/health_generate") as resp:
            assert resp.status == 200


async def test_pause_abort_mode_ends_queued_requests(server, prompt):
    body = {"input_ids": prompt["input_ids"], "image_data": prompt["image_data"],
            "sampling_params": {"max_new_tokens": 4}}
    async with aiohttp.ClientSession() as s:
        await _post(s, f"{server}/pause_generation", {"mode": "in_place"})
        queued = asyncio.create_task(_post(s, f"{server}/generate", body))
        await _wait_for_queue(s, server, 1)
        assert (await _post(s, f"{server}/pause_generation", {"mode": "abort"}))[0] == 200
        status, out = await queued
        assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort" and out["output_ids"] == []
        await _post(s, f"{server}/continue_generation")
        status, out = await _post(s, f"{server}/generate",
                                  {**body, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
        assert status == 200 and out["meta_info"]["completion_tokens"] == 4


@pytest.mark.parametrize("path, body, raw, fragment", [
    ("/generate", None, b"{not json", "malformed JSON"),
    ("/generate", None, b"", "empty"),
    ("/generate", {"sampling_params": {}}, None, "text or input_ids"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "many"}}, None, "max_new_tokens"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, None, "temperature"),
    ("/generate", {"input_ids": [1, 10**9]}, None, "input_ids"),
    ("/generate", {"input_ids": [1, 2], "image_data": ["%%%not-base64"]}, None, "image_data"),
    ("/generate", {"input_ids": [1, 2], "image_data": [base64.b64encode(b"junk").decode()]}, None, "image_pad"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"regex": "(["}}, None, "regex"),
    ("/generate", {"input_ids": [1, 2], "stream": True}, None, "stream"),
    ("/update_weights_from_disk", {}, None, "model_path"),
    ("/pause_generation", {"mode": "sideways"}, None, "mode"),
])
async def test_bad_requests_get_400(server, path, body, raw, fragment):
    async with aiohttp.ClientSession() as s:
        status, out = await _post(s, f"{server}{path}", body, data=raw)
        assert status == 400
        assert fragment in out["error"]["message"]
        async with s.get(f"{server}/health") as resp:
            assert resp.status == 200


async def test_image_pad_mismatch_and_bad_checkpoint_get_400(server, prompt, tmp_path):
    async with aiohttp.ClientSession() as s:
        status, out = await _post(s, f"{server}/generate",
                                  {"input_ids": prompt["input_ids"], "image_data": prompt["image_data"][:1]})
        assert status == 400 and "image_pad" in out["error"]["message"]
        status, out = await _post(s, f"{server}/update_weights_from_disk", {"model_path": str(tmp_path)})
        assert status == 400 and out["success"] is False and "safetensors" in out["message"]


async def test_flush_cache_is_refused_while_requests_run_and_allowed_when_paused(server, prompt):
    """SGLang 0.5.23 (managers/scheduler.py flush_cache): refused while a batch runs or requests wait, unless
    generation is paused; a retract pause lets the flush (and so a weight update's flush) through."""
    body = {"input_ids": prompt["input_ids"], "image_data": prompt["image_data"],
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    async with aiohttp.ClientSession() as s:
        long = asyncio.create_task(_post(s, f"{server}/generate", body))
        await until(lambda: _server_state(s, server), DEADLINE_S, "the long request to run",
                    ok=lambda state: state["running_requests"] >= 1, every_s=0.02)
        async with s.post(f"{server}/flush_cache") as resp:
            assert resp.status == 400
        queued = asyncio.create_task(_post(s, f"{server}/generate", {**body, "sampling_params": {"max_new_tokens": 2}}))
        await _wait_for_queue(s, server, 1)
        assert (await _post(s, f"{server}/pause_generation", {"mode": "retract"}))[0] == 200
        assert (await _server_state(s, server))["queue_depth"] == 1  # waiting, not aborted
        async with s.post(f"{server}/flush_cache") as resp:
            assert resp.status == 200
        assert (await _post(s, f"{server}/continue_generation"))[0] == 200
        for task in (long, queued):
            status, out = await task
            assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "length"


async def test_image_files_are_refused_without_an_image_root(server, prompt, tmp_path):
    # serve.image_root is unset by default: no image_data names a host file, whether it exists or not
    shot = tmp_path / "shot.png"
    shot.write_bytes(prompt["images"][0])
    async with aiohttp.ClientSession() as s:
        answers = []
        for item in (str(shot), str(tmp_path / "missing.png")):
            status, out = await _post(s, f"{server}/generate", {"input_ids": prompt["input_ids"],
                                                                "image_data": [item, prompt["image_data"][1]]})
            assert status == 400, out
            answers.append(out["error"]["message"])
    assert answers[0] == answers[1] and "serve.image_root" in answers[0]
