"""The learner on CUDA (marker ``gpu``; skipped where torch sees no CUDA device, so CI collects these tests but
does not run them). Run them on a GPU machine: ``python3 -m pytest -q tests/gpu``.

A bf16 training step on CUDA with the tiny policy must score the same samples as the CPU fp32 path (bf16 rounding
only), take a finite step, and report the peak GPU memory it used.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from arpo_async.config import LearnerConfig
from arpo_async.model.init_model import create_tiny_model
from learner.train.trainer import Trainer
from tests.rank_driver import batch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("gpu") / "policy", seed=0)


def test_bf16_step_on_cuda_matches_the_cpu_fp32_log_probs(model):
    samples = batch(model, 0)
    cpu = Trainer(model, LearnerConfig(lr=1e-3, device="cpu", dtype="float32"))
    cuda = Trainer(model, LearnerConfig(lr=1e-3, device="cuda", dtype="bfloat16", gradient_checkpointing=True))
    assert cuda.device.type == "cuda"
    reference = cpu.compute_logprobs(samples)
    on_gpu = cuda.compute_logprobs(samples)
    worst = max(abs(a - b) for ref, got in zip(reference, on_gpu) for a, b in zip(ref, got))
    assert worst < 0.05, worst  # bf16 activations: about 3 significant digits
    torch.cuda.reset_peak_memory_stats()
    stats = cuda.train_step(samples)
    assert stats["skipped"] == 0.0 and math.isfinite(stats["loss"]) and stats["grad_norm"] > 0
    assert all(p.dtype == torch.float32 for p in cuda.module.parameters())  # fp32 master weights
    assert torch.cuda.max_memory_allocated() > 0
    after = cuda.compute_logprobs(samples)
    assert after != on_gpu  # the step changed the policy
