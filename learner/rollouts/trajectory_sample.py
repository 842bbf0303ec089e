"""Trajectory sample: a bounded set of received trajectories kept with their screenshots, for `arpo view`.

Owns: ``<run>/trajectories/<step>-<task>-<id>/`` folders, each holding ``record.json`` (the record below) and
the trajectory's screenshots as received (``shot-<i>.png`` / ``.jpg``, the bytes the desktop sent).

Which trajectories are kept:

- every task's first SUCCESS in this run (``first_success: true``; never deleted, at most one per task);
- besides, a fraction ``rate`` of all trajectories, chosen by a hash of the trajectory id (the same trajectory
  is always chosen or not, whatever the arrival order or a restart);
- when the folder outgrows ``disk_mb``, the oldest samples that are not first successes are deleted until it
  fits again (first successes count towards the total but are not deleted).

Record (``record.json``, schema 1): ``trajectory_id``, ``task_id``, ``family``, ``instruction``, ``group_id``,
``rollout_index``, ``actor_id``, ``desktop``, ``outcome`` (an Outcome value), ``score`` (evaluator reward in
[0, 1]), ``format_ok``, ``error``, ``timings`` (seconds per stage: reset_s, setup_s, episode_s, evaluate_s),
``assigned_version`` (policy version when handed out), ``policy_version`` (learner's version on arrival),
``learner_step``, ``received_at`` (Unix seconds), ``first_success``, ``screen_size`` ([width, height] in pixels of
the first screenshot, [0, 0] when unknown), ``screenshots`` (file names, index = ``Trajectory.screenshots``
index) and ``steps``: per policy step ``text`` (the reply), ``thought``, ``action`` (the compact form,
actors.episode.describe), ``actions`` (each ``{"kind", "point": [x, y] | null, "end_point": [x, y] | null,
"detail": str}``, coordinates in screen pixels), ``screenshot`` (index of the screenshot the step acted on, the
last image of its prompt; null if none), ``versions`` ([min, max] token policy versions; [] if no token),
``generate_s``, ``act_s``, ``observe_s``.

Invariant: a folder is complete when it is visible (written under a temporary name, then renamed).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from arpo_async.messages import Outcome, Step, Trajectory
from arpo_async.tasks import Task

log = logging.getLogger(__name__)

RECORD_FILE = "record.json"
SCHEMA = 1
_THOUGHT = re.compile(r"Thought:\s*(.*?)\s*(?:Action:|\Z)", re.DOTALL)
_ACTION = re.compile(r"""(\w+)\((?:(-?\d+(?:\.\d+)?(?:,-?\d+(?:\.\d+)?)*)|('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"))?\)""")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def parse_compact_actions(compact: str) -> list[dict[str, Any]]:
    """Read ``Step.action`` (actions.episode.describe's compact forms joined by "; ") back into structured actions.

    Example: ``"drag(10,20,300,40)"`` -> ``[{"kind": "drag", "point": [10, 20], "end_point": [300, 40],
    "detail": ""}]``; ``"type('hi')"`` -> ``[{"kind": "type", "point": None, "end_point": None, "detail": "hi"}]``.
    Coordinates are screen pixels (floats). Text that is not in that form (or "") gives ``[]`` rather than raising:
    the sample is for people to look at, and an unparsed action is still shown as text.
    """
    actions: list[dict[str, Any]] = []
    pos = 0
    while pos < len(compact):
        m = _ACTION.match(compact, pos)
        if m is None:
            return []
        kind, numbers, quoted = m.groups()
        coords = [float(n) for n in numbers.split(",")] if numbers else []
        if len(coords) not in (0, 2, 4):
            return []
        detail = ""
        if quoted:
            detail = re.sub(r"\\(.)", lambda e: {"n": "\n", "t": "\t"}.get(e.group(1), e.group(1)), quoted[1:-1])
        actions.append({"kind": kind, "point": coords[:2] or None, "end_point": coords[2:4] or None,
                        "detail": detail})
        pos = m.end()
        if compact.startswith("; ", pos):
            pos += 2
    return actions


def thought_of(reply: str) -> str:
    """The ``Thought:`` part of a UI-TARS reply (stripped), or "" when it has none."""
    m = _THOUGHT.search(reply)
    return m.group(1).strip() if m else ""


def image_suffix(data: bytes) -> str:
    """File suffix for screenshot bytes: ".png", ".jpg", else ".bin" (from the magic bytes)."""
    data = bytes(data[:8])  # a received screenshot is a memoryview of its frame (arpo_async.codec)
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return ".png"
    if data.startswith(b"\xff\xd8"):
        return ".jpg"
    return ".bin"


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) in pixels from an image's header; (0, 0) when it is not an image PIL can read."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.size
    except (OSError, ValueError, Image.DecompressionBombError):
        return (0, 0)


def step_record(step: Step) -> dict[str, Any]:
    """The record of one policy step (see the module docstring)."""
    return {"text": step.text, "thought": thought_of(step.text), "action": step.action,
            "actions": parse_compact_actions(step.action),
            "screenshot": step.image_indices[-1] if step.image_indices else None,
            "versions": [int(step.versions.min()), int(step.versions.max())] if len(step.versions) else [],
            "generate_s": step.generate_s, "act_s": step.act_s, "observe_s": step.observe_s}


def trajectory_record(traj: Trajectory, task: Task, *, step: int, version: int, first_success: bool,
                      screenshots: list[str]) -> dict[str, Any]:
    """The ``record.json`` of one sampled trajectory (see the module docstring); ``screenshots`` are its file names."""
    size = image_size(traj.screenshots[0]) if traj.screenshots else (0, 0)
    return {"schema": SCHEMA, "trajectory_id": traj.trajectory_id, "task_id": traj.task_id, "family": task.family,
            "instruction": task.instruction, "group_id": traj.group_id, "rollout_index": traj.rollout_index,
            "actor_id": traj.actor_id, "desktop": traj.desktop, "outcome": traj.outcome, "score": traj.score,
            "format_ok": traj.format_ok, "error": traj.error, "timings": dict(traj.timings),
            "assigned_version": traj.assigned_version, "policy_version": version, "learner_step": step,
            "received_at": time.time(), "first_success": first_success, "screen_size": list(size),
            "screenshots": screenshots, "steps": [step_record(s) for s in traj.steps]}


@dataclass
class _Kept:
    path: Path
    size: int
    """Bytes on disk."""
    pinned: bool
    """A first success (never deleted)."""


class TrajectorySampler:
    """Keeps the sample described in the module docstring under ``root``.

    Args:
        root: the sample folder (``<run>/trajectories``); created when missing. Samples already there (a resumed
            run) are counted towards the budget, and their first successes stay first.
        rate: fraction of trajectories kept, in [0, 1] (``learner.sample_trajectories``).
        disk_mb: budget in MiB (``learner.sample_disk_mb``), > 0.

    Raises:
        ValueError: ``rate`` outside [0, 1] or ``disk_mb`` <= 0.
    """

    def __init__(self, root: Path, *, rate: float, disk_mb: float) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"sample rate must be in [0, 1], got {rate}")
        if disk_mb <= 0:
            raise ValueError(f"sample disk budget must be > 0 MiB, got {disk_mb}")
        self.root, self.rate, self.budget_bytes = Path(root), rate, int(disk_mb * 2 ** 20)
        self.root.mkdir(parents=True, exist_ok=True)
        self.kept: list[_Kept] = []
        """Samples on disk, oldest first."""
        self.solved: set[str] = set()
        """Task ids whose first success is kept."""
        self.deleted = 0
        """Samples deleted to stay within the budget."""
        self._lock = threading.Lock()
        self._load()

    @property
    def used_bytes(self) -> int:
        return sum(k.size for k in self.kept)

    def _load(self) -> None:
        found = []
        for record_path in self.root.glob(f"*/{RECORD_FILE}"):
            try:
                record = json.loads(record_path.read_text())
            except (OSError, ValueError) as error:
                log.warning("ignoring trajectory sample %s: %s", record_path.parent, error)
                continue
            folder = record_path.parent
            found.append((record.get("received_at", 0.0), _Kept(folder, _folder_bytes(folder),
                                                                bool(record.get("first_success")))))
            if record.get("first_success"):
                self.solved.add(str(record.get("task_id")))
        self.kept = [k for _, k in sorted(found, key=lambda pair: pair[0])]

    def chosen(self, trajectory_id: str) -> bool:
        """True when ``trajectory_id`` falls in the random ``rate`` fraction (SHA-1 of the id, uniform in [0, 1))."""
        digest = hashlib.sha1(trajectory_id.encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2 ** 64 < self.rate

    def decide(self, traj: Trajectory) -> tuple[bool, bool]:
        """(keep, first_success) for ``traj``; marks its task solved when it is a first success."""
        first = traj.outcome is Outcome.SUCCESS and traj.task_id not in self.solved
        if first:
            self.solved.add(traj.task_id)
        return first or self.chosen(traj.trajectory_id), first

    async def offer(self, traj: Trajectory, task: Task, *, step: int, version: int) -> Path | None:
        """Keep ``traj`` if the sample wants it (writing in a worker thread); returns its folder, or None.

        ``step`` and ``version``: the learner's optimizer step and policy version on arrival. Disk errors are
        logged and give None (a full disk must not stop training).
        """
        keep, first = self.decide(traj)
        if not keep:
            return None
        try:
            return await asyncio.to_thread(self.write, traj, task, step=step, version=version, first_success=first)
        except OSError as error:
            log.warning("could not keep trajectory %s in %s: %s", traj.trajectory_id, self.root, error)
            return None

    def write(self, traj: Trajectory, task: Task, *, step: int, version: int, first_success: bool) -> Path:
        """Write one sample folder, then delete the oldest unpinned samples beyond the budget. Returns the folder.

        Raises:
            OSError: the folder could not be written.
        """
        name = f"{step:06d}-{_UNSAFE.sub('_', traj.task_id)[:60]}-{traj.trajectory_id[:12]}"
        final, tmp = self.root / name, self.root / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        files = []
        for i, shot in enumerate(traj.screenshots):
            files.append(f"shot-{i}{image_suffix(shot)}")
            (tmp / files[-1]).write_bytes(shot)
        record = trajectory_record(traj, task, step=step, version=version, first_success=first_success,
                                   screenshots=files)
        (tmp / RECORD_FILE).write_text(json.dumps(record, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        with self._lock:
            self.kept = [k for k in self.kept if k.path != final]
            self.kept.append(_Kept(final, _folder_bytes(final), first_success))
            self._prune()
        return final

    def _prune(self) -> None:
        used = self.used_bytes
        for kept in list(self.kept):
            if used <= self.budget_bytes:
                break
            if kept.pinned:
                continue
            shutil.rmtree(kept.path, ignore_errors=True)
            self.kept.remove(kept)
            used -= kept.size
            self.deleted += 1


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
