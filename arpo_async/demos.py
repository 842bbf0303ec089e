"""Demonstrations: successful episodes another policy produced, as trajectories of this run's prompt and tokenizer.

Role: read the successful episodes of an ``arpo eval`` output folder (``learner.replay_demos``) and turn each into
a :class:`arpo_async.messages.Trajectory` the success replay can inject into a group the policy failed entirely,
exactly as it injects the policy's own past successes. The episodes may come from a stronger model scored with
``arpo eval --openai-url``, from the scripted oracle (``arpo eval --oracle``), or from a person.

Format read (what ``arpo eval`` writes, actors.eval.results): ``DIR/<domain>/<task id>/<repeat>/`` with
``episode.json`` (``task_id``, ``instruction``, ``score``, ``success``), ``traj.jsonl`` (one line per step: the
reply text ``response`` and ``screenshot_file``, the screenshot the step acted on) and the screenshots. Episodes
that are not successes, and folders without ``episode.json`` (an evaluation cut short), are skipped.

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

import json
import logging
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from arpo_async.messages import Outcome, Step, Trajectory
from arpo_async.model.inputs import ModelInputError, PromptEncoder, image_size
from arpo_async.prompt import build_messages

__all__ = ["DEMONSTRATION_ACTOR", "DemonstrationError", "demonstration", "is_demonstration", "load_demonstrations"]

log = logging.getLogger(__name__)

DEMONSTRATION_ACTOR = "demonstration"
"""The ``actor_id`` of every demonstration trajectory (no actor produced it)."""
END_OF_REPLY = "<|im_end|>"
"""The token that ends a reply in the Qwen chat format; the policy's replies end with it."""


class DemonstrationError(ValueError):
    """A demonstration cannot be used by this run; the message names the episode folder and why."""


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


def _episode(folder: Path) -> tuple[dict, list[str], list[bytes]] | None:
    """(episode.json, the replies, the screenshots) of one successful episode folder; None when it is not one.
    Raises DemonstrationError for a folder that says it succeeded but cannot be read."""
    try:
        record = json.loads((folder / "episode.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise DemonstrationError(f"{folder}: episode.json cannot be read: {error}") from error
    if not isinstance(record, dict) or record.get("success") is not True:
        return None
    if not isinstance(record.get("task_id"), str) or not isinstance(record.get("instruction"), str) \
            or not record["instruction"] or not isinstance(record.get("score"), (int, float)):
        raise DemonstrationError(f"{folder}: episode.json lacks task_id, instruction or score")
    replies, shots = [], []
    try:
        lines = (folder / "traj.jsonl").read_text(encoding="utf-8").splitlines()
        for n, line in enumerate(lines, 1):
            step = json.loads(line)
            if not isinstance(step, dict) or "Error" in step:
                raise DemonstrationError(f"{folder}/traj.jsonl line {n}: not a step")
            shot = step.get("screenshot_file")
            if not isinstance(step.get("response"), str) or not isinstance(shot, str) or not shot \
                    or Path(shot).name != shot:
                raise DemonstrationError(f"{folder}/traj.jsonl line {n}: a step needs its response and its "
                                         "screenshot_file (a file of the episode folder)")
            replies.append(step["response"])
            shots.append((folder / shot).read_bytes())
    except (OSError, ValueError) as error:
        raise DemonstrationError(f"{folder}: traj.jsonl or a screenshot cannot be read: {error}") from error
    return record, replies, shots


def load_demonstrations(root: str | Path, encoder: PromptEncoder, *, screen_size: tuple[int, int],
                        history_images: int, prompt_style: str,
                        task_ids: Iterable[str] | None = None) -> dict[str, list[Trajectory]]:
    """Every successful episode under ``root`` (an ``arpo eval`` output folder) as a demonstration, per task id.

    Args:
        task_ids: keep only these tasks (the run's task set); the others are skipped with one log line.
    Returns:
        ``{task id: [trajectory, ...]}`` in folder order (sorted paths).
    Raises:
        DemonstrationError: ``root`` is not a folder, holds no successful episode (of ``task_ids``), or an episode
            cannot be used (unreadable, or recorded at another screen size): the message names the episode folder.
    """
    root = Path(root)
    if not root.is_dir():
        raise DemonstrationError(f"learner.replay_demos: {root} is not a folder (an `arpo eval --out` folder)")
    wanted = None if task_ids is None else set(task_ids)
    out: dict[str, list[Trajectory]] = {}
    skipped: set[str] = set()
    for record_file in sorted(root.rglob("episode.json")):
        episode = _episode(record_file.parent)
        if episode is None:
            continue
        record, replies, shots = episode
        if wanted is not None and record["task_id"] not in wanted:
            skipped.add(record["task_id"])
            continue
        name = str(record_file.parent.relative_to(root))
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
