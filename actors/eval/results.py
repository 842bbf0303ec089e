"""One evaluation episode on disk, in OSWorld's results layout, so OSWorld's own ``show_result.py`` reads ours.

Matched to https://github.com/xlang-ai/OSWorld at commit 5f6497afda80807c4739c08f28dbe64242b814b0 (2025-02-15):
``lib_run_single.run_single_example`` writes, per example, ``<result_dir>/<action_space>/<observation_type>/
<model>/<domain>/<example id>/``: per action a screenshot ``step_<n>_<timestamp>.png`` of the screen AFTER the action
(the observation ``env.step`` returns) and a ``traj.jsonl`` line (``step_num`` from 1, ``action_timestamp`` taken
with ``datetime.now()`` just before the action, ``action``, ``reward`` and ``done`` and ``info`` as ``env.step``
returns them, ``screenshot_file``; later versions add ``response``, the reply, and print the timestamp with
microseconds, ``"%Y%m%d@%H%M%S%f"``, as we do), then ``result.txt`` (the evaluator's score as ``f"{result}\\n"``).
When an example raises, ``run.py`` appends ``{"Error": ...}`` to its ``traj.jsonl`` and writes no ``result.txt``,
so ``show_result.get_result`` (which averages every ``<domain>/<example id>/result.txt`` under that prefix) leaves
it out. We write the same, per root (:class:`Layout`)::

    ROOT/<domain>/<task id>/result.txt     the score (none when the episode errored: OSWorld's rule)
                           /traj.jsonl     a line per policy step (OSWorld's keys), then {"Error": ...} if errored
                           /step_<n>_<timestamp>.png   the screen after step n's action (or .jpg)
                           /step_0.png     the screen the first step saw (OSWorld keeps none; ours, for demos)
                           /episode.json   our record (:class:`EpisodeRecord`); written last

where ROOT is OUT for one repeat, ``OUT/repeat-<k>`` for repeat k of K > 1 (k from 1), and either followed by
``<action space>/<observation type>/<model>`` when ``arpo eval --osworld-prefix`` names them. Each ``traj.jsonl``
line also carries ``observation_file``, the screenshot the step acted on (our key; OSWorld's readers ignore it).
A step that ended the episode without acting (``finished``, ``call_user``, a reply that did not parse) has as its
after-screen the screen it saw; the last action's after-screen is the settled screen the evaluator read
(``Trajectory.final_screenshot``).

An episode is done when its ``episode.json`` exists; :func:`read_records` ignores a folder without one, so an
evaluation cut short mid-write re-runs that episode (:mod:`actors.eval.folder` owns which folders a resume may
trust or delete). Files are read only when they are regular files below a size cap (:func:`read_regular`): a FIFO,
a device or a link never hangs or misleads a resume.

Domains and task ids come from task files; a name that is not a safe single path component (``..``, ``/``, NUL,
...) is stored under a quoted form (:func:`safe_name`), so no task can write outside OUT.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import shutil
import stat
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from arpo_async.messages import Outcome, Step, Trajectory
from arpo_async.success import is_success

RECORD_FILE = "episode.json"
RECORD_MAX_BYTES = 1 << 20
"""An ``episode.json`` or ``result.txt`` larger than this is not ours (ours are a few hundred bytes)."""
ERROR_OUTCOMES = frozenset({Outcome.ENV_ERROR, Outcome.TASK_ERROR, Outcome.ABORTED})
"""Outcomes whose episode is listed as an error (and counts as a failure)."""
TIMESTAMP_FORMAT = "%Y%m%d@%H%M%S%f"
"""``action_timestamp`` as OSWorld's ``lib_run_single.run_single_example`` prints it (local time); the commit we
cite printed ``"%Y%m%d@%H%M%S"``, OSWorld's main adds the microseconds (``%f``)."""
REPEAT_ROOT = "repeat-{}"
"""The root of repeat k (from 1) when an evaluation has more than one repeat: ``OUT/repeat-1``, ..."""
INITIAL_SCREEN = "step_0"
"""The file name (before its suffix) of the screen the first step saw."""


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


def parse_prefix(text: str | None) -> tuple[str, ...]:
    """``--osworld-prefix``'s ``ACTION_SPACE/OBSERVATION_TYPE/MODEL`` (e.g. ``pyautogui/screenshot/ui-tars``) as
    three folder names, or () for None or "". Each must be a safe single path component (:func:`safe_name` keeps it
    as it is: not empty, ".", "..", no "/", "\\\\", NUL or unprintable character) and not start with "repeat-".

    Raises:
        ValueError: one line naming the prefix and what is wrong (absolute, "..", not three names, ...).
    """
    if not text:
        return ()
    parts = text.split("/")
    bad = [p for p in parts if p != safe_name(p) or p.startswith("repeat-")]
    if len(parts) != 3 or bad:
        why = ("an absolute path" if text.startswith("/") else f"{len(parts)} names" if not bad
               else f"{bad[0]!r} is reserved for repeats" if bad[0].startswith("repeat-")
               else f"{bad[0]!r} is not a plain folder name")
        raise ValueError(f"--osworld-prefix {text!r}: give ACTION_SPACE/OBSERVATION_TYPE/MODEL, three plain folder "
                         f"names (OSWorld's results/<action_space>/<observation_type>/<model>/); {why}")
    return tuple(parts)


@dataclass(frozen=True)
class Layout:
    """Where an evaluation's episodes go under OUT (module docstring): ``repeats`` (K) and the OSWorld ``prefix``
    (() or three names, :func:`parse_prefix`). Raises ValueError when built with a bad one."""

    repeats: int = 1
    prefix: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if type(self.repeats) is not int or self.repeats < 1:
            raise ValueError(f"repeats {self.repeats!r} is not an integer >= 1")
        if parse_prefix("/".join(self.prefix)) != tuple(self.prefix):
            raise ValueError(f"prefix {self.prefix!r} is not three plain folder names")

    def root(self, repeat: int) -> tuple[str, ...]:
        """The parts below OUT of repeat ``repeat``'s root (from 0): what OSWorld calls the ``result_dir`` plus
        its prefix. Raises ValueError for a repeat outside 0..K-1."""
        if not 0 <= repeat < self.repeats:
            raise ValueError(f"repeat {repeat} outside 0..{self.repeats - 1}")
        return ((REPEAT_ROOT.format(repeat + 1),) if self.repeats > 1 else ()) + self.prefix

    def rel(self, domain: str, task_id: str, repeat: int) -> str:
        """The episode folder below OUT, ``/``-separated, names made safe (:func:`safe_name`)."""
        return "/".join(self.root(repeat) + (safe_name(domain), safe_name(task_id)))

    def valid_rel(self, rel: object) -> bool:
        """``rel`` is an episode folder this layout can make (a manifest entry)."""
        if not isinstance(rel, str):
            return False
        parts = rel.split("/")
        lead = len(parts) - 2
        if lead < 0 or any(p != safe_name(p) for p in parts[lead:]):
            return False
        return any(tuple(parts[:lead]) == self.root(r) for r in range(self.repeats))


SINGLE = Layout()
"""One repeat, no prefix: ``OUT/<domain>/<task id>/``."""


def episode_dir(out: Path, domain: str, task_id: str, repeat: int, layout: Layout = SINGLE) -> Path:
    """The episode's folder under ``out`` (:meth:`Layout.rel`)."""
    return out.joinpath(*layout.rel(domain, task_id, repeat).split("/"))


def action_timestamp(unix_s: float) -> str:
    """``unix_s`` (seconds) as OSWorld's ``action_timestamp`` (:data:`TIMESTAMP_FORMAT`, local time)."""
    return datetime.datetime.fromtimestamp(unix_s).strftime(TIMESTAMP_FORMAT)


def _image_suffix(data: bytes) -> str:
    return ".jpg" if data[:3] == b"\xff\xd8\xff" else ".png"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _ended(step: Step) -> str:
    """How ``step`` ended the episode without acting: "done" (finished), "fail" (call_user / FAIL), "unparsed"
    (the reply did not parse), or "" (it acted)."""
    kind = step.action.split("(", 1)[0]
    return {"finished": "done", "fail": "fail", "": "unparsed"}.get(kind, "")


def after_screens(trajectory: Trajectory) -> list[int | None]:
    """Per step, the index in ``trajectory.screenshots`` of the screen after its action: the next step's
    observation; for the last step the screen it saw when it did not act (:func:`_ended`), else the settled screen
    the evaluator read (``final_screenshot``); None when not recorded (the episode errored first)."""
    steps, out = trajectory.steps, []
    for i, step in enumerate(steps):
        if i + 1 < len(steps):
            nxt = steps[i + 1].image_indices
            out.append(nxt[-1] if nxt else None)
        elif _ended(step):
            out.append(step.image_indices[-1] if step.image_indices else None)
        else:
            final = trajectory.final_screenshot
            out.append(final if 0 <= final < len(trajectory.screenshots) else None)
    return out


def _steps(folder: Path, record: EpisodeRecord, trajectory: Trajectory | None) -> list[str]:
    """Write the screenshots of ``trajectory``'s steps into ``folder``; return the traj.jsonl lines."""
    if trajectory is None:
        return []
    shots, names, lines = trajectory.screenshots, {}, []
    for n, (step, after) in enumerate(zip(trajectory.steps, after_screens(trajectory)), start=1):
        seen = step.image_indices[-1] if step.image_indices else None
        if n == 1 and seen is not None:
            names[seen] = INITIAL_SCREEN + _image_suffix(shots[seen])
            (folder / names[seen]).write_bytes(shots[seen])
        stamp = action_timestamp(step.acted_at)
        shot = ""
        if after is not None:
            shot = f"step_{n}_{stamp}{_image_suffix(shots[after])}"
            (folder / shot).write_bytes(shots[after])
            names.setdefault(after, shot)
        ended = _ended(step)
        lines.append(json.dumps({
            "step_num": n, "action_timestamp": stamp, "action": step.action, "response": step.text, "reward": 0,
            "done": ended in ("done", "fail"), "info": {ended: True} if ended in ("done", "fail") else {},
            "screenshot_file": shot, "observation_file": names.get(seen, "")}))
    return lines


def write_episode(out: Path, record: EpisodeRecord, trajectory: Trajectory | None,
                  layout: Layout = SINGLE) -> Path:
    """Write one episode's folder (module docstring: screenshots, traj.jsonl, result.txt unless it errored, then
    episode.json); returns it. ``reward`` is 0 on every line as OSWorld's ``DesktopEnv.step`` returns it (the score
    is result.txt's); ``done`` and ``info`` are ``env.step``'s for DONE (``{"done": true}``) and FAIL
    (``{"fail": true}``).

    A folder left from an earlier try of the same episode is replaced (``arpo eval`` calls this through
    :meth:`actors.eval.folder.ResultsFolder.write_episode`, which first checks the folder is its own). Raises
    OSError when it cannot be written, or when a component below ``out`` is a symbolic link or not a folder:
    nothing is deleted or written through a link; ValueError for a repeat outside ``layout``.
    """
    folder = episode_dir(out, record.domain, record.task_id, record.repeat, layout)
    path = out
    for part in folder.relative_to(out).parts:
        path = path / part
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise OSError(f"{path} is a symbolic link or not a folder; no episode is written through it")
    if folder.exists():
        remove_tree_below(out, folder.relative_to(out).parts)
    folder.mkdir(parents=True)
    lines = _steps(folder, record, trajectory)
    if record.error:  # as OSWorld's run.py leaves an example that raised: this line, and no result.txt
        lines.append(json.dumps({"Error": f"{record.domain}/{record.task_id}: {record.error}"}))
    (folder / "traj.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    if not record.error:
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
    ``success_threshold``; an error outcome has an error, a score of 0.0, no success and no ``result.txt``, as
    OSWorld's ``run.py`` leaves an example that raised)."""
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
    if errored:  # OSWorld's rule: an example that raised has no result.txt (show_result.py would count it)
        return "an errored episode with a result.txt" if os.path.lexists(folder / "result.txt") else None
    if is_success(record.score, success_threshold) != record.success:
        return f"success {record.success} with score {record.score} (success means above {success_threshold})"
    try:
        text = read_regular(folder / "result.txt", RECORD_MAX_BYTES).strip()
        agrees = float(text) == record.score
    except (OSError, ValueError):
        return "result.txt is missing, not a regular file or not a number"
    return None if agrees else f"result.txt says {text[:40]!r}, episode.json score {record.score}"


def _layout_holds(parts: tuple[str, ...], record: EpisodeRecord) -> bool:
    """``parts`` (an episode folder below OUT) is where some :class:`Layout` puts ``record``: a root of none,
    ``repeat-<k>`` (k = its repeat + 1) or either with a three-name prefix, then its domain and task id."""
    if parts[-2:] != (safe_name(record.domain), safe_name(record.task_id)):
        return False
    lead = parts[:-2]
    repeat_root = REPEAT_ROOT.format(record.repeat + 1)
    if lead and lead[0] == repeat_root:
        lead = lead[1:]
    elif record.repeat != 0:
        return False
    return len(lead) in (0, 3) and all(p == safe_name(p) for p in lead)


def read_records(out: Path) -> dict[tuple[str, str, int], EpisodeRecord]:
    """Every finished episode under ``out``, by (domain, task id, repeat), read as any script reads them: no
    consistency check (:meth:`actors.eval.folder.ResultsFolder.finished` is what a resume trusts); the walk follows
    no symbolic link, and a record counts only in a folder a :class:`Layout` would put it in."""
    records: dict[tuple[str, str, int], EpisodeRecord] = {}
    if not out.is_dir() or out.is_symlink():
        return records
    for dirpath, dirnames, filenames in os.walk(out):  # os.walk does not descend into linked folders
        parts = Path(dirpath).relative_to(out).parts
        if len(parts) >= 6:
            dirnames.clear()  # the deepest layout: repeat-<k>/<3 prefix names>/<domain>/<task id>
        if RECORD_FILE not in filenames or len(parts) < 2:
            continue
        record = read_record(Path(dirpath) / RECORD_FILE)
        if record is not None and _layout_holds(parts, record):
            records[record.key] = record
    return records
