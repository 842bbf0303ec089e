"""Run metrics: one JSON object per line in ``<run_dir>/metrics.jsonl``.

Owns: the file format of metrics.jsonl. Each optimizer step appends one object with at least
step, policy_version, trajectories, success_rate, reward_mean, loss, replay_injections, staleness_mean and
wall_s (see learner.main for the full list). Lines are flushed as written, so a reader (`arpo run`'s
progress line, a notebook) always sees whole steps; a torn last line after a crash is skipped by the reader.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, TextIO

REQUIRED_KEYS = ("step", "policy_version", "trajectories", "success_rate", "reward_mean", "loss",
                 "replay_injections", "staleness_mean", "wall_s")


class MetricsWriter:
    """Appends metric records to a JSONL file (created with its parent folders)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: TextIO = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Append one record. Raises ValueError when a required key is missing."""
        missing = [k for k in REQUIRED_KEYS if k not in record]
        if missing:
            raise ValueError(f"metrics record lacks {missing}")
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All complete records in a metrics.jsonl (an unfinished last line is skipped); [] if absent."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
