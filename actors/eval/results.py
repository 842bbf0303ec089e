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

An episode is done when its ``episode.json`` exists; :func:`read_records` ignores a folder without one, so an
evaluation cut short mid-write re-runs that episode (:mod:`actors.eval.folder` owns which folders a resume may
trust or delete). Files are read only when they are regular files below a size cap (:func:`read_regular`): a FIFO,
a device or a link never hangs or misleads a resume.

Domains and task ids come from task files; a name that is not a safe single path component (``..``, ``/``, NUL,
...) is stored under a quoted form (:func:`safe_name`), so no task can write outside OUT.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import stat
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from arpo_async.messages import Outcome, Trajectory
from arpo_async.success import is_success

RECORD_FILE = "episode.json"
RECORD_MAX_BYTES = 1 << 20
"""An ``episode.json`` or ``result.txt`` larger than this is not ours (ours are a few hundred bytes)."""
ERROR_OUTCOMES = frozenset({Outcome.ENV_ERROR, Outcome.TASK_ERROR, Outcome.ABORTED})
"""Outcomes whose episode is listed as an error (and counts as a failure)."""


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

    A folder left from an earlier try of the same episode is replaced (``arpo eval`` calls this through
    :meth:`actors.eval.folder.ResultsFolder.write_episode`, which first checks the folder is its own). Raises
    OSError when it cannot be written, or when a component below ``out`` is a symbolic link or not a folder:
    nothing is deleted or written through a link.
    """
    folder = episode_dir(out, record.domain, record.task_id, record.repeat)
    path = out
    for part in folder.relative_to(out).parts:
        path = path / part
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise OSError(f"{path} is a symbolic link or not a folder; no episode is written through it")
    if folder.exists():
        remove_tree_below(out, folder.relative_to(out).parts)
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


def remove_tree_below(out: Path, parts: tuple[str, ...] | list[str]) -> None:
    """Delete the directory ``out/<parts...>`` and everything in it, opening each component below ``out`` without
    following a symbolic link (``O_NOFOLLOW`` relative to its parent's descriptor), so a link put on the way, even
    after a check, is never followed; ``shutil.rmtree`` with ``dir_fd`` does not follow links inside either.

    Raises:
        OSError: a component is a symbolic link or not a directory (ELOOP, ENOTDIR), or it cannot be removed.
    """
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = child
        if not stat.S_ISDIR(os.stat(parts[-1], dir_fd=fd, follow_symlinks=False).st_mode):
            raise NotADirectoryError(f"{out.joinpath(*parts)} is a symbolic link or not a folder")
        shutil.rmtree(parts[-1], dir_fd=fd)
    finally:
        os.close(fd)


def read_regular(path: Path, limit: int) -> str:
    """The text of ``path`` when it is a regular file (not a link, FIFO or device) of at most ``limit`` bytes.

    Raises:
        OSError: missing, a symbolic link (ELOOP), or unreadable.
        ValueError: not a regular file, larger than ``limit``, or not UTF-8.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path} is not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path} is larger than {limit} bytes")
    return data.decode("utf-8")


def read_record(path: Path) -> EpisodeRecord | None:
    """The record in ``path`` (an ``episode.json``); None when it is missing, not a regular file, unreadable or
    holds a field of the wrong type (the episode then runs again on --resume)."""
    try:
        record = EpisodeRecord(**json.loads(read_regular(path, RECORD_MAX_BYTES)))
    except (OSError, ValueError, TypeError, RecursionError):
        return None
    typed = (isinstance(record.domain, str) and isinstance(record.task_id, str) and type(record.repeat) is int
             and isinstance(record.score, (int, float)) and isinstance(record.success, bool)
             and isinstance(record.outcome, str) and isinstance(record.error, str) and type(record.steps) is int
             and isinstance(record.seconds, (int, float)) and isinstance(record.instruction, str)
             and (record.policy_version is None or type(record.policy_version) is int))
    return record if typed else None


def record_problem(record: EpisodeRecord, folder: Path, *, success_threshold: float, max_steps: int) -> str | None:
    """Why a finished episode's record cannot be trusted, or None: its fields must agree with each other, with
    the step budget and with ``folder/result.txt`` as :func:`write_episode` and ``actors.eval.runner.record_of``
    write them (outcome from ``actors.episode.episode_outcome``: SUCCESS iff the score is above
    ``success_threshold``; an error outcome has an error, a score of 0.0 and no success)."""
    if record.outcome not in {o.value for o in Outcome}:
        return f"outcome {record.outcome!r} is not one of {', '.join(o.value for o in Outcome)}"
    if not (math.isfinite(record.score) and 0.0 <= record.score <= 1.0):
        return f"score {record.score!r} is not in [0, 1]"
    if not (math.isfinite(record.seconds) and record.seconds >= 0) or not 0 <= record.steps <= max_steps:
        return f"steps {record.steps} or seconds {record.seconds!r} out of range (step budget {max_steps})"
    errored = Outcome(record.outcome) in ERROR_OUTCOMES
    if bool(record.error) != errored or (errored and not record.error.startswith(f"{record.outcome}: ")):
        return f"outcome {record.outcome} with error {record.error[:80]!r}"
    if record.success != (record.outcome == Outcome.SUCCESS):
        return f"success {record.success} with outcome {record.outcome}"
    if errored and record.score != 0.0:
        return f"an errored episode ({record.outcome}) with score {record.score}"
    if not errored and is_success(record.score, success_threshold) != record.success:
        return f"success {record.success} with score {record.score} (success means above {success_threshold})"
    try:
        text = read_regular(folder / "result.txt", RECORD_MAX_BYTES).strip()
        agrees = float(text) == record.score
    except (OSError, ValueError):
        return "result.txt is missing, not a regular file or not a number"
    return None if agrees else f"result.txt says {text[:40]!r}, episode.json score {record.score}"


def read_records(out: Path) -> dict[tuple[str, str, int], EpisodeRecord]:
    """Every finished episode under ``out``, by (domain, task id, repeat), read as any script reads them: no
    consistency check (:meth:`actors.eval.folder.ResultsFolder.finished` is what a resume trusts); folders
    reached through a symbolic link are skipped."""
    records: dict[tuple[str, str, int], EpisodeRecord] = {}
    if not out.is_dir():
        return records
    for path in out.glob(f"*/*/*/{RECORD_FILE}"):
        rel = path.parent.relative_to(out)
        if any((out / Path(*rel.parts[:i])).is_symlink() for i in range(1, len(rel.parts) + 1)):
            continue
        record = read_record(path)
        if record is not None and path.parent == episode_dir(out, record.domain, record.task_id, record.repeat):
            records[record.key] = record
    return records
