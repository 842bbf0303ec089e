"""The README's demo ends by itself once it has learnt its task (issue 49 item 1).

`arpo run --config configs/grid4.toml` on real desktops, the embedded tiny policy and arpo-serve: the policy learns
to click the named button; once every rollout of the task's last 4 groups succeeds, the learner sets the task aside
as solved, training stops before learner.steps with one line saying so, and `arpo run` exits 0 after a normal end
(the last step checkpointed, its weights what the server serves, summary.json and curve.png). On main before this
item the demo ran all 80 steps: the last 30 took 20 minutes of groups without a reward difference. As at
learner.steps, the held-out round of [eval] runs on the final weights before the actors stop; its result is the
evaluation record after the last batch's (it had no final round before).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from arpo_async.config import load_config
from arpo_async.metrics import is_training_record, read_metrics, training_records
from learner.train.checkpoint import checkpoint_folders
from tests.integration.test_run import run_containers
from tests.support import free_port

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[2]
LINE = ("every task is solved in its last 4 groups (3 of them with every rollout successful): training stops "
        "(learner.stop_when_solved = false keeps it going)")  # configs/grid4.toml: task_solved_rate = 0.75


def test_the_demo_stops_by_itself_once_its_task_is_solved(tmp_path, desktop_image, tiny_model):
    run_dir = tmp_path / "solved"
    serve, endpoint = free_port(), free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "arpo_cli.cli", "run", "--out", str(run_dir), "--model", str(tiny_model),
         "--config", str(ROOT / "configs" / "grid4.toml"),
         "--set", f"serve.port={serve}", "--set", f'actors.inference_urls=["http://127.0.0.1:{serve}"]',
         "--set", f"transport.endpoint=tcp://127.0.0.1:{endpoint}"],
        capture_output=True, text=True, timeout=2400, cwd=ROOT)
    out = proc.stdout[-4000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, out
    assert LINE in proc.stdout.splitlines(), out  # one line, as it is, in `arpo run`'s output
    assert LINE in (run_dir / "logs" / "learner.log").read_text()
    everything = read_metrics(run_dir / "metrics.jsonl")
    records, final = training_records(everything), everything[-1]
    last = records[-1]
    assert last["step"] < 80, "the run went to learner.steps: it never stopped as solved"
    assert records[0]["success_rate"] <= 0.5 and last["success_rate"] >= 0.7, [r["success_rate"] for r in records]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["stopped"] == LINE and status["solved"] == ["grid4-green"]
    # the solved window (4 groups, 3 of them all successful: zero variance) was dropped from training at least 3 times
    assert status["drops"]["zero_variance"] >= 3 and status["totals"]["groups"] >= status["drops"]["zero_variance"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["exit_code"], summary["steps"], summary["policy_version"]) == (0, last["step"],
                                                                                  last["policy_version"])
    assert summary["server_weight_version"] == str(last["policy_version"])  # the final weights are served
    assert (run_dir / "weights" / f"v{last['policy_version']}" / "model.safetensors").exists()
    newest = checkpoint_folders(run_dir / "checkpoints")[-1]
    assert json.loads((newest / "meta.json").read_text())["step"] == last["step"]  # the last step, checkpointed
    assert (run_dir / "curve.png").stat().st_size > 0
    # the final held-out round ran on the final weights: the evaluation record, after the last batch's
    assert not is_training_record(final) and everything[:-1] == records, everything[-2:]
    assert (final["step"], final["policy_version"]) == (last["step"], last["policy_version"])
    assert (final["eval_step"], final["eval_policy_version"]) == (last["step"], last["policy_version"]), final
    assert final["eval_episodes"] == 8 and 0.0 <= final["eval_success"] <= 1.0  # grid4-test: 4 tasks x 2
    held_out = json.loads((ROOT / "arpo_async" / "splits" / "grid4-test.json").read_text())["grid4"]
    assert set(final["eval_task_success"]) == set(held_out)
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert f"(policy version {last['policy_version']}, step {last['step']}): mean score" in learner_log
    assert learner_log.index("phase training:") < learner_log.index("phase final_evaluation:")  # after the loop
    assert status["totals"]["eval_trajectories"] >= 8
    assert run_containers(load_config(run_dir / "config.toml", []).resolved_run_id) == []
