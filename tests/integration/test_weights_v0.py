"""weights/v0: a run keeps the weights it started from, whatever learner.keep_weights prunes (issue 49 item 4).

A real Trainer publishes three trained versions to a real arpo-serve with ``keep=1``; the folder of the initial
weights (``keep_initial``, written before the first step as the learner does) is still there, holding the base
model's tensors, beside the newest version only. `arpo run` itself is checked in tests/integration/test_run.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from arpo_async.config import LearnerConfig
from arpo_async.inference_client import PolicyClient, RetryPolicy
from arpo_async.model.init_model import create_tiny_model
from arpo_async.sglang_engine import sglang_engines
from learner.train.publisher import WeightPublisher
from learner.train.trainer import Trainer
from tests.rank_driver import batch
from tests.support import ServeProcess, free_port


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("v0") / "policy", seed=0)


async def test_v0_holds_the_initial_weights_and_outlives_every_prune(model_dir, tmp_path):
    trainer = Trainer(model_dir, LearnerConfig(lr=1e-2))
    server = ServeProcess(model_dir, free_port(), tmp_path)
    weights = tmp_path / "weights"
    try:
        server.start()
        retry = RetryPolicy(attempts=3, request_timeout_s=300.0, admin_timeout_s=300.0)
        async with PolicyClient([server.url], retry=retry) as client:
            engines = sglang_engines(client)
            publisher = WeightPublisher(engines, weights, keep=1)
            v0 = await publisher.keep_initial(trainer)
            assert v0 == weights / "v0"
            for version in (1, 2, 3):
                trainer.train_step(batch(model_dir, version))
                await publisher.publish_from(trainer, version)
            assert await engines[0].weight_version() == 3  # the servers got every version; v0 was never sent
    finally:
        server.stop()
    assert sorted(p.name for p in weights.iterdir()) == ["v0", "v3"]  # keep=1 pruned v1 and v2, never v0
    base, kept = load_file(model_dir / "model.safetensors"), load_file(v0 / "model.safetensors")
    newest = load_file(weights / "v3" / "model.safetensors")
    assert kept.keys() == base.keys() == newest.keys()
    assert all(torch.equal(kept[k], base[k].to(kept[k].dtype)) for k in base)  # the weights before any step
    assert any(not torch.equal(newest[k], kept[k]) for k in kept)  # ...not the trained ones
    assert (v0 / "config.json").is_file()  # a Hugging Face folder: `arpo eval --model RUN/weights/v0` takes it
