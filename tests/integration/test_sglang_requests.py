"""Every request our code sends, and every response arpo-serve sends, checked against SGLang 0.5.23's own types
(run in the SGLang test environment: tests/sglang_contract.py, see tests/sglang_env.py).

- requests: PolicyClient's and SGLangEngine's bodies, recorded by a local aiohttp server, decode into SGLang's request types with
  no unknown, missing or mistyped field: /generate through SGLang's HTTP contract gate, GenerateReqInput and
  SamplingParams (the actor's real sampling parameters, action regex included) and its image loader; every
  weight, pause and continue route into its io_struct type;
- responses: what a real arpo-serve answers has what SGLang's http_server.py and TokenizerManager put in their
  answers (the /generate meta_info keys, {success, message} of the weight routes, /weights_checker's
  ChecksumInfo ranks and checksums, the pause/continue, /health and /flush_cache bodies, the api contract's
  GetServerInfoResponse and /model_info keys).
"""

from __future__ import annotations

import json
import select
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from actors.episode import EpisodeRunner
from arpo_async.config import ActorConfig
from arpo_async.inference_client import PolicyClient, RetryPolicy, image_data_uri
from arpo_async.model.inputs import PromptEncoder
from arpo_async.sglang_engine import SGLangEngine
from tests.rank_driver import screenshot
from tests.support import catch_all_http_server

CONTRACT = Path(__file__).resolve().parents[1] / "sglang_contract.py"


RESULTS_PREFIX = "RESULTS "
"""What starts the contract's answer lines (tests/sglang_contract.py's RESULTS_PREFIX; that module is not imported
here: it runs in the SGLang environment and silences warnings when imported)."""
ANSWER_DEADLINE_S = 180.0
"""How long one check may take, SGLang's imports (about 30 s on a loaded 2-core machine) included."""


class Contract:
    """tests/sglang_contract.py ``--lines`` in the SGLang environment, one process for the module (SGLang's imports
    are most of a check's time): :meth:`check` sends one line of exchanges and reads the answer line."""

    def __init__(self, python: Path, log: Path) -> None:
        self.log = log
        with open(log, "w") as err:
            self.proc = subprocess.Popen([str(python), str(CONTRACT), "--lines"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True)

    def check(self, exchanges: list[dict]) -> list[dict]:
        """SGLang's checks on ``exchanges``: one result (with ``problems``) each. Fails naming the process's
        stderr when it exits or does not answer within ANSWER_DEADLINE_S."""
        self.proc.stdin.write(json.dumps(exchanges) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + ANSWER_DEADLINE_S
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = self.proc.stdout.readline() if ready else ""
            assert line, (f"no answer from the contract check (exit {self.proc.poll()}): "
                          f"{self.log.read_text()[-3000:]}")
            if line.startswith(RESULTS_PREFIX):
                results = json.loads(line[len(RESULTS_PREFIX):])
                assert len(results) == len(exchanges)
                return results

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def contract(sglang_python, tmp_path_factory):
    checker = Contract(sglang_python, tmp_path_factory.mktemp("sglang-contract") / "stderr.log")
    try:
        yield checker
    finally:
        checker.close()


def problems_of(results: list[dict]) -> list[str]:
    return [f"{r['kind']} {r['method']} {r['path']}: {p}" for r in results for p in r["problems"]]


class Recorder:
    """A local HTTP server that records every request (method, path, JSON body) and answers as SGLang would."""

    def __init__(self) -> None:
        self.requests: list[dict] = []

    async def handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        self.requests.append({"method": request.method, "path": request.path,
                              "body": json.loads(raw) if raw else None})
        if request.path == "/generate":
            body = json.loads(raw)
            return web.json_response({"text": "x", "output_ids": [5], "meta_info": {
                "id": body["rid"], "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 3,
                "completion_tokens": 1, "cached_tokens": 0, "weight_version": "0", "e2e_latency": 0.1,
                "output_token_logprobs": [[-0.5, 5, None]], "input_token_logprobs": []}})
        if request.path == "/health":
            return web.Response()
        if request.path in ("/get_server_info", "/get_model_info"):
            return web.json_response({"model_path": "m", "dtype": "auto", "device": "cpu"})
        if request.path in ("/pause_generation", "/continue_generation"):
            return web.json_response({"message": "ok", "status": "ok"})
        return web.json_response({"success": True, "message": "Success"})


async def test_every_request_body_decodes_into_sglang_types(contract, tiny_model):
    encoder = PromptEncoder(tiny_model)
    constrained = EpisodeRunner(encoder, None, ActorConfig(constrained=True)).sampling_params
    free = EpisodeRunner(encoder, None, ActorConfig(constrained=False, temperature=0.7, top_p=0.9)).sampling_params
    assert "regex" in constrained and "regex" not in free
    prompt = encoder.encode([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Click."}]}],
                            [(320, 180)])

    recorder = Recorder()
    async with catch_all_http_server(recorder.handle) as url:
        async with PolicyClient([url], retry=RetryPolicy(attempts=1, request_timeout_s=30.0,
                                                         admin_timeout_s=30.0)) as client:
            await client.generate(input_ids=prompt, images=[screenshot("red")], sampling_params=constrained,
                                  rid="ep-1-0", episode_id="ep-1")
            await client.generate(input_ids=prompt[:5], images=[], sampling_params=free, rid="ep-2-0",
                                  episode_id="ep-2")
            engine = SGLangEngine(client, url, owner="arpo-learner-run-1")  # begin and end carry its rid
            assert await engine.healthy()
            await engine.server_info()
            assert await engine.weight_version() == 0  # GET /get_model_info without a version: "default"
            await engine.load_weights_from_disk("/models/v3", 3)
            await engine.join_weight_group(master_address="127.0.0.1", master_port=29500, rank_offset=1,
                                           world_size=2, group_name="arpo-weights-0", backend="gloo", timeout_s=30.0)
            await engine.begin_weight_update()
            await engine.receive_weights(names=["model.norm.weight"], dtypes=["float32"], shapes=[[64]],
                                         group_name="arpo-weights-0", version=None, load_format=None, timeout_s=30.0)
            await engine.receive_weights(names=["lm_head.weight", "model.norm.weight"],
                                         dtypes=["bfloat16", "float32"], shapes=[[8, 64], [64]],
                                         group_name="arpo-weights-0", version=4, load_format="flattened_bucket",
                                         timeout_s=30.0)
            await engine.end_weight_update()
            await engine.checksum_answer()
            await engine.checksum_answer(skip=["rotary_emb"])
            await engine.leave_weight_group("arpo-weights-0")
            for mode in ("retract", "abort", "in_place"):
                await engine.pause(mode)
            await engine.resume()

    paths = {r["path"] for r in recorder.requests}
    assert paths == {"/generate", "/health", "/get_server_info", "/get_model_info", "/update_weights_from_disk",
                     "/init_weights_update_group", "/begin_weight_update", "/update_weights_from_distributed",
                     "/end_weight_update", "/weights_checker", "/destroy_weights_update_group",
                     "/pause_generation", "/continue_generation"}
    generate = [r for r in recorder.requests if r["path"] == "/generate"]
    assert set(generate[0]["body"]) == {"input_ids", "image_data", "sampling_params", "return_logprob",
                                        "logprob_start_len", "rid", "stream"}
    vocab = json.loads((tiny_model / "config.json").read_text())["text_config"]["vocab_size"]
    results = contract.check([{"kind": "request", "vocab_size": vocab, **r} for r in recorder.requests])
    assert problems_of(results) == []

    # the check is not vacuous: what SGLang refuses is reported, naming the field
    bad = [{"kind": "request", "method": "POST", "path": "/generate", "vocab_size": vocab,
            "body": {**generate[1]["body"], "sampling_params": {**free, "max_tokens": 8}}},
           {"kind": "request", "method": "POST", "path": "/update_weights_from_distributed",
            "body": {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "weight_version": 4}},
           {"kind": "request", "method": "POST", "path": "/end_weight_update", "body": {"selector": "all"}},
           {"kind": "request", "method": "POST", "path": "/init_weights_update_group",
            "body": {"master_address": "h", "master_port": 1, "world_size": 2}},
           {"kind": "request", "method": "GET", "path": "/pause_generation", "body": None}]
    found = [r["problems"] for r in contract.check(bad)]
    assert all(found), found
    assert "max_tokens" in " ".join(found[0])
    assert "weight_version" in " ".join(found[1])
    assert "selector" in " ".join(found[2])
    assert "rank_offset" in " ".join(found[3])
    assert "GET" in " ".join(found[4])


async def exchange(session: aiohttp.ClientSession, method: str, url: str, path: str, body=None) -> dict:
    async with session.request(method, f"{url}{path}", json=body) as resp:
        text = await resp.text()
        parsed = json.loads(text) if resp.content_type == "application/json" else None
        return {"kind": "response", "method": method, "path": path, "status": resp.status, "body": parsed,
                "text": text if parsed is None else ""}


async def test_arpo_serve_generate_response_has_sglang_fields(contract, tiny_serve, tiny_model):
    encoder = PromptEncoder(tiny_model)
    prompt = encoder.encode([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Click."}]}],
                            [(320, 180)])
    body = {"input_ids": prompt, "image_data": [image_data_uri(screenshot("red"))],
            "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0}, "return_logprob": True,
            "logprob_start_len": -1, "rid": "r-1", "stream": False}
    async with aiohttp.ClientSession() as session:
        answer = await exchange(session, "POST", tiny_serve.url, "/generate", body)
    assert answer["status"] == 200
    assert problems_of(contract.check([answer])) == []


async def test_arpo_serve_admin_responses_have_sglang_fields(contract, tiny_serve, tiny_model):
    async with aiohttp.ClientSession() as session:
        answers = [
            await exchange(session, "GET", tiny_serve.url, "/health"),
            await exchange(session, "POST", tiny_serve.url, "/pause_generation", {"mode": "retract"}),
            await exchange(session, "POST", tiny_serve.url, "/update_weights_from_distributed",  # no session: refused
                           {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
                            "group_name": "none"}),
            await exchange(session, "POST", tiny_serve.url, "/end_weight_update", {}),  # no session: refused
            await exchange(session, "POST", tiny_serve.url, "/begin_weight_update", {"selector": "all"}),
            await exchange(session, "POST", tiny_serve.url, "/end_weight_update", {}),
            await exchange(session, "POST", tiny_serve.url, "/update_weights_from_disk",
                           {"model_path": str(tiny_model), "weight_version": "5", "flush_cache": True}),
            await exchange(session, "POST", tiny_serve.url, "/destroy_weights_update_group", {"group_name": "none"}),
            await exchange(session, "POST", tiny_serve.url, "/weights_checker", {"action": "checksum"}),
            await exchange(session, "POST", tiny_serve.url, "/continue_generation", {}),
            await exchange(session, "POST", tiny_serve.url, "/flush_cache"),
        ]
    statuses = [a["status"] for a in answers]
    assert statuses == [200, 200, 400, 400, 200, 200, 200, 400, 200, 200, 200], statuses
    assert problems_of(contract.check(answers)) == []


async def test_arpo_serve_info_responses_have_sglang_fields(contract, tiny_serve):
    async with aiohttp.ClientSession() as session:
        answers = [await exchange(session, "GET", tiny_serve.url, "/get_server_info"),
                   await exchange(session, "GET", tiny_serve.url, "/get_model_info")]
    assert [a["status"] for a in answers] == [200, 200]
    assert problems_of(contract.check(answers)) == []
