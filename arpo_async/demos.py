"""Demonstrations: successful episodes another policy produced, as trajectories of this run's prompt and tokenizer.

Role: read the successful episodes of an ``arpo eval`` output folder (``learner.replay_demos``) and turn each into
a :class:`arpo_async.messages.Trajectory` the success replay can inject into a group the policy failed entirely,
exactly as it injects the policy's own past successes. The episodes may come from a stronger model scored with
``arpo eval --openai-url``, from the scripted oracle (``arpo eval --oracle``), or from a person.

Format read (what ``arpo eval`` writes, actors.eval.results): episode folders at any depth of ``DIR`` with
``episode.json`` (``task_id``, ``instruction``, ``score``, ``success``), ``traj.jsonl`` (one line per step: the
reply text ``response`` and ``observation_file``, the screenshot the step acted on; a folder written before
``observation_file`` existed names it ``screenshot_file``, which is now OSWorld's after-screen) and the
screenshots. Episodes
that are not successes, and folders without ``episode.json`` (an evaluation cut short), are skipped.

A hostile or damaged folder (item 5 of issue 48): loading reads regular files only, never through a symbolic link
(``O_NOFOLLOW``: a link is refused wherever it points, inside the folder or out of it), never a FIFO or a device
(opened non-blocking and refused by ``fstat``, so loading never hangs), each under a size cap
(:data:`MAX_EPISODE_JSON_BYTES`, :data:`MAX_TRAJ_BYTES`, :func:`max_screenshot_bytes`), and only inside ``DIR``
(the walk follows no link to a folder; a screenshot is a file name of its episode folder). A success must say so
consistently: ``success: true`` and a finite score in [0, 1] above ``learner.success_threshold`` (the rule the
actors' trajectories are held to, arpo_async.validation). Texts must be UTF-8 (a lone surrogate is refused), JSON
no deeper than Python's parser allows. Whatever is wrong raises :class:`DemonstrationError`, one line naming the
file and what is wrong; the learner reports it as a configuration error at start (exit 2).

Re-tokenized, not replayed byte for byte: only the reply texts and the screenshots are taken. Each step's prompt is
rebuilt with this run's prompt (arpo_async.prompt.build_messages with ``actors.history_images`` and
``actors.prompt_style``) and tokenizer, and the reply is tokenized followed by the end token ``<|im_end|>``, as the
policy would have produced it. So a demonstration recorded with another model's tokenizer, prompt style or history
length is adapted to this run. One recorded at another screen size is refused (:class:`DemonstrationError`, naming
both sizes): its screenshots would not give the image token counts this run's policy sees.

What the learner does with a demonstration's tokens (learner.train.trainer): they have no behaviour log-probs from
our policy (the trajectories carry zeros and ``actor_id`` :data:`DEMONSTRATION_ACTOR`, :func:`is_demonstration`),
so their behaviour log-probs are taken to be the policy's own log-probs before the update; the importance weight is
then exactly 1 and the PPO clip is measured from the current policy.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import stat
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from arpo_async.messages import Outcome, Step, Trajectory
from arpo_async.model.inputs import ModelInputError, PromptEncoder, image_size
from arpo_async.prompt import build_messages
from arpo_async.success import DEFAULT_SUCCESS_THRESHOLD, is_success

__all__ = ["DEMONSTRATION_ACTOR", "MAX_DEMO_STEPS", "MAX_EPISODE_JSON_BYTES", "MAX_TRAJ_BYTES", "DemonstrationError",
           "demonstration", "is_demonstration", "load_demonstrations", "max_screenshot_bytes"]

log = logging.getLogger(__name__)

DEMONSTRATION_ACTOR = "demonstration"
"""The ``actor_id`` of every demonstration trajectory (no actor produced it)."""
END_OF_REPLY = "<|im_end|>"
"""The token that ends a reply in the Qwen chat format; the policy's replies end with it."""


MAX_EPISODE_JSON_BYTES = 1 << 20
"""The largest ``episode.json`` read (1 MiB; ``arpo eval`` writes a few hundred bytes)."""
MAX_TRAJ_BYTES = 8 << 20
"""The largest ``traj.jsonl`` read (8 MiB; a step's line holds its reply and a few fields, a few KiB at most)."""
MAX_DEMO_STEPS = 1000
"""The most steps one demonstration may have (each is a prompt rebuilt and tokenized at start)."""


def max_screenshot_bytes(screen_size: tuple[int, int]) -> int:
    """The largest screenshot file read for a screen of ``screen_size`` (width, height) pixels: 4 bytes a pixel (RGBA
    uncompressed, more than any PNG of that size holds) plus 1 MiB; 4.7 MiB at 1280x720. A larger file is no
    screenshot of this run's screen (and would be written into every checkpoint)."""
    return int(screen_size[0]) * int(screen_size[1]) * 4 + (1 << 20)


def _one_line(text: str) -> str:
    """``text`` printable on one line: control characters (a newline in a file name) escaped, and anything that is
    not UTF-8 (a lone surrogate, a file name's undecodable byte) as a backslash escape."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class DemonstrationError(ValueError):
    """A demonstration cannot be used by this run; the message (one line, see :func:`_one_line`) names the episode
    folder or file and why."""

    def __init__(self, message: str) -> None:
        super().__init__(_one_line(str(message)))


def is_demonstration(trajectory: Trajectory) -> bool:
    """Whether ``trajectory`` is a demonstration (:func:`demonstration` made it), not a rollout of our policy."""
    return trajectory.actor_id == DEMONSTRATION_ACTOR


def demonstration(task_id: str, instruction: str, replies: list[str], screenshots: list[bytes], score: float,
                  encoder: PromptEncoder, *, screen_size: tuple[int, int], history_images: int, prompt_style: str,
                  name: str = "") -> Trajectory:
    """One demonstration as a trajectory of this run: step i's prompt is rebuilt from ``instruction``, the replies
    before it and the screenshots up to ``screenshots[i]`` (the one step i acted on), as the actors build it.

    Args:
        replies: the reply text of each step, in order (at least one).
        screenshots: encoded images, one per step, each ``screen_size`` (width, height) in pixels.
        score: the evaluator's score of the episode.
        name: identifies the demonstration in ``trajectory_id`` and in errors (e.g. its folder).
    Raises:
        DemonstrationError: no step, a count mismatch, or a screenshot that is not ``screen_size`` or not an image.
    """
    where = name or task_id
    if not replies or len(replies) != len(screenshots):
        raise DemonstrationError(f"{where}: {len(replies)} replies and {len(screenshots)} screenshots; a "
                                 "demonstration needs one screenshot per reply, at least one")
    for i, shot in enumerate(screenshots):
        try:
            size = image_size(shot)
        except ModelInputError as error:
            raise DemonstrationError(f"{where}: screenshot of step {i + 1} is not an image: {error}") from error
        if tuple(size) != tuple(screen_size):
            raise DemonstrationError(
                f"{where}: recorded at {size[0]}x{size[1]}, this run's screen is {screen_size[0]}x{screen_size[1]} "
                "(actors.screen_width/height): its screenshots would not be the images this run's policy sees")
    steps = []
    for i, text in enumerate(replies):
        prompt = build_messages(instruction, replies[:i], history_images=history_images, style=prompt_style)
        prompt_ids = encoder.encode(prompt.messages, [tuple(screen_size)] * len(prompt.image_indices))
        output_ids = encoder.tokenize(text + END_OF_REPLY)
        steps.append(Step(prompt_ids=prompt_ids, image_indices=list(prompt.image_indices), output_ids=output_ids,
                          logprobs=np.zeros(len(output_ids)), versions=np.zeros(len(output_ids), np.int32),
                          text=text, action=""))
    return Trajectory(trajectory_id=f"demo:{where}", actor_id=DEMONSTRATION_ACTOR, task_id=task_id,
                      group_id=f"demo:{where}", rollout_index=0, outcome=Outcome.SUCCESS, score=float(score),
                      format_ok=True, steps=steps, screenshots=list(screenshots))


def _read(path: Path, cap: int) -> bytes:
    """The bytes of ``path``, a regular file of at most ``cap`` bytes, read without following a symbolic link and
    without blocking (a FIFO or a device is refused by ``fstat`` before any read).

    Raises:
        DemonstrationError: ``path`` is a symbolic link, not a regular file, larger than ``cap``, or unreadable.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise DemonstrationError(f"{path}: is a symbolic link; a demonstration's files must be regular files "
                                     "of its episode folder") from error
        raise DemonstrationError(f"{path}: cannot be read: {error.strerror}") from error
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise DemonstrationError(f"{path}: is not a regular file (a FIFO, device or folder); a demonstration's "
                                     "files must be regular files")
        if info.st_size > cap:
            raise DemonstrationError(f"{path}: {info.st_size} bytes, over the cap of {cap} for this file")
        with os.fdopen(os.dup(fd), "rb") as file:
            data = file.read(cap + 1)
        if len(data) > cap:  # it grew while read
            raise DemonstrationError(f"{path}: over the cap of {cap} bytes for this file")
        return data
    except OSError as error:
        raise DemonstrationError(f"{path}: cannot be read: {error.strerror}") from error
    finally:
        os.close(fd)


def _json(data: bytes, where: str) -> object:
    """``data`` parsed as JSON (UTF-8). Raises DemonstrationError naming ``where`` for bad UTF-8, bad JSON, or JSON
    nested too deep for the parser (RecursionError)."""
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as error:
        raise DemonstrationError(f"{where}: not JSON: {type(error).__name__}: {str(error)[:200]}") from error


def _text(value: object, where: str, field: str, *, empty: bool = False) -> str:
    """``value`` if it is a UTF-8 string (non-empty unless ``empty``), else DemonstrationError naming the field."""
    if not isinstance(value, str) or (not value and not empty):
        raise DemonstrationError(f"{where}: {field} must be a{'' if empty else ' non-empty'} string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise DemonstrationError(f"{where}: {field} is not valid UTF-8 text ({error.reason} at {error.start})") \
            from error
    return value


def _record(folder: Path, success_threshold: float) -> dict | None:
    """The checked ``episode.json`` of ``folder`` when it records a success; None when it records none.

    Raises:
        DemonstrationError: unreadable, or a success whose task id, instruction or score is wrong: a score must be
            a finite number in [0, 1] above ``success_threshold`` (arpo_async.success.is_success).
    """
    where = folder / "episode.json"
    record = _json(_read(where, MAX_EPISODE_JSON_BYTES), str(where))
    if not isinstance(record, dict) or record.get("success") is not True:
        return None
    _text(record.get("task_id"), str(where), "task_id")
    _text(record.get("instruction"), str(where), "instruction")
    score = record.get("score")
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score) \
            or not 0.0 <= score <= 1.0:
        raise DemonstrationError(f"{where}: score {score!r} is not a finite number in [0, 1]")
    if not is_success(score, success_threshold):
        raise DemonstrationError(f"{where}: success is true but score {score!r} is not above "
                                 f"learner.success_threshold {success_threshold!r}")
    return record


def _episode(folder: Path, *, success_threshold: float,
             screenshot_cap: int) -> tuple[dict, list[str], list[bytes]] | None:
    """(episode.json, the replies, the screenshots) of one successful episode folder; None when it is not one.

    Raises:
        DemonstrationError: a folder that says it succeeded but cannot be used (see the module docstring).
    """
    record = _record(folder, success_threshold)
    if record is None:
        return None
    where = folder / "traj.jsonl"
    try:
        lines = _read(where, MAX_TRAJ_BYTES).decode("utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise DemonstrationError(f"{where}: not UTF-8 text: {error.reason} at byte {error.start}") from error
    if len(lines) > MAX_DEMO_STEPS:
        raise DemonstrationError(f"{where}: {len(lines)} steps, more than the {MAX_DEMO_STEPS} a demonstration may "
                                 "have")
    replies, shots, read = [], [], {}
    for n, line in enumerate(lines, 1):
        step = _json(line.encode("utf-8"), f"{where} line {n}")
        if not isinstance(step, dict) or "Error" in step:
            raise DemonstrationError(f"{where} line {n}: not a step")
        reply = _text(step.get("response"), f"{where} line {n}", "response", empty=True)
        key = "observation_file" if "observation_file" in step else "screenshot_file"
        shot = _text(step.get(key), f"{where} line {n}", key)
        if Path(shot).name != shot or shot in (".", ".."):
            raise DemonstrationError(f"{where} line {n}: {key} {shot!r} must name a file of the episode folder")
        if shot not in read:  # a file named by many steps is read, and held, once
            read[shot] = _read(folder / shot, screenshot_cap)
        replies.append(reply)
        shots.append(read[shot])
    return record, replies, shots


def _episode_folders(root: Path) -> list[Path]:
    """The folders under ``root`` (``root`` included) that hold an ``episode.json``, sorted; the walk follows no
    symbolic link to a folder, so every one is inside ``root``. An ``episode.json`` that is not a regular file
    (a link, a folder) is listed too, to be refused when read."""
    found = [Path(path) for path, folders, files in os.walk(root)
             if "episode.json" in files or "episode.json" in folders]
    return sorted(found)


def load_demonstrations(root: str | Path, encoder: PromptEncoder, *, screen_size: tuple[int, int],
                        history_images: int, prompt_style: str, task_ids: Iterable[str] | None = None,
                        success_threshold: float = DEFAULT_SUCCESS_THRESHOLD) -> dict[str, list[Trajectory]]:
    """Every successful episode under ``root`` (an ``arpo eval`` output folder) as a demonstration, per task id.

    Args:
        task_ids: keep only these tasks (the run's task set); the others are skipped with one log line.
        success_threshold: ``learner.success_threshold``: a recorded success must score above it.
    Returns:
        ``{task id: [trajectory, ...]}`` in folder order (sorted paths).
    Raises:
        DemonstrationError: ``root`` is not a folder, holds no successful episode (of ``task_ids``), or an episode
            cannot be used (unreadable, a link, a FIFO, over a size cap, a score that is no success, text that is
            not UTF-8, or recorded at another screen size; see the module docstring): one line naming the file.
    """
    root = Path(root)
    if not root.is_dir():
        raise DemonstrationError(f"learner.replay_demos: {root} is not a folder (an `arpo eval --out` folder)")
    wanted = None if task_ids is None else set(task_ids)
    out: dict[str, list[Trajectory]] = {}
    skipped: set[str] = set()
    cap = max_screenshot_bytes(screen_size)
    for folder in _episode_folders(root):
        episode = _episode(folder, success_threshold=success_threshold, screenshot_cap=cap)
        if episode is None:
            continue
        record, replies, shots = episode
        if wanted is not None and record["task_id"] not in wanted:
            skipped.add(record["task_id"])
            continue
        name = str(folder.relative_to(root))
        out.setdefault(record["task_id"], []).append(demonstration(
            record["task_id"], record["instruction"], replies, shots, record["score"], encoder,
            screen_size=screen_size, history_images=history_images, prompt_style=prompt_style, name=name))
    if skipped:
        log.info("demonstrations of %d tasks outside this run's task set skipped: %s", len(skipped),
                 ", ".join(sorted(skipped)[:10]))
    if not out:
        raise DemonstrationError(f"learner.replay_demos: no successful episode under {root}"
                                 + (" for this run's tasks" if wanted is not None else ""))
    return out
