"""Run metrics: one JSON object per line in ``<run_dir>/metrics.jsonl``, mirrored to TensorBoard.

Owns: the file format of metrics.jsonl and its TensorBoard mirror. Each trained batch (``learner.updates_per_batch``
optimizer steps; its ``step`` counts optimizer steps) appends one object with
at least step, policy_version, trajectories, success_rate, reward_mean, loss, replay_injections,
staleness_mean and wall_s (see learner.main.step_record for the full list). Lines are flushed as written, so a
reader (`arpo run`'s progress line, a notebook) always sees whole steps; a torn last line after a crash is
skipped by the reader.

Invariant: with a TensorBoard folder, every number of a record (nested dicts flattened to ``a/b/c`` names, see
:func:`flatten_numbers`) is written as a scalar at ``global_step = record["step"]``, so the event files hold
exactly the numbers of metrics.jsonl.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, TextIO

REQUIRED_KEYS = ("step", "policy_version", "trajectories", "success_rate", "reward_mean", "loss",
                 "replay_injections", "staleness_mean", "wall_s")


def flatten_numbers(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of a (nested) metrics record, as TensorBoard scalars.

    Nested dicts are flattened with ``/`` (``{"drops": {"stale": 2}}`` -> ``{"drops/stale": 2.0}``); ints and
    floats are kept (as float); bools, strings, lists, None and non-finite floats are left out.
    """
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten_numbers(value, f"{name}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value)
    return out


class TensorBoardMirror:
    """Writes metrics records as TensorBoard scalars (torch.utils.tensorboard.SummaryWriter, which needs the
    ``tensorboard`` package) to event files in ``folder``.

    ``purge_step``: on resume, the first step that will be written again; TensorBoard then hides the events a
    previous process wrote at that step or later (the records metrics.jsonl rolled back).

    Raises:
        RuntimeError: the ``tensorboard`` package is not installed (the message says how to install it or turn
            the mirror off with learner.tensorboard=false).
    """

    def __init__(self, folder: Path, purge_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise RuntimeError(f"TensorBoard event files need the tensorboard package ({error}): "
                               "pip install tensorboard, or --set learner.tensorboard=false") from error
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self._writer = SummaryWriter(log_dir=str(folder), purge_step=purge_step)

    def write(self, record: dict[str, Any]) -> None:
        """Write every number of ``record`` at its ``step`` and flush (a reader sees whole steps)."""
        step = int(record["step"])
        for name, value in flatten_numbers(record).items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MetricsWriter:
    """Appends metric records to a JSONL file (created with its parent folders).

    ``tensorboard``: a folder to mirror every record to as TensorBoard scalars (None: JSONL only). Records
    already in the file mark where a resumed run continues: TensorBoard events of later steps are purged.
    """

    def __init__(self, path: Path, tensorboard: Path | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.tensorboard: TensorBoardMirror | None = None
        if tensorboard is not None:
            steps = [r["step"] for r in read_metrics(path) if isinstance(r, dict) and isinstance(r.get("step"), int)]
            self.tensorboard = TensorBoardMirror(tensorboard, purge_step=max(steps) + 1 if steps else None)
        self._file: TextIO = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (and mirror it to TensorBoard). Raises ValueError when a required key is missing."""
        missing = [k for k in REQUIRED_KEYS if k not in record]
        if missing:
            raise ValueError(f"metrics record lacks {missing}")
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean, sort_keys=True) + "\n")
        self._file.flush()
        if self.tensorboard is not None:
            self.tensorboard.write(record)

    def close(self) -> None:
        self._file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
