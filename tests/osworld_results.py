"""Reading an ``arpo eval`` results folder as OSWorld reads its own: with OSWorld's ``show_result.py`` (vendored
unchanged in tests/third_party/osworld_show_result.py, run as a user runs it) and with the leaderboard's rule.

OSWorld's two numbers (https://github.com/xlang-ai/OSWorld, ``show_result.get_result``; the OSWorld-Verified
leaderboard, https://os-world.github.io/):

- ``show_result.py`` averages the ``result.txt`` of every ``<domain>/<example id>/`` folder under
  ``<result_dir>/<action_space>/<observation_type>/<model>/``: an example that raised has none and is left out
  (the mean over the examples that ran);
- the leaderboard reports the sum of the scores over the whole task set, "sum/total": a task without a result
  scores 0 (:func:`leaderboard_sum`).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SHOW_RESULT = Path(__file__).parent / "third_party" / "osworld_show_result.py"
RAN_LINE = re.compile(r"^Runned: (\d+) Current Success Rate: ([0-9.]+) % ([0-9.]+) / (\d+)$", re.M)


def show_result(result_dir: Path, prefix: tuple[str, str, str] = ("", "", "")) -> dict:
    """Run OSWorld's show_result.py on ``result_dir`` (``prefix``: action space, observation type, model; empty
    names for a folder without OSWorld's prefix) in a subprocess, as ``python show_result.py --result_dir ...``.

    Returns ``{"stdout", "ran": N, "mean_pct": X, "sum": S}`` (None values when it printed no result line).
    Raises AssertionError when it exits non-zero."""
    action_space, observation_type, model = prefix
    done = subprocess.run([sys.executable, str(SHOW_RESULT), "--result_dir", str(result_dir), "--action_space",
                           action_space, "--observation_type", observation_type, "--model", model],
                          capture_output=True, text=True, timeout=120, cwd=result_dir.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    found = RAN_LINE.search(done.stdout)
    return {"stdout": done.stdout, "ran": int(found[1]) if found else None,
            "mean_pct": float(found[2]) if found else None, "sum": float(found[3]) if found else None}


def leaderboard_sum(target: Path, planned: dict[str, list[str]]) -> tuple[float, int]:
    """(sum of scores, planned tasks) over ``planned`` ({domain: [task id]}), each read from
    ``target/<domain>/<task id>/result.txt`` as show_result.py reads it; a task without one scores 0."""
    total, count = 0.0, 0
    for domain, ids in planned.items():
        for task_id in ids:
            count += 1
            path = target / domain / task_id / "result.txt"
            if os.path.isfile(path):
                total += float(path.read_text())
    return total, count
