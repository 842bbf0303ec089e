"""The dtype the learner publishes in (learner.train.publish_dtype, ``learner.publish_dtype``): asked of each server
once, resolved as SGLang resolves "auto", one folder dtype only when the servers agree, float32 for a server that
does not answer (asked again next time), and nothing asked when casting is off. Real arpo-serve engines in this
process (tests/unit/test_engine_seam.py's InProcessEngine) and a real client to a port nobody listens on."""

from __future__ import annotations

import logging

import torch

from arpo_async.inference_client import PolicyClient, RetryPolicy
from arpo_async.model.init_model import create_tiny_model
from arpo_async.sglang_engine import SGLangEngine
from arpo_async.weight_sync import cast_floating
from arpo_serve.engine import Engine
from learner.train.publish_dtype import PublishDtypes, tensor_bytes
from tests.support import free_port
from tests.unit.test_engine_seam import InProcessEngine


def test_cast_floating_casts_floats_only_and_keeps_a_dict_that_needs_nothing():
    tensors = {"w": torch.ones(4), "ids": torch.arange(3)}
    cast = cast_floating(tensors, torch.bfloat16)
    assert cast["w"].dtype == torch.bfloat16 and cast["ids"].dtype == torch.int64
    assert tensor_bytes(cast) == 4 * 2 + 3 * 8 and tensor_bytes(tensors) == 4 * 4 + 3 * 8
    assert cast_floating(cast, torch.bfloat16) is cast and cast_floating(tensors, None) is tensors


async def test_each_server_is_asked_once_and_a_folder_gets_a_dtype_only_when_they_agree(tmp_path):
    model_dir = create_tiny_model(tmp_path / "policy", seed=0)
    half = InProcessEngine(Engine(model_dir, dtype="bfloat16"))
    full = InProcessEngine(Engine(model_dir))
    half.url, full.url = "in-process:half", "in-process:full"  # two servers (PublishDtypes asks per URL)
    dtypes = PublishDtypes()
    assert await dtypes.of(half, model_dir) == torch.bfloat16 and await dtypes.of(full, model_dir) == torch.float32
    assert await dtypes.common([half], model_dir) == torch.bfloat16
    assert await dtypes.common([half, full], model_dir) is None  # they differ: a float32 folder, each casts
    half.engine.model.to(torch.float32)  # what it serves now is not asked again until forgotten
    assert await dtypes.of(half, model_dir) == torch.bfloat16
    dtypes.forget(half.url)
    assert await dtypes.of(half, model_dir) == torch.float32
    assert await PublishDtypes(served=False).of(half, model_dir) is None  # publish_dtype = "float32"


async def test_a_server_that_does_not_answer_gets_float32_and_is_asked_again(tmp_path, caplog):
    model_dir = create_tiny_model(tmp_path / "policy", seed=0)
    url = f"http://127.0.0.1:{free_port()}"
    retry = RetryPolicy(attempts=1, request_timeout_s=2.0, admin_timeout_s=2.0)
    async with PolicyClient([url], retry=retry) as client:
        engine, dtypes = SGLangEngine(client, url), PublishDtypes()
        with caplog.at_level(logging.WARNING):
            assert await dtypes.of(engine, model_dir) is None
            assert await dtypes.of(engine, model_dir) is None
    assert caplog.text.count("did not say which dtype it serves") == 2  # asked each time, never remembered
