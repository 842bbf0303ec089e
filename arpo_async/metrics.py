"""Run metrics: one JSON object per line in ``<run_dir>/metrics.jsonl``, mirrored to TensorBoard and, optionally,
Weights & Biases.

Owns: the file format of metrics.jsonl, its TensorBoard mirror and its Weights & Biases mirror. Each trained
batch (``learner.updates_per_batch`` optimizer steps; its ``step`` counts optimizer steps) appends one object with
at least step, policy_version, trajectories, success_rate, reward_mean, loss, replay_injections,
staleness_mean and wall_s (every field: arpo_async.metric_fields, built by learner.train.records.step_record). One
record is not a batch's: a run that stops before learner.steps because every task is solved ends with an
evaluation record, step, policy_version and wall_s of its final weights and the final held-out round's eval_*
fields, nothing else (:data:`EVALUATION_RECORD_KEYS`; learner.train.records.evaluation_record); a reader of
training fields takes :func:`training_records`. Lines are flushed as written, so a reader (`arpo run`'s progress
line, a notebook) always sees whole steps; a torn last line after a crash is skipped by the reader.

Invariant: with a TensorBoard folder, every number of a record (nested dicts flattened to ``a/b/c`` names, see
:func:`flatten_numbers`) is written as a scalar at ``global_step = record["step"]``, so the event files hold
exactly the numbers of metrics.jsonl; with a Weights & Biases mirror the same numbers (same names) are logged
at ``step = record["step"]``.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

REQUIRED_KEYS = ("step", "policy_version", "trajectories", "success_rate", "reward_mean", "loss",
                 "replay_injections", "staleness_mean", "wall_s")
"""The keys every trained batch's record has."""
EVALUATION_RECORD_KEYS = ("step", "policy_version", "wall_s", "eval_success")
"""The keys an evaluation record has (with the other eval_* fields of its round, and no training field)."""


def is_training_record(record: dict[str, Any]) -> bool:
    """Whether ``record`` is a trained batch's (it has every :data:`REQUIRED_KEYS` key), not an evaluation
    record."""
    return all(key in record for key in REQUIRED_KEYS)


def training_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of trained batches among ``records`` (in order), without the evaluation record."""
    return [record for record in records if isinstance(record, dict) and is_training_record(record)]


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


WANDB_ID_FILE = "wandb-run-id"
"""The file in the run folder holding the W&B run id, so a resumed run (``arpo run --resume``) logs to the same
W&B run."""


@dataclass(frozen=True)
class WandbSettings:
    """Where a :class:`WandbMirror` logs: the W&B ``project``, the run's display ``name`` (the run id), the run
    folder (``run_dir``: W&B's files go to ``<run_dir>/wandb``, the run id to ``<run_dir>/wandb-run-id``) and the
    run ``config`` shown in W&B (a plain dict, e.g. arpo_async.config.to_dict of the RunConfig)."""

    project: str
    name: str
    run_dir: Path
    config: dict[str, Any] = field(default_factory=dict)


def import_wandb(project: str) -> Any:
    """The ``wandb`` module, for ``learner.wandb_project = project``.

    Raises:
        RuntimeError: the package is not installed (the message says how to install it, or to unset the key).
    """
    try:
        import wandb
    except ImportError as error:
        raise RuntimeError(f"learner.wandb_project={project!r} needs the wandb package ({error}): "
                           "pip install -e '.[wandb]' in the clone, or unset learner.wandb_project "
                           "(--set learner.wandb_project=)") from error
    return wandb


class WandbMirror:
    """Logs metrics records to Weights & Biases: ``wandb.log(flatten_numbers(record), step=record["step"])``.

    The W&B run id is created once and kept in ``<run_dir>/wandb-run-id``; ``wandb.init(resume="allow")`` with it
    makes a resumed run continue the same W&B run. W&B's own environment variables apply (``WANDB_MODE=offline``
    writes ``<run_dir>/wandb/offline-run-*`` without a network, to upload later with ``wandb sync``;
    ``WANDB_API_KEY``, ``WANDB_ENTITY``). W&B drops (with a warning) a step lower than one it already has, which is
    what happens to steps a resumed run redoes after rolling back to its checkpoint. Console capture is off: the
    learner's log is in ``<run>/logs``.

    Raises:
        RuntimeError: the ``wandb`` package is not installed (the message says how to install it or turn the
            mirror off by unsetting learner.wandb_project).
    """

    def __init__(self, settings: WandbSettings) -> None:
        wandb = import_wandb(settings.project)
        run_dir = Path(settings.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        id_file = run_dir / WANDB_ID_FILE
        run_id = id_file.read_text(encoding="utf-8").strip() if id_file.is_file() else ""
        if not run_id:
            run_id = uuid.uuid4().hex[:16]  # W&B run ids: letters and digits
            id_file.write_text(run_id + "\n", encoding="utf-8")
        self.run_id = run_id
        self._run = wandb.init(project=settings.project, name=settings.name, id=run_id, resume="allow",
                               dir=str(run_dir), config=settings.config, settings=wandb.Settings(console="off"))

    def write(self, record: dict[str, Any]) -> None:
        """Log every number of ``record`` (flattened as for TensorBoard) at W&B step ``record["step"]``."""
        self._run.log(flatten_numbers(record), step=int(record["step"]))

    def close(self) -> None:
        """Finish the W&B run (offline: the run folder is complete; online: waits for the upload)."""
        self._run.finish()


class MetricsWriter:
    """Appends metric records to a JSONL file (created with its parent folders).

    ``tensorboard``: a folder to mirror every record to as TensorBoard scalars (None: JSONL only). Records
    already in the file mark where a resumed run continues: TensorBoard events of later steps are purged.
    ``wandb``: where to mirror every record to Weights & Biases (:class:`WandbMirror`; None: not at all).

    Raises:
        RuntimeError: a mirror's package (tensorboard, wandb) is not installed.
    """

    def __init__(self, path: Path, tensorboard: Path | None = None, wandb: WandbSettings | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.tensorboard: TensorBoardMirror | None = None
        self.wandb: WandbMirror | None = None
        if tensorboard is not None:
            steps = [r["step"] for r in read_metrics(path) if isinstance(r, dict) and isinstance(r.get("step"), int)]
            self.tensorboard = TensorBoardMirror(tensorboard, purge_step=max(steps) + 1 if steps else None)
        if wandb is not None:
            self.wandb = WandbMirror(wandb)
        self._file: TextIO = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Append one record, a trained batch's or an evaluation record (and mirror it to TensorBoard and W&B).
        Raises ValueError when a required key is missing (:data:`REQUIRED_KEYS`, or for a record without training
        fields :data:`EVALUATION_RECORD_KEYS`)."""
        training = any(k in record for k in REQUIRED_KEYS if k not in EVALUATION_RECORD_KEYS)
        missing = [k for k in (REQUIRED_KEYS if training else EVALUATION_RECORD_KEYS) if k not in record]
        if missing:
            raise ValueError(f"metrics record lacks {missing}")
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean, sort_keys=True) + "\n")
        self._file.flush()
        if self.tensorboard is not None:
            self.tensorboard.write(record)
        if self.wandb is not None:
            self.wandb.write(record)

    def close(self) -> None:
        self._file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.close()

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
