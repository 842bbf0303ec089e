"""Learner checkpoints: everything a killed learner needs to continue a run where it left off.

Owns the layout of ``<run>/checkpoints/``. One checkpoint is one folder ``step-<NNNNNN>`` (the optimizer step
it was taken after) holding:

- ``trainer.pt``: model + AdamW state + the trainer's step count (learner.train.train_state.TrainState);
  with several ranks ``trainer.dcp`` instead, a torch.distributed.checkpoint folder of every rank's shards;
- ``learner.pt``: ``torch.save`` of plain data and Outcome members (loaded with ``weights_only=True`` and only
  :class:`~arpo_async.messages.Outcome` allowed besides, never unpickled code):
  the learner service's state (policy version, step, totals, drop counters, scheduler order and task
  statistics, admitted-trajectory count), the replay buffer (each stored trajectory as a reference into
  ``replay.frames``), the state of any extra component (e.g. task selection), and the Python, NumPy and torch RNG
  states;
- ``replay.frames``: the replay buffer's trajectories as wire-codec frames, one write per frame
  (learner.train.frames_file: torch.save of them held the GIL, and so the event loop, for seconds on a loaded machine);
- ``meta.json``: a human-readable summary (step, policy version, trainer steps, replay stats, wall time) and
  the metrics records of its last batch, so metrics.jsonl can be repaired after a crash (:func:`reconcile_metrics`).

Invariants: a checkpoint folder is written under a temporary name and renamed into place, so a folder named
``step-*`` is always complete; the newest ``keep`` are kept; loading tries the newest first and falls back to
an older one when a checkpoint cannot be read (logged), and fails loudly when none can.
What is not saved: rollouts in flight and groups not yet trained (they belong to the learner that handed them
out; their trajectories arrive at the new learner as "late").
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from arpo_async import codec
from arpo_async.messages import Outcome, Trajectory
from arpo_async.metrics import MetricsWriter, read_metrics
from learner.rollouts.service import LearnerService
from learner.train.frames_file import FramesWriter, externalize, internalize, read_frames
from learner.train.train_engine import TrainEngine

log = logging.getLogger(__name__)

SCHEMA = 1
PREFIX = "step-"
FRAMES_FILE = "replay.frames"
"""The replay buffer's trajectories as frames, written outside torch.save (learner.train.frames_file)."""
_MAX_TRAJECTORY_BYTES = 1 << 40  # trajectories were size-checked when they arrived; this only guards the decoder


class CheckpointError(RuntimeError):
    """No checkpoint in the folder could be loaded; the message lists each one's error."""


class Stateful(Protocol):
    """A component that is saved with the checkpoint (plain-data state)."""

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Replay(Protocol):
    """The replay buffer's checkpoint interface (learner.algo.replay: SuccessReplay, PrioritizedReplay)."""

    def state_dict(self, encode: Callable[[Any], Any] | None = None) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any], decode: Callable[[Any], Any] | None = None) -> None: ...


def checkpoint_folders(root: Path) -> list[Path]:
    """Complete checkpoint folders under ``root``, oldest first (by step number); [] when there is none."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def encode_trajectory(trajectory: Trajectory) -> list[bytes]:
    """A trajectory as wire-codec frames (header + raw screenshots); see arpo_async.codec."""
    return codec.encode(trajectory)


def decode_trajectory(frames: list[bytes]) -> Trajectory:
    """Inverse of :func:`encode_trajectory`. Raises codec.WireError for frames that are not a trajectory."""
    message = codec.decode(list(frames), max_bytes=_MAX_TRAJECTORY_BYTES)
    if not isinstance(message, Trajectory):
        raise codec.WireError(f"expected a trajectory, got {type(message).__name__}")
    return message


def rng_state() -> dict[str, Any]:
    """The process-wide Python, NumPy and torch (CPU) RNG states as plain data and one uint8 tensor."""
    py_version, py_internal, py_gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [py_version, list(py_internal), py_gauss],
            "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
            "torch": torch.get_rng_state()}


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore :func:`rng_state`'s output."""
    py_version, py_internal, py_gauss = state["python"]
    random.setstate((int(py_version), tuple(int(x) for x in py_internal), py_gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(state["torch"])


class _Unencoded:
    """A stored trajectory in a :func:`capture` snapshot, encoded to frames only by :func:`encode_snapshot` (in the
    saver's thread): a received trajectory is never changed, so encoding it later gives the same frames."""

    __slots__ = ("trajectory",)

    def __init__(self, trajectory: Trajectory) -> None:
        self.trajectory = trajectory


def encode_snapshot(value: Any, writer: FramesWriter | None = None) -> Any:
    """``value`` (a :func:`capture` snapshot, or any part of it) with every stored trajectory as wire-codec frames
    (:func:`encode_trajectory`), or, with a ``writer``, written to its frames file and replaced by the reference
    (learner.train.frames_file). Blocking (about 1 ms per 2.9 MB trajectory, bench_transport.py):
    :meth:`Checkpointer.save` calls it in its thread."""
    def leaf(item: Any) -> Any | None:
        if not isinstance(item, _Unencoded):
            return None
        frames = encode_trajectory(item.trajectory)
        return frames if writer is None else writer.add(frames)
    return externalize(value, leaf)


def capture(service: LearnerService, replay: Replay, extra: Mapping[str, Stateful] = {}, *,
            waiting: int = 0) -> dict[str, Any]:
    """Snapshot the learner's non-model state. Call on the event loop (no await in between), so the snapshot
    is consistent; writing it (:meth:`Checkpointer.save`) can then happen in a thread. The replay buffer's
    trajectories are taken by reference and encoded when saved (:func:`encode_snapshot`): encoding a full buffer
    (256 OSWorld-length trajectories) on the event loop would hold it for ~0.3 s at every checkpoint. ``waiting``:
    trajectories the training loop holds in scored groups not yet trained (a restart loses them; see
    learner.rollouts.service.LearnerService.state_dict). The run's state (learner.state.RunState: step, version,
    counters) is saved with the service's, under ``service``, as checkpoints of older runs hold it."""
    return {"schema": SCHEMA, "service": {**service.state_dict(waiting), **service.state.state_dict()},
            "replay": replay.state_dict(encode=_Unencoded),
            "extra": {name: component.state_dict() for name, component in extra.items()},
            "rng": rng_state()}


def restore(state: Mapping[str, Any], service: LearnerService, replay: Replay,
            extra: Mapping[str, Stateful] = {}) -> None:
    """Put :func:`capture`'s snapshot back into fresh components (before the learner serves any actor).

    Raises:
        CheckpointError: unknown schema, or an extra component the checkpoint lacks.
        ValueError (learner.algo.replay.ReplayError included): malformed component state.
    """
    if state.get("schema") != SCHEMA:
        raise CheckpointError(f"unsupported learner checkpoint schema {state.get('schema')!r}, expected {SCHEMA}")
    missing = set(extra) - set(state["extra"])
    if missing:
        raise CheckpointError(f"the checkpoint has no state for {sorted(missing)}")
    service.state.load_state_dict(state["service"])  # the run's state first: the service announces its version
    service.load_state_dict(state["service"])
    replay.load_state_dict(state["replay"], decode=decode_trajectory)
    for name, component in extra.items():
        component.load_state_dict(state["extra"][name])
    set_rng_state(state["rng"])


class Checkpointer:
    """Writes and finds checkpoints in ``root`` (``<run>/checkpoints``); see the module docstring.

    Args:
        root: the checkpoints folder (created on the first save).
        keep: complete checkpoints kept (>= 1); older ones are deleted after each save.
    """

    def __init__(self, root: Path, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep

    def save(self, step: int, trainer: TrainEngine, state: dict[str, Any], meta: dict[str, Any]) -> Path:
        """Write checkpoint ``step`` atomically (blocking: call in a thread) and prune old ones.

        Args:
            step: the optimizer step just taken (names the folder).
            trainer: saved with its ``save_checkpoint`` (TrainEngine); must not train meanwhile.
            state: :func:`capture`'s snapshot (its trajectories are encoded here).
            meta: JSON-able summary; ``step`` and ``trainer_steps`` are added.

        Returns:
            The checkpoint folder.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"{PREFIX}{step:06d}"
        tmp = self.root / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            trainer.save_checkpoint(tmp / trainer.checkpoint_name)
            with (tmp / FRAMES_FILE).open("wb") as frames:
                plain = encode_snapshot(state, FramesWriter(frames))
            torch.save(plain, tmp / "learner.pt")
            summary = {**meta, "step": step, "trainer_steps": trainer.steps, "saved_at": time.time()}
            (tmp / "meta.json").write_text(json.dumps(summary, indent=1, default=_json_default))
            if final.exists():  # a step redone after an older checkpoint was resumed
                shutil.rmtree(final)
            tmp.rename(final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        self._prune()
        return final

    def _prune(self) -> None:
        for old in checkpoint_folders(self.root)[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(f".{PREFIX}*.tmp-*"):  # left by a learner killed while saving
            shutil.rmtree(stale, ignore_errors=True)

    def load_latest(self, trainer: TrainEngine) -> tuple[Path, dict[str, Any], dict[str, Any]] | None:
        """Load the newest readable checkpoint into ``trainer`` (blocking: call in a thread).

        Returns:
            ``(folder, state for restore(), meta)``, or None when ``root`` holds no checkpoint.

        Raises:
            CheckpointError: checkpoints exist but none could be loaded (each one's error is listed).
        """
        errors: list[str] = []
        for folder in reversed(checkpoint_folders(self.root)):
            try:
                meta = json.loads((folder / "meta.json").read_text())
                with torch.serialization.safe_globals([Outcome]):  # the service counts trajectories by Outcome
                    state = torch.load(folder / "learner.pt", map_location="cpu", weights_only=True)
                if state.get("schema") != SCHEMA:
                    raise CheckpointError(f"schema {state.get('schema')!r}, expected {SCHEMA}")
                if (folder / FRAMES_FILE).exists():  # checkpoints before it held the frames in learner.pt
                    state = internalize(state, read_frames(folder / FRAMES_FILE, _MAX_TRAJECTORY_BYTES))
                trainer.load_checkpoint(folder / trainer.checkpoint_name)
                return folder, state, meta
            except Exception as error:  # noqa: BLE001 - torch/pickle/json raise many types; listed below
                errors.append(f"{folder.name}: {type(error).__name__}: {error}")
                log.warning("cannot load checkpoint %s (%s: %s); trying an older one", folder,
                            type(error).__name__, error)
        if errors:
            raise CheckpointError(f"no checkpoint in {self.root} could be loaded: " + "; ".join(errors))
        return None


def reconcile_metrics(path: Path, step: int, saved: list[dict[str, Any]]) -> int:
    """Make metrics.jsonl agree with a checkpoint taken after ``step``; returns how many records were moved.

    Records of steps after ``step`` (taken after the checkpoint and undone by resuming it) are moved to
    ``metrics.rolled_back.jsonl`` beside it; the checkpoint's own records (``saved``, the steps of its last
    batch) are appended where missing, when the learner died between saving the checkpoint and writing them.
    The file is rewritten atomically, only if needed.
    """
    records = read_metrics(path)
    kept = [r for r in records if r.get("step", 0) <= step]
    dropped = [r for r in records if r.get("step", 0) > step]
    have = {r.get("step") for r in kept}
    kept.extend(r for r in saved if r.get("step") not in have and r.get("step", 0) <= step)
    if kept == records:
        return 0
    if dropped:
        writer = MetricsWriter(path.with_name("metrics.rolled_back.jsonl"))
        for r in dropped:
            writer.write(r)
        writer.close()
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    writer = MetricsWriter(tmp)
    for r in kept:
        writer.write(r)
    writer.close()
    tmp.replace(path)
    return len(dropped)


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")
