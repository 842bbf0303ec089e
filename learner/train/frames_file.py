"""The frames file of a checkpoint: the replay buffer's trajectories, as wire-codec frames, written piece by piece.

Role: keep the big part of a learner checkpoint (the replay buffer's screenshots: up to 256 trajectories of
several MB) out of ``torch.save``. ``torch.save`` pickles into one in-memory buffer and writes it as one record,
holding the GIL throughout (py-spy on the learner during bench_hosts.py: the checkpoint thread held the GIL for
76% of the samples, in ``pickler.dump`` and ``write_record``), which stalled the learner's event loop for up to
2 s per checkpoint on a loaded machine. Here each frame is its own ``write`` (the GIL is released during the
system call, and the event loop gets it back between frames), and ``learner.pt`` holds only a small reference
per trajectory.

Format of ``replay.frames``: a sequence of frames, each an 8-byte little-endian length then that many bytes.
A reference is the dict ``{FRAMES_KEY: [first frame index, frame count]}``.

Invariants: :func:`externalize` and :func:`internalize` are inverses over plain data (dicts, lists, tuples and
leaves kept as they are); a trajectory's frames are those of ``arpo_async.codec.encode``.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO, Callable

FRAMES_KEY = "__arpo_frames__"
"""The one key of a reference to frames in the frames file."""

_LENGTH = struct.Struct("<Q")


class FramesWriter:
    """Appends frames to an open binary file; :meth:`add` returns the reference to put in their place."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self.count = 0
        """Frames written so far."""

    def add(self, frames: list[bytes]) -> dict[str, list[int]]:
        """Write ``frames`` (one ``write`` per frame); their reference ``{FRAMES_KEY: [first index, count]}``."""
        first = self.count
        for frame in frames:
            self._file.write(_LENGTH.pack(len(frame)))
            self._file.write(frame)
        self.count += len(frames)
        return {FRAMES_KEY: [first, len(frames)]}


def externalize(value: Any, leaf: Callable[[Any], Any | None]) -> Any:
    """``value`` rebuilt (dicts, lists, tuples), with every item for which ``leaf(item)`` is not None replaced by
    that result (the writer's reference, in learner.train.checkpoint)."""
    replaced = leaf(value)
    if replaced is not None:
        return replaced
    if isinstance(value, dict):
        return {key: externalize(item, leaf) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(externalize(item, leaf) for item in value)
    return value


def read_frames(path: Path, max_frame_bytes: int) -> list[bytes]:
    """Every frame of a frames file, in order.

    Raises:
        ValueError: a truncated file, or a frame longer than ``max_frame_bytes`` (a corrupt length).
    """
    data = path.read_bytes()
    frames, at = [], 0
    while at < len(data):
        if at + _LENGTH.size > len(data):
            raise ValueError(f"{path}: truncated frame length at byte {at}")
        (length,) = _LENGTH.unpack_from(data, at)
        at += _LENGTH.size
        if length > max_frame_bytes or at + length > len(data):
            raise ValueError(f"{path}: frame of {length} bytes at byte {at} is truncated or too long")
        frames.append(data[at:at + length])
        at += length
    return frames


def internalize(value: Any, frames: list[bytes]) -> Any:
    """Inverse of :func:`externalize` with a :class:`FramesWriter`: every reference replaced by its list of frames.

    Raises:
        ValueError: a reference outside ``frames``.
    """
    if isinstance(value, dict):
        if set(value) == {FRAMES_KEY}:
            first, count = value[FRAMES_KEY]
            if not (0 <= first and 0 <= count and first + count <= len(frames)):
                raise ValueError(f"frames reference {value[FRAMES_KEY]} outside the {len(frames)} frames saved")
            return frames[first:first + count]
        return {key: internalize(item, frames) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(internalize(item, frames) for item in value)
    return value
