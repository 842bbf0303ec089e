"""An evaluation's episodes as the viewer's samples, so `arpo view EVAL_DIR` shows them as it shows a run's.

Reads the results layout of actors.eval.results (episode folders with ``episode.json``, ``traj.jsonl`` and the
screenshots, at any depth of the folder) and builds, per episode, the record the viewer reads from a run's
trajectory sample
(learner.rollouts.trajectory_sample's record: instruction, outcome, score, error, screenshots, and per step the reply,
thought, action with its points, and the screenshot it acted on). Folders that cannot be read are reported as
problems, not raised.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from actors.eval.results import RECORD_FILE
from learner.rollouts.trajectory_sample import image_size, parse_compact_actions, thought_of


def is_eval_dir(folder: Path) -> bool:
    """``folder`` holds an evaluation's results (a report, or at least one finished episode)."""
    return (folder / "report.json").is_file() or bool(_record_files(folder))


def _record_files(folder: Path) -> list[Path]:
    """Every ``episode.json`` below ``folder``, sorted; the walk follows no symbolic link."""
    return sorted(Path(path) / RECORD_FILE for path, _, files in os.walk(folder) if RECORD_FILE in files)


def _steps(folder: Path) -> tuple[list[dict[str, Any]], list[str]]:
    steps, shots = [], []
    for line in (folder / "traj.jsonl").read_text(encoding="utf-8").splitlines():
        entry = json.loads(line)
        if "step_num" not in entry:
            continue  # the {"Error": ...} line of an errored episode
        shot = entry.get("observation_file", entry.get("screenshot_file")) or ""  # the screen it acted on
        index = None
        if shot and (folder / shot).is_file():
            shots.append(shot)
            index = len(shots) - 1
        reply = str(entry.get("response", ""))
        steps.append({"text": reply, "thought": thought_of(reply), "action": entry.get("action", ""),
                      "actions": parse_compact_actions(str(entry.get("action", ""))), "screenshot": index,
                      "versions": []})
    return steps, shots


def load_eval_samples(eval_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The viewer records of ``eval_dir``'s episodes (sorted by domain, task, repeat) and a note per episode
    folder that could not be read. Each record's ``_folder`` is its folder relative to ``eval_dir``."""
    records, problems = [], []
    for path in _record_files(eval_dir):
        folder = path.parent
        try:
            episode = json.loads(path.read_text(encoding="utf-8"))
            steps, shots = _steps(folder)
            size = image_size((folder / shots[0]).read_bytes()) if shots else (0, 0)
        except (OSError, ValueError, TypeError, KeyError) as error:
            problems.append(f"{folder.relative_to(eval_dir).as_posix()}: {error}")
            continue
        records.append({
            "task_id": episode.get("task_id"), "family": episode.get("domain"),
            "instruction": episode.get("instruction", ""), "outcome": episode.get("outcome"),
            "score": episode.get("score"), "error": episode.get("error", ""),
            "rollout_index": episode.get("repeat"), "policy_version": episode.get("policy_version"),
            "timings": {"episode_s": episode.get("seconds")}, "screen_size": list(size), "screenshots": shots,
            "steps": steps, "_folder": folder.relative_to(eval_dir).as_posix()})
    return records, problems
