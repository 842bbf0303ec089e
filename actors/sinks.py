"""Trajectory sinks: where a finished episode goes.

Role: decouples the episode loop from the learner. A sink is anything with ``async submit(trajectory)``:

- :class:`~actors.link.LearnerLink`: the ZeroMQ link to the learner (holds the trajectory until acknowledged);
- :class:`ListSink`: a list in memory;
- :class:`JsonlSink`: one JSON line per trajectory in a file, screenshots as image files beside it.

Invariant: a sink's ``submit`` returns once it has taken the trajectory (appended, written, or held for resend).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from arpo_async.messages import Trajectory


@runtime_checkable
class TrajectorySink(Protocol):
    """Takes finished trajectories (``arpo_async.messages.Trajectory``)."""

    async def submit(self, trajectory: Trajectory) -> None: ...


class ListSink(list):
    """A list of the trajectories submitted, in submission order (``sink[0]``, ``len(sink)``)."""

    async def submit(self, trajectory: Trajectory) -> None:
        """Append ``trajectory``."""
        self.append(trajectory)


def _image_suffix(data: bytes) -> str:
    return ".jpg" if data[:3] == b"\xff\xd8\xff" else ".png"


class JsonlSink:
    """Appends each trajectory to ``path`` as one JSON object per line.

    The object holds every Trajectory field (steps with their token ids, log-probs, versions, reply text and
    action) except the screenshot bytes: ``screenshots`` is the list of the files they were written to,
    ``<screenshot_dir>/<trajectory_id>-<i>.png`` (or ``.jpg``), relative to the folder of ``path``;
    ``screenshot_dir`` defaults to ``<path without suffix>-screenshots``. With ``screenshot_dir=False`` no image
    is written and ``screenshots`` is an empty list (``screenshot_count`` is always there).

    Args:
        path: the JSONL file (created with its parent folders; appended to when it exists).
        screenshot_dir: where screenshots go (see above).

    Raises:
        OSError: from :meth:`submit`, when the file or an image cannot be written.
    """

    def __init__(self, path: str | Path, *, screenshot_dir: str | Path | bool | None = None) -> None:
        self.path = Path(path)
        if screenshot_dir is False:
            self.screenshot_dir: Path | None = None
        elif screenshot_dir is None or screenshot_dir is True:
            self.screenshot_dir = self.path.with_name(self.path.stem + "-screenshots")
        else:
            self.screenshot_dir = Path(screenshot_dir)
        self.count = 0
        """Trajectories written by this sink."""
        self._lock = asyncio.Lock()

    async def submit(self, trajectory: Trajectory) -> None:
        """Write ``trajectory`` (its screenshots first, then its line); lines of concurrent submits never mix."""
        async with self._lock:
            await asyncio.to_thread(self._write, trajectory)
            self.count += 1

    def _write(self, trajectory: Trajectory) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = dataclasses.asdict(trajectory)
        shots: list[str] = []
        if self.screenshot_dir is not None:
            self.screenshot_dir.mkdir(parents=True, exist_ok=True)
            for i, data in enumerate(trajectory.screenshots):
                file = self.screenshot_dir / f"{trajectory.trajectory_id}-{i}{_image_suffix(data)}"
                file.write_bytes(data)
                shots.append(str(file.relative_to(self.path.parent)) if file.is_relative_to(self.path.parent)
                             else str(file))
        record["screenshots"] = shots
        record["screenshot_count"] = len(trajectory.screenshots)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record, default=_json_array) + "\n")


def _json_array(value: object) -> list:
    """A step's packed array (token ids, log-probs, versions) as a JSON list; TypeError for anything else."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
