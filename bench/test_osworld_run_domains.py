"""bench.osworld_run_domains: a run's kept trajectories counted per OSWorld domain (ran, errored by cause, scored)."""
from __future__ import annotations

import json
from pathlib import Path

from bench.osworld_run_domains import cause, domain_counts, main

OSWORLD_TASKS = Path(__file__).resolve().parents[1] / "tests" / "data" / "tasks" / "osworld"


def test_the_cause_is_the_errors_type_and_for_setup_its_steps_kind():
    assert cause("TaskSetupError: setup step 0 (download): download https://x failed") == \
        "TaskSetupError: setup step 0 (download)"
    assert cause("DesktopError: container exited") == "DesktopError"
    assert cause("") == cause("!!") == "unknown"


def test_records_are_counted_per_domain_with_each_error_cause_once_exemplified():
    records = [{"task_id": "a", "outcome": "SUCCESS"}, {"task_id": "a", "outcome": "FAILURE"},
               {"task_id": "b", "outcome": "ENV_ERROR", "error": "DesktopError: gone"},
               {"task_id": "b", "outcome": "ENV_ERROR", "error": "DesktopError: again"},
               {"task_id": "b", "outcome": "TRUNCATED"}, {"task_id": "zz", "outcome": "TASK_ERROR", "error": ""}]
    table = domain_counts(records, {"a": "os", "b": "vlc"})
    assert table["os"] == {"ran": 2, "errored": 0, "scored": 2, "succeeded": 1, "causes": {}}
    assert table["vlc"] == {"ran": 3, "errored": 2, "scored": 1, "succeeded": 0,
                            "causes": {"ENV_ERROR DesktopError": [2, "DesktopError: gone"]}}
    assert table["?"]["causes"] == {"TASK_ERROR unknown": [1, ""]}  # a task the folder does not hold


def test_main_reads_the_runs_records_and_says_when_there_are_none(tmp_path, capsys):
    assert main([str(tmp_path), "--tasks", str(OSWORLD_TASKS)]) == 2
    for i, (task, outcome) in enumerate([("arpo-os-until", "SUCCESS"), ("arpo-vlc-max-volume", "ABORTED")]):
        (tmp_path / "trajectories" / str(i)).mkdir(parents=True)
        (tmp_path / "trajectories" / str(i) / "record.json").write_text(
            json.dumps({"task_id": task, "outcome": outcome, "error": "PolicyTimeout: late"}))
    (tmp_path / "trajectories" / "broken").mkdir()
    (tmp_path / "trajectories" / "broken" / "record.json").write_text("{")
    assert main([str(tmp_path), "--tasks", str(OSWORLD_TASKS)]) == 0
    out = capsys.readouterr().out
    assert "ABORTED PolicyTimeout" in out
    assert out.strip().splitlines()[-1] == ("records=2 domains=2 ran=2 errored=1 scored=1 succeeded=1 "
                                            "domains_scored=1")
