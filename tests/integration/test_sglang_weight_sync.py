"""Our learner's weight publication against SGLang 0.5.23's own weight-sync code (tests/sglang_receiver.py, run
with the python of tests/sglang_env.py): SGLang's ``init_custom_process_group``, session rules, receive path
(per-tensor broadcasts and ``FlattenedTensorBucket``), ``Qwen2_5_VLForConditionalGeneration.load_weights`` on the
CPU and ``WeightChecker``.

- (a) what SGLang receives is bit-identical to what the trainer holds, under the names ``save_pretrained`` writes
  (the keys of trainer.save_weights's model.safetensors), with load_format None and "flattened_bucket";
- (c) SGLang's model, built on the CPU with its parameters set to NaN, has every parameter written by
  ``load_weights`` and equal to the checkpoint tensors (q/k/v and gate/up concatenated into its fused
  parameters; float16, SGLang's ``--dtype auto`` for a float32 checkpoint; the vocabulary padded to a multiple
  of 64 with zero rows);
- the learner's ``verify_every`` check agrees with SGLang's own /weights_checker checksums.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import aiohttp
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from arpo_async.config import LearnerConfig
from arpo_async.inference_client import PolicyClient, RetryPolicy
from arpo_async.model.init_model import create_tiny_model
from arpo_async.sglang_engine import SGLangEngine
from learner.train.publisher import DistributedPublisher
from learner.train.trainer import Trainer
from tests.rank_driver import batch
from tests.support import free_port, read_until, stop_process

RECEIVER = Path(__file__).resolve().parents[1] / "sglang_receiver.py"


class Receiver:
    """tests/sglang_receiver.py as a child process (the SGLang environment's python) on a free port."""

    def __init__(self, python: Path, model: Path, out: Path, log: Path, *, dtype: str = "auto",
                 start_timeout_s: float = 90.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.out, self.log = out, log
        with open(log, "wb") as err:
            self.proc = subprocess.Popen([str(python), str(RECEIVER), "--model", str(model), "--port",
                                          str(self.port), "--out", str(out), "--dtype", dtype],
                                         stdout=subprocess.PIPE, stderr=err,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        ready, seen = read_until(self.proc, b"sglang-receiver ready", start_timeout_s)
        if not ready:
            self.stop()
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the SGLang receiver did not become ready; stdout {seen!r}; stderr:\n{tail}")

    def stop(self) -> None:
        stop_process(self.proc, 20.0)

    async def state(self) -> dict:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{self.url}/receiver_state") as resp:
                assert resp.status == 200
                return await resp.json()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("sglang-sync") / "policy", seed=0)


@pytest.fixture
def receiver(sglang_python, model_dir, tmp_path):
    r = Receiver(sglang_python, model_dir, tmp_path / "received", tmp_path / "receiver.log")
    try:
        yield r
    finally:
        r.stop()


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def sglang_expected(param: str, served: torch.Tensor, checkpoint: dict[str, torch.Tensor]) -> torch.Tensor:
    """What SGLang's Qwen2.5-VL parameter ``param`` (``served`` is its value) must hold after loading ``checkpoint``
    (one tensor-parallel rank): models/qwen2_5_vl.py load_weights' stacked_params_mapping (q, k, v -> qkv_proj;
    gate, up -> gate_up_proj, in shard order) and its vision rename attn.qkv -> attn.qkv_proj, every other name
    the checkpoint's; cast to the served dtype (the weight loaders' ``copy_``); the vocabulary rows of
    ``embed_tokens`` / ``lm_head`` padded with zeros to a multiple of 64 (VocabParallelEmbedding)."""
    if ".qkv_proj." in param and param.startswith("visual."):
        tensor = checkpoint[param.replace(".attn.qkv_proj.", ".attn.qkv.")]
    elif ".qkv_proj." in param:
        tensor = torch.cat([checkpoint[param.replace(".qkv_proj.", f".{p}_proj.")] for p in "qkv"])
    elif ".gate_up_proj." in param:
        tensor = torch.cat([checkpoint[param.replace(".gate_up_proj.", f".{p}_proj.")] for p in ("gate", "up")])
    else:
        tensor = checkpoint[param]
    tensor = tensor.to(served.dtype)
    if param in ("model.embed_tokens.weight", "lm_head.weight") and tensor.shape[0] % 64:
        rows = -(-tensor.shape[0] // 64) * 64
        tensor = torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])
    return tensor


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
async def test_sglang_receives_and_loads_the_published_weights(receiver, model_dir, tmp_path, load_format):
    trainer = Trainer(model_dir, LearnerConfig(lr=1e-2))
    trainer.train_step(batch(model_dir, 0))
    saved = trainer.save_weights(tmp_path / "saved")
    with safe_open(str(saved / "model.safetensors"), "pt") as f:
        saved_names = set(f.keys())
    sent = trainer.checkpoint_state_dict()
    initial = load_file(str(model_dir / "model.safetensors"))

    retry = RetryPolicy(attempts=2, request_timeout_s=30.0, admin_timeout_s=30.0)
    async with PolicyClient([receiver.url], retry=retry) as client:
        publisher = DistributedPublisher([SGLangEngine(client, receiver.url)], bucket_mb=0.05, timeout_s=30.0,
                                         load_format=load_format)
        await publisher.publish_from(trainer, 1)
        assert publisher.failures == 0

    state = await receiver.state()
    assert state["mismatches"] == []  # every body decoded into SGLang's type, no unknown or missing field
    assert state["pause_modes"] == ["retract"] and state["paused"] is False
    assert state["sessions"] == 1 and state["session_open"] is False
    assert state["weight_version"] == "1"
    paths = [r["path"] for r in state["requests"]]
    assert paths[:3] == ["/init_weights_update_group", "/pause_generation", "/begin_weight_update"]
    updates = paths.count("/update_weights_from_distributed")
    assert updates > 1  # 0.05 MB buckets: several calls
    assert paths[3:3 + updates] == ["/update_weights_from_distributed"] * updates
    assert paths[3 + updates:5 + updates] == ["/end_weight_update", "/continue_generation"]
    sent_formats = {r["body"].get("load_format") for r in state["requests"]
                    if r["path"] == "/update_weights_from_distributed"}
    assert sent_formats == {load_format}

    # (a) what SGLang's receive path handed to load_weights: bit-identical, under save_pretrained's names
    received: dict[str, torch.Tensor] = {}
    for k in range(1, updates + 1):
        part = load_file(str(receiver.out / f"s1-u{k}.safetensors"))
        assert not set(part) & set(received), "a name was sent twice"
        received.update(part)
    assert set(received) == saved_names == set(sent)
    assert all(n.startswith(("model.layers.", "model.embed_tokens.", "model.norm.", "visual.", "lm_head."))
               for n in received)
    # learner.publish_dtype = "served": SGLang's --dtype auto serves this float32 checkpoint in float16, so float16
    # tensors were sent (half the bytes), bit-identical to the learner's weights cast as SGLang casts them on load
    assert {t.dtype for t in received.values()} == {torch.float16}
    different = [n for n in sent if not bits_equal(received[n], sent[n].to(torch.float16))]
    assert different == []
    assert any(not torch.equal(sent[n], initial[n]) for n in sent)  # the trained weights, not the initial ones

    # (c) SGLang's model: every parameter (NaN before) now holds the published checkpoint tensors
    params = load_file(str(receiver.out / "s1-model.safetensors"))
    assert any(".qkv_proj." in n for n in params) and any(".gate_up_proj." in n for n in params)
    assert {p.dtype for p in params.values()} == {torch.float16}  # --dtype auto, float32 checkpoint
    unwritten = [n for n, p in params.items() if torch.isnan(p).any()]
    assert unwritten == []
    wrong = [n for n, p in params.items() if not bits_equal(p, sglang_expected(n, p, sent))]
    assert wrong == []


async def test_sglang_session_rules_meet_the_publisher(receiver, model_dir):
    """What the publisher relies on from SGLang's session rules (managers/scheduler_components/weight_updater.py):
    an update outside a session is refused, a second begin and an end without begin answer HTTP 400, and a
    publication cut short (session left open) is closed by the publisher's end-and-begin-again."""
    async with aiohttp.ClientSession() as session:
        async def post(path: str, body: dict) -> tuple[int, dict]:
            async with session.post(f"{receiver.url}{path}", json=body) as resp:
                return resp.status, await resp.json()

        update = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "group_name": "none"}
        status, body = await post("/update_weights_from_distributed", update)
        assert status == 400 and body["success"] is False and "begin_weight_update" in body["message"]
        status, body = await post("/end_weight_update", {})
        assert status == 400 and "no weight-update session" in body["message"]
        assert await post("/begin_weight_update", {"selector": "all"}) == (200, {"success": True,
                                                                              "message": "Success"})
        status, body = await post("/begin_weight_update", {"selector": "all"})
        assert status == 400 and "already open" in body["message"]
        # a field SGLang's type does not have is named (SGLang itself would silently ignore it)
        status, body = await post("/end_weight_update", {"selector": "all"})
        assert status == 400 and "selector" in body["message"]
        assert (await receiver.state())["mismatches"][-1]["path"] == "/end_weight_update"

    trainer = Trainer(model_dir, LearnerConfig(lr=1e-2))
    retry = RetryPolicy(attempts=2, request_timeout_s=30.0, admin_timeout_s=30.0)
    async with PolicyClient([receiver.url], retry=retry) as client:
        publisher = DistributedPublisher([SGLangEngine(client, receiver.url)], bucket_mb=1.0, timeout_s=30.0)
        await publisher.publish_from(trainer, 7)  # the session left open above is closed first
        assert publisher.failures == 0
    state = await receiver.state()
    assert state["weight_version"] == "7" and state["session_open"] is False and state["paused"] is False
    assert len(state["mismatches"]) == 1  # only the deliberate one


async def test_learner_weight_check_agrees_with_sglang_weights_checker(receiver, model_dir):
    """learner.verify_weights_every against SGLang's own WeightChecker (utils/weight_checker.py) over SGLang's model
    as a real server holds it: fused parameter names, ``--dtype auto`` (float16 for this float32 checkpoint, while
    /get_server_info reports dtype "auto"), the vocabulary padded to a multiple of 64 (771 -> 832 rows here)."""
    trainer = Trainer(model_dir, LearnerConfig(lr=1e-2))
    trainer.train_step(batch(model_dir, 0))
    retry = RetryPolicy(attempts=2, request_timeout_s=30.0, admin_timeout_s=30.0)
    async with PolicyClient([receiver.url], retry=retry) as client:
        publisher = DistributedPublisher([SGLangEngine(client, receiver.url)], bucket_mb=1.0, timeout_s=30.0,
                                         verify_every=1)
        await publisher.publish_from(trainer, 1)
        assert (publisher.failures, publisher.verified) == (0, 1)
