"""Sharded training with real processes: torchrun, 2 ranks, gloo, FSDP2, the real tiny checkpoint.

tests/rank_driver.py runs the real Trainer (rank 0 driving the other through LeadTrainer, as arpo-learner does).
"""

from __future__ import annotations

import json
import os
import re
import signal
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


def run_driver(model: Path, out: Path, *args: str, ranks: int = 1) -> subprocess.CompletedProcess:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--standalone"]
                if ranks > 1 else [sys.executable])
    proc = subprocess.run([*launcher, str(DRIVER), str(model), str(out), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def drive(model: Path, out: Path, *args: str, ranks: int = 1) -> dict[int, float]:
    run_driver(model, out, *args, ranks=ranks)
    return {int(k): v for k, v in json.loads((out / "losses.json").read_text()).items()}


def test_trainer_and_lead_trainer_answer_every_train_engine_call_alike(model, tmp_path):
    """Issue 52 item 4: the one-rank Trainer and rank 0's LeadTrainer (2 ranks, gloo, FSDP2) both satisfy
    learner.train.train_engine.TrainEngine, and each of its calls gives the same answer through both: the lead's
    typed commands reach the other rank (the collectives would hang or fail otherwise) and run the same method."""
    one_dir, two_dir = tmp_path / "one", tmp_path / "two"
    run_driver(model, one_dir, "--every-call")
    two_proc = run_driver(model, two_dir, "--every-call", ranks=2)
    one, two = (json.loads((d / "calls.json").read_text()) for d in (one_dir, two_dir))
    config = json.loads((model / "config.json").read_text())
    for calls, name in ((one, "trainer.pt"), (two, "trainer.dcp")):
        assert calls["is_engine"] and calls["steps_before"] == 0
        assert calls["model_dir"] == str(model)
        assert calls["vocab_size"] == config.get("text_config", config)["vocab_size"]
        assert calls["checkpoint_name"] == name
        assert "minibatches must be in [1, 1], got 2" in calls["refused"]
        assert calls["train_batch"]["optimizer_steps"] == 2.0
        assert calls["steps_saved"] == 3 and calls["steps_trained_on"] == 4 and calls["steps_loaded"] == 3
        assert calls["full_loaded_equal"]
        assert calls["logprobs_loaded"] != calls["logprobs"]  # 3 steps at lr 1e-3 moved them, and the load kept that
    # rank 1 ran the refused call too, logged it, and took the next command
    assert "rank 1: train_batch failed on its input: minibatches must be in [1, 1]" in two_proc.stderr
    for key in ("logprobs", "logprobs_loaded"):
        for a, b in zip(one[key], two[key], strict=True):
            assert b == pytest.approx(a, rel=1e-4, abs=1e-5)
    assert two["train_batch"]["loss"] == pytest.approx(one["train_batch"]["loss"], rel=1e-4, abs=1e-7)
    assert two["train_step_loss"] == pytest.approx(one["train_step_loss"], rel=1e-4, abs=1e-7)
    assert one["full"] == two["full"] and one["full"]  # rank 0 gathered every weight, shapes and names alike
    assert one["checkpoint_names"] == two["checkpoint_names"] and one["checkpoint_names"]
    for calls in (one, two):
        written = load_file(Path(calls["weights"]) / "model.safetensors")
        assert {str(t.dtype) for t in written.values()} == {"torch.bfloat16"}
    assert (two_dir / "ckpt" / "trainer.dcp" / "trainer.json").is_file()
    assert (one_dir / "ckpt" / "trainer.pt").is_file()


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


def rank_pids(torchrun_pid: int) -> dict[int, int]:
    """{rank: pid} of torchrun's worker processes (read from their environment)."""
    out = {}
    for child in subprocess.run(["pgrep", "-P", str(torchrun_pid)], capture_output=True, text=True).stdout.split():
        try:
            env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in env:
            if entry.startswith(b"RANK="):
                out[int(entry[5:])] = int(child)
    return out


@pytest.mark.docker
def test_learner_on_two_ranks_trains_survives_a_killed_rank_and_resumes(tmp_path, desktop_image, tiny_model):
    """The real arpo-learner under torchrun (2 ranks, gloo) next to arpo-serve and arpo-actors on real desktops,
    weights synced over a process group: it trains and publishes (no weights folder); SIGKILL on rank 1 makes the learner exit non-zero within the documented time,
    saying which rank failed; the same torchrun command resumes from the sharded checkpoint."""
    import uuid

    from arpo_async.metrics import read_metrics
    from tests.integration.test_resume import running_job, server_weight_version, tail, write_config
    from tests.support import until_sync

    run_id = f"ranks-{uuid.uuid4().hex[:8]}"
    config, url = write_config(tmp_path, tiny_model, desktop_image, run_id, "learner.steps=4",
                               "learner.max_tokens_per_microbatch=4096", 'learner.weight_sync="distributed"')
    metrics = tmp_path / "run" / "metrics.jsonl"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                "-m", "learner.main", "--config", str(config)]
    with running_job(tmp_path, config, url, tiny_model, run_id, learner=torchrun) as procs:
        alive = lambda: procs.check_alive("serve", "learner", "actors")  # noqa: E731
        until_sync(lambda: len(read_metrics(metrics)) >= 2, 300, "2 steps on 2 ranks", check=alive)
        assert (tmp_path / "run" / "checkpoints").is_dir()
        assert any((c / "trainer.dcp" / "trainer.json").is_file()
                   for c in (tmp_path / "run" / "checkpoints").iterdir())
        assert int(server_weight_version(url)) >= 1
        assert not (tmp_path / "run" / "weights").exists()  # distributed sync: nothing written to disk

        learner = procs.procs["learner"]
        ranks = until_sync(lambda: rank_pids(learner.pid), 30, "torchrun's worker processes")
        assert set(ranks) == {0, 1}
        before = procs.log("learner").stat().st_size
        os.kill(ranks[1], signal.SIGKILL)
        code = learner.wait(timeout=120)  # torchrun notices the dead worker and stops the other
        assert code != 0
        with procs.log("learner").open("rb") as f:
            f.seek(before)
            after = f.read().decode(errors="replace")
        # torchrun names the killed rank: in its "failed (exitcode: -9) local_rank: 1" line when it noticed that
        # rank first, else in the failure table of its ChildFailedError, after rank 0's exit 1 (rank 0's next
        # collective fails at once when rank 1 dies, and its exit can reach torchrun first)
        killed = (rf"exitcode: -9\) local_rank: 1 \(pid: {ranks[1]}\)"
                  rf"|rank\s*: 1 \(local_rank: 1\)\s+exitcode\s*: -9 \(pid: {ranks[1]}\)")
        assert re.search(killed, after), after[-3000:]
        done_before = len(read_metrics(metrics))

        procs.start("learner", torchrun)
        until_sync(lambda: len(read_metrics(metrics)) >= 4, 300, "the restarted learner's steps", check=alive)
        procs.procs["learner"].wait(timeout=120)
        assert procs.procs["learner"].returncode == 0, tail(procs.log("learner"))
    records = read_metrics(metrics)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    resumed = [r for r in records if "resumed_from" in r]
    assert resumed and resumed[0]["step"] > min(done_before, 4) - 1
    assert "resumed from" in tail(procs.log("learner"), 400)
