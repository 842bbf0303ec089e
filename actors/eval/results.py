"""One evaluation episode on disk, laid out as OSWorld's runner lays its results out, so scripts written for
OSWorld read ours.

OSWorld (``lib_run_single.run_single_example`` and ``show_result.py`` in https://github.com/xlang-ai/OSWorld)
writes, per example, ``<result_dir>/<domain>/<example id>/``: ``traj.jsonl`` (one JSON object per step with
``step_num``, ``action_timestamp``, ``action``, ``response``, ``reward``, ``done``, ``info`` and
``screenshot_file``), the step screenshots, and ``result.txt`` (the evaluator's score as text). We add one level
for the repeat and one file of our own::

    OUT/<domain>/<task id>/<repeat>/result.txt     the score ("0.0" for an episode that errored: it counts)
                                   /traj.jsonl     one line per policy step (OSWorld's keys)
                                   /step_<i>.png   the screenshot step i acted on (or .jpg), i from 1
                                   /episode.json   our record (:class:`EpisodeRecord`): outcome, error, steps,
                                                   policy version, seconds; written last

An episode is done when its ``episode.json`` exists; :func:`read_records` ignores (and :func:`clear_partial`
removes) a folder without one, so an evaluation cut short mid-write re-runs that episode.

Domains and task ids come from task files; a name that is not a safe single path component (``..``, ``/``, NUL,
...) is stored under a quoted form (:func:`safe_name`), so no task can write outside OUT.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from arpo_async.messages import Trajectory

RECORD_FILE = "episode.json"


@dataclass(frozen=True)
class EpisodeRecord:
    """The result of one evaluation episode.

    Attributes:
        domain, task_id, repeat: which episode (repeat counts from 0).
        score: the evaluator's score (0.0 when the episode errored).
        success: the episode counts as a success (outcome SUCCESS: score above ``learner.success_threshold``,
            :func:`arpo_async.success.is_success`).
        outcome: the episode's ``arpo_async.messages.Outcome`` value, e.g. "success", "env_error".
        error: why it errored ("" when it did not): the setup, desktop, server or task-file error.
        steps: policy steps taken.
        policy_version: the newest weight version that produced a token of the episode (None when no token was
            sampled, or the policy does not report versions).
        seconds: wall time of the episode.
        instruction: the task's instruction ("" when the task did not load).
    """

    domain: str
    task_id: str
    repeat: int
    score: float
    success: bool
    outcome: str
    error: str = ""
    steps: int = 0
    policy_version: int | None = None
    seconds: float = 0.0
    instruction: str = ""

    @property
    def errored(self) -> bool:
        """The episode ended in an error (it still counts, as a failure)."""
        return bool(self.error)

    @property
    def key(self) -> tuple[str, str, int]:
        return self.domain, self.task_id, self.repeat


def safe_name(name: str) -> str:
    """``name`` as one safe path component: itself when it is one, else percent-quoted (and never "." or "..")."""
    if name and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name \
            and name.isprintable() and len(name.encode()) <= 200:
        return name
    quoted = urllib.parse.quote(name, safe="")[:200] or "_"
    return quoted if quoted not in (".", "..") else quoted.replace(".", "%2E")


def episode_dir(out: Path, domain: str, task_id: str, repeat: int) -> Path:
    """``out/<domain>/<task id>/<repeat>`` with both names made safe (:func:`safe_name`)."""
    return out / safe_name(domain) / safe_name(task_id) / str(repeat)


def _image_suffix(data: bytes) -> str:
    return ".jpg" if data[:3] == b"\xff\xd8\xff" else ".png"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_episode(out: Path, record: EpisodeRecord, trajectory: Trajectory | None) -> Path:
    """Write one episode's folder (screenshots, traj.jsonl, result.txt, then episode.json); returns it.

    A folder left from an earlier try of the same episode is replaced. Raises OSError when it cannot be written.
    """
    folder = episode_dir(out, record.domain, record.task_id, record.repeat)
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    lines = []
    steps = trajectory.steps if trajectory is not None else []
    for i, step in enumerate(steps, start=1):
        shot = ""
        if step.image_indices and trajectory is not None:
            data = trajectory.screenshots[step.image_indices[-1]]
            shot = f"step_{i}{_image_suffix(data)}"
            (folder / shot).write_bytes(data)
        last = i == len(steps)
        lines.append(json.dumps({
            "step_num": i, "action_timestamp": "", "action": step.action, "response": step.text,
            "reward": record.score if last else 0.0, "done": last, "info": {}, "screenshot_file": shot}))
    if record.error:
        lines.append(json.dumps({"Error": record.error}))  # OSWorld's runner logs an exception this way
    (folder / "traj.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    (folder / "result.txt").write_text(f"{record.score}\n", encoding="utf-8")
    _atomic_write(folder / RECORD_FILE, json.dumps(dataclasses.asdict(record), indent=1))
    return folder


def read_record(path: Path) -> EpisodeRecord | None:
    """The record in ``path`` (an ``episode.json``); None when it is missing, unreadable or holds a field of the
    wrong type (the episode then runs again on --resume)."""
    try:
        record = EpisodeRecord(**json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None
    typed = (isinstance(record.domain, str) and isinstance(record.task_id, str) and type(record.repeat) is int
             and isinstance(record.score, (int, float)) and isinstance(record.success, bool)
             and isinstance(record.error, str) and type(record.steps) is int and isinstance(record.seconds, (int, float)))
    return record if typed else None


def read_records(out: Path) -> dict[tuple[str, str, int], EpisodeRecord]:
    """Every finished episode under ``out``, by (domain, task id, repeat)."""
    records: dict[tuple[str, str, int], EpisodeRecord] = {}
    if not out.is_dir():
        return records
    for path in out.glob(f"*/*/*/{RECORD_FILE}"):
        record = read_record(path)
        if record is not None and path.parent == episode_dir(out, record.domain, record.task_id, record.repeat):
            records[record.key] = record
    return records


def clear_partial(out: Path) -> int:
    """Remove episode folders under ``out`` that have no ``episode.json`` (cut short); returns how many."""
    removed = 0
    if not out.is_dir():
        return 0
    for folder in out.glob("*/*/*"):
        if folder.is_dir() and folder.name.isdigit() and not (folder / RECORD_FILE).exists():
            shutil.rmtree(folder)
            removed += 1
    return removed
