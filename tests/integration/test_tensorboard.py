"""A real short `arpo run` (serve, learner, actors, docker desktops), watched as a user would: its stdout is a pipe,
so progress comes as plain lines; afterwards `<run>/tb/` must hold, per TensorBoard's own reader, exactly the
numbers of metrics.jsonl, including the per-step stage timings and queue depths. A run whose learner crashes
must quote that crash's traceback in `arpo run`'s own output."""

import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from arpo_async.metrics import flatten_numbers, read_metrics
from tests.support import free_port

pytestmark = pytest.mark.docker

STAGES = {"reset", "setup", "screenshot", "generate", "execute", "settle", "evaluate", "episode"}



def arpo_run(run_dir, model, *overrides: str, timeout_s: float = 900) -> subprocess.CompletedProcess:
    serve, learner = free_port(), free_port()
    args = [sys.executable, "-m", "arpo_cli.cli", "run", "--out", str(run_dir), "--model", str(model),
            "--set", f"serve.port={serve}", "--set", f'actors.inference_urls=["http://127.0.0.1:{serve}"]',
            "--set", f"transport.endpoint=tcp://127.0.0.1:{learner}"]
    for override in overrides:
        args += ["--set", override]
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)


def test_a_short_run_writes_tensorboard_and_prints_plain_progress(tmp_path, desktop_image, tiny_model):
    run_dir = tmp_path / "demo"
    proc = arpo_run(run_dir, tiny_model, 'learner.task_ids=["grid4"]', "learner.group_size=4",
                    "learner.groups_per_step=1", "learner.steps=2", "actors.actors=4", "actors.max_steps=1",
                    'actors.grammar_actions=["click"]', "actors.max_thought_chars=1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    progress = [line for line in proc.stdout.splitlines() if "version" in line and "desktops" in line]
    assert progress, proc.stdout[-3000:]
    assert "\r" not in proc.stdout and "\x1b[" not in proc.stdout  # a pipe gets plain lines, no redraws
    last = progress[-1]
    assert "step 2/2 version 2" in last and "/min)" in last and " lag " in last and "/4 busy" in last

    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert set(record["stage_s"]) >= STAGES - {"execute"}, record["stage_s"]  # "execute": a click ran
        assert all(0 <= s["p50"] <= s["p95"] for s in record["stage_s"].values())
        assert set(record["queues"]) >= {"waiting_requests", "running", "ready_groups", "actor_running"}
        # What settling costs: every executed click is settled once (the 1-step budget ends after it, so before the
        # evaluator), each wait is at least one actors.settle_interval_s (0.1 s) and far under step_timeout_s
        settle = record["stage_s"]["settle"]
        assert 0 < settle["count"] <= record["stage_s"]["execute"]["count"], record["stage_s"]
        assert 0.1 <= settle["p50"] <= settle["p95"] < 120 and 0 <= settle["timeout_share"] <= 1, settle
    # grid4's app is still after a click: most waits end with two equal screenshots, not at the 2 s timeout
    shares = [r["stage_s"]["settle"]["timeout_share"] for r in records]
    assert min(shares) < 0.5, shares

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    scalars = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    expected: dict[str, dict[int, float]] = {}
    for record in records:
        for name, value in flatten_numbers(record).items():
            expected.setdefault(name, {})[record["step"]] = value
    assert set(scalars) == set(expected)
    for name, by_step in expected.items():
        assert scalars[name] == pytest.approx(by_step, rel=1e-6), name
    for stage in ("reset", "generate", "evaluate"):
        assert set(scalars[f"stage_s/{stage}/p95"]) == {1, 2}
    assert "success_rate" in scalars and "loss" in scalars and "queues/running" in scalars


def test_a_crashed_learner_is_quoted_in_arpo_runs_message(tmp_path, desktop_image, tiny_model):
    # A crash only the learner can meet (arpo run checks the tasks and config before it starts anything): its
    # TensorBoard folder <run>/tb is a file, so creating the event writer fails inside the learner.
    run_dir = tmp_path / "crash"
    run_dir.mkdir()
    (run_dir / "tb").write_text("not a folder")
    proc = arpo_run(run_dir, tiny_model, 'learner.task_ids=["grid4"]', "actors.actors=1", timeout_s=600)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert f"arpo-learner exited with 1; see {run_dir / 'logs' / 'learner.log'}" in out
    assert "Traceback (most recent call last):" in out and "in run_learner" in out
    assert "arpo-learner failed: FileExistsError:" in out
    assert "ERROR Traceback" in (run_dir / "logs" / "learner.log").read_text()
