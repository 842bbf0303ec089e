"""The Weights & Biases mirror of metrics.jsonl (learner.wandb_project), in W&B's offline mode: the real
MetricsWriter writes records, the real wandb package writes its offline run (``<run>/wandb/offline-run-*``), and
W&B's own reader (``wandb leet inspect --json``, which prints the records of a .wandb transaction log) must find
exactly the numbers of metrics.jsonl at their steps, the run config, and one W&B run id across a resume."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from arpo_async.config import RunConfig, load_config, to_dict
from arpo_async.metrics import WANDB_ID_FILE, MetricsWriter, WandbSettings, flatten_numbers, read_metrics

pytest.importorskip("wandb", reason="the wandb extra is not installed (pip install -e '.[wandb]')")

ROOT = Path(__file__).resolve().parents[2]
W_AND_B_KEYS = {"_runtime", "_step", "_timestamp"}  # what W&B adds to each history row


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """W&B in offline mode, its config and cache folders in tmp_path: nothing leaves the machine."""
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": tmp_path / "wb-config",
                        "WANDB_CACHE_DIR": tmp_path / "wb-cache", "WANDB_DATA_DIR": tmp_path / "wb-data",
                        "WANDB_DIR": tmp_path / "run"}.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def record(step: int) -> dict:
    """A metrics record as learner.train.records.step_record makes them: required keys, a nested dict, a string, a
    bool, a list and a non-finite float (the last four are not numbers and are left out of the mirrors)."""
    return {"step": step, "policy_version": step, "trajectories": 8 * step, "success_rate": 0.125 * step,
            "reward_mean": 0.1 * step - 0.05, "loss": 1.0 / (step + 1), "replay_injections": step % 2,
            "staleness_mean": 0.5, "wall_s": 12.5 * step, "learner_id": "abc", "resumed": False, "tasks": ["t1"],
            "grad_norm": float("nan"), "drops": {"stale": step, "late": {"count": 2 * step}}}


def inspect(run_file: Path) -> list[dict]:
    """The records of a .wandb file, read by W&B's own reader (``wandb leet inspect --json``: one JSON per line)."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def history(records: list[dict]) -> dict[int, dict[str, float]]:
    """step -> the numbers logged at it (W&B's own keys left out)."""
    rows = {}
    for r in records:
        if r["type"] == "history":
            item = r["history"]["item"]
            rows[int(item["_step"])] = {k: v for k, v in item.items() if k not in W_AND_B_KEYS}
    return rows


def test_every_number_of_metrics_jsonl_reaches_the_offline_wandb_run_and_a_resume_continues_it(offline, tmp_path):
    run = tmp_path / "run"
    config = load_config(None, [f"run_dir={run}", "learner.wandb_project=arpo-test", "learner.lr=0.001"])
    settings = WandbSettings("arpo-test", config.resolved_run_id, run, to_dict(config))
    with MetricsWriter(run / "metrics.jsonl", wandb=settings) as writer:
        for step in (1, 2, 3):
            writer.write(record(step))
    run_id = (run / WANDB_ID_FILE).read_text().strip()
    [first] = sorted((run / "wandb").glob(f"offline-run-*-{run_id}"))

    records = inspect(first / f"run-{run_id}.wandb")
    [header] = [r["run"] for r in records if r["type"] == "run"]
    assert (header["run_id"], header["project"], header["display_name"]) == (run_id, "arpo-test", "run")
    logged_config = {k: v for k, v in header["config"]["update"].items() if k != "_wandb"}
    assert logged_config == json.loads(json.dumps(to_dict(config)))  # the run config, tuples as lists
    assert logged_config["learner"]["lr"] == 0.001 and logged_config["learner"]["wandb_project"] == "arpo-test"
    rows = history(records)
    jsonl = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in jsonl] == [1, 2, 3]
    assert rows == {r["step"]: flatten_numbers(r) for r in jsonl}  # exactly the numbers of metrics.jsonl
    assert rows[3]["drops/late/count"] == 6.0 and rows[2]["success_rate"] == 0.25  # nested dicts flattened
    assert "grad_norm" not in rows[1] and "resumed" not in rows[1] and "learner_id" not in rows[1]
    summary = json.loads(subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--summary", "--json",
                                         str(first)], capture_output=True, text=True, timeout=120,
                                        check=True).stdout)
    assert summary["state"] == "finished" and summary["step"] == 3 and summary["summary"]["loss"] == 0.25

    # `arpo run --resume`: a new learner process builds a new MetricsWriter on the same run folder
    with MetricsWriter(run / "metrics.jsonl", wandb=settings) as writer:
        writer.write(record(4))
    assert (run / WANDB_ID_FILE).read_text().strip() == run_id
    runs = sorted((run / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(p.name.endswith(f"-{run_id}") for p in runs)  # the same W&B run, resumed
    [second] = [p for p in runs if p != first]
    resumed = inspect(second / f"run-{run_id}.wandb")
    assert [r["run"]["resume"] for r in resumed if r["type"] == "run"] == [True]
    assert history(resumed) == {4: flatten_numbers(record(4))}


def test_no_wandb_mirror_without_a_project(offline, tmp_path):
    """Off by default: learner.wandb_project is empty and the learner passes no WandbSettings."""
    assert RunConfig().learner.wandb_project == ""
    with MetricsWriter(tmp_path / "run" / "metrics.jsonl") as writer:
        writer.write(record(1))
    assert writer.wandb is None
    assert not (tmp_path / "run" / "wandb").exists() and not (tmp_path / "run" / WANDB_ID_FILE).exists()


def test_a_missing_wandb_package_is_a_clear_error(tmp_path):
    """Without the package (``sys.modules["wandb"] = None`` makes ``import wandb`` fail as in an environment
    without it) the writer refuses with the install command and the way to turn the mirror off."""
    code = ("import sys; sys.modules['wandb'] = None\n"
            "from pathlib import Path\n"
            "from arpo_async.metrics import MetricsWriter, WandbSettings\n"
            "try:\n"
            f"    MetricsWriter(Path({str(tmp_path / 'metrics.jsonl')!r}), wandb=WandbSettings('p', 'n', "
            f"Path({str(tmp_path)!r})))\n"
            "except RuntimeError as error:\n"
            "    print(error)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert "learner.wandb_project='p' needs the wandb package" in out
    assert "pip install -e '.[wandb]'" in out and "unset learner.wandb_project" in out
