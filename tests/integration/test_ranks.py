"""Sharded training with real processes: torchrun, 2 ranks, gloo, FSDP2, the real tiny checkpoint.

tests/rank_driver.py runs the real Trainer (rank 0 driving the other through LeadTrainer, as arpo-learner does).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from arpo_async.model.init_model import create_tiny_model
from tests.rank_driver import batch

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "rank_driver.py"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("ranks") / "policy", seed=0)


def drive(model: Path, out: Path, *args: str, ranks: int = 1) -> dict[int, float]:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--standalone"]
                if ranks > 1 else [sys.executable])
    proc = subprocess.run([*launcher, str(DRIVER), str(model), str(out), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {int(k): v for k, v in json.loads((out / "losses.json").read_text()).items()}


def test_two_ranks_train_like_one_and_resume_from_a_sharded_checkpoint(model, tmp_path):
    longest = max(len(s.prompt_ids) + len(s.output_ids) for s in batch(model, 0))
    one = drive(model, tmp_path / "one", "--steps", "3")
    # one sample per micro-batch: 5 samples over 2 ranks, so one rank runs a zero-weight pass to stay in step
    two = drive(model, tmp_path / "two", "--steps", "3", "--save-at", "2", "--budget", str(longest), ranks=2)
    assert one.keys() == two.keys() == {0, 1, 2}
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-4, abs=1e-7)

    initial = load_file(model / "model.safetensors")
    w1 = load_file(tmp_path / "one" / "weights" / "model.safetensors")
    w2 = load_file(tmp_path / "two" / "weights" / "model.safetensors")
    assert w1.keys() == w2.keys()
    assert max((w1[k] - initial[k]).abs().max().item() for k in w1) > 1e-3  # 3 AdamW steps at lr 1e-3 moved them
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-4

    ckpt = tmp_path / "two" / "ckpt"
    assert json.loads((ckpt / "trainer.dcp" / "trainer.json").read_text())["steps"] == 2
    assert len(list((ckpt / "trainer.dcp").glob("*.distcp"))) == 2  # one shard file per rank
    resumed = drive(model, tmp_path / "resumed", "--steps", "3", "--resume", str(ckpt), "--budget", str(longest),
                    ranks=2)
    assert resumed.keys() == {2}
    assert resumed[2] == two[2]  # the model and AdamW state came back exactly
