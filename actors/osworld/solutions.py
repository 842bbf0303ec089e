"""Reference solutions of OSWorld tasks: short scripted UI-TARS action sequences that make a task's own evaluator
give 1 in our desktops, stored as data and answered step by step by the oracle (``actors.oracle``,
``arpo eval --oracle``), so they can be recorded as demonstrations a policy could produce.

Cua Bench proves each of its tasks with a reference solution driven through the environment; these do the same for
OSWorld's task files. They are stored in ``actors/osworld/reference_solutions/<domain>.json``::

    {"screen": [1280, 720],
     "solutions": {"<task id>": {"note": "why this solves it",
                                 "steps": [{"hotkey": "ctrl alt t", "then_window": "^Terminal$"},
                                           {"type": "gsettings set org.gnome.desktop.interface ...\\n"}]}}}

A step is one UI-TARS action, named by its key: ``hotkey`` (key names as the policy writes them, space-separated),
``type`` (the text; a trailing newline presses Enter), ``click`` / ``left_double`` / ``right_single`` ([x, y]),
``drag`` ([[x, y], [x, y]]), ``scroll`` ([x, y] with ``direction``), ``wait``, ``call_user`` (OSWorld's FAIL: the
answer to an infeasible task) and ``finished``. Coordinates are pixels of the file's ``screen``, scaled to the run's
screen. A plan that does not end in ``call_user`` or ``finished`` gets ``finished`` after its last step.

``then_window`` (a regular expression, as ``xdotool search --name`` reads it) makes the oracle wait, before it
answers the next step, until a visible window's title matches (at most :data:`WINDOW_WAIT_S`), as a person waits for
the terminal they opened; ``then_no_window`` until none matches (a terminal whose command ends in ``exit`` closes
when the command is done); ``then_command`` until a shell command in the desktop exits 0 (the terminal's shell has
started, so no typed key is lost). The episode sees only the actions. Where a GUI route is impractical a solution
opens a terminal (Ctrl+Alt+T, as on OSWorld's Ubuntu and in the osworld image) and types a command: real actions.

Invariants: every stored file parses and every step is one known action with well-formed arguments (checked when
loaded: :class:`SolutionError` names the file, task and step); a solution's task id appears once over all files.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from actors.settle import settled_screenshot
from actors.uitars.actions import SCROLL_DIRECTIONS, canonical_key

log = logging.getLogger(__name__)

SOLUTIONS_DIR = Path(__file__).resolve().parent / "reference_solutions"
WINDOW_WAIT_S = 120.0
"""Longest wait for a step's ``then_window`` (seconds); past it the oracle answers the next step anyway."""
STILL_S, STILL_TIMEOUT_S = 0.5, 5.0
"""Once the window is there: the screen must stay unchanged this long (seconds), waited for at most this long."""
POINT_KINDS = ("click", "left_double", "right_single")
KINDS = (*POINT_KINDS, "hotkey", "type", "drag", "scroll", "wait", "call_user", "finished")
"""The action keys a step may have (one each)."""


class SolutionError(ValueError):
    """A stored solution file is malformed; the message names the file, the task and the step."""


@dataclass(frozen=True)
class Solution:
    """One task's reference solution.

    Attributes:
        task_id: OSWorld's task id (the file name of its task in ``examples/<domain>/``).
        domain: the solutions file's stem (OSWorld's domain folder).
        steps: the action steps (dicts as stored), without the closing ``finished`` the oracle adds.
        note: what the solution does and why it is the task's answer.
        screen: (width, height) in pixels of the screen its coordinates are written for.
    """

    task_id: str
    domain: str
    steps: tuple[dict, ...]
    note: str
    screen: tuple[int, int]

    @property
    def actions(self) -> int:
        """Actions an episode takes with this solution, the closing ``finished`` included."""
        return len(self.steps) + (0 if self.steps and _kind(self.steps[-1]) in ("call_user", "finished") else 1)


def _kind(step: dict) -> str:
    return next(k for k in step if k in KINDS)


def _point(value: object) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(isinstance(v, (int, float)) for v in value)


def check_step(step: object) -> str | None:
    """What is wrong with one stored step (a sentence), or None when it is a well-formed action."""
    if not isinstance(step, dict):
        return "is not an object"
    kinds = [k for k in step if k in KINDS]
    extra = set(step) - set(KINDS) - {"then_window", "then_no_window", "then_command", "direction"}
    if len(kinds) != 1 or extra:
        return f"needs exactly one action key of {list(KINDS)} (has {sorted(step)})"
    kind, value = kinds[0], step[kinds[0]]
    if kind in POINT_KINDS + ("scroll",) and not _point(value):
        return f"{kind} needs [x, y] in pixels, got {value!r}"
    if kind == "scroll" and step.get("direction") not in SCROLL_DIRECTIONS:
        return f"scroll needs a direction of {list(SCROLL_DIRECTIONS)}"
    if kind == "drag" and not (isinstance(value, list) and len(value) == 2 and all(_point(p) for p in value)):
        return f"drag needs [[x, y], [x, y]], got {value!r}"
    if kind in ("type", "finished") and not isinstance(value, str):
        return f"{kind} needs a string, got {value!r}"
    if kind == "hotkey":
        if not isinstance(value, str) or not value.split():
            return f"hotkey needs key names, got {value!r}"
        try:
            for key in value.split():
                canonical_key(key)
        except ValueError as exc:
            return str(exc)
    command = step.get("then_command")
    if command is not None and not (isinstance(command, str) and command.strip()):
        return f"then_command needs a shell command, got {command!r}"
    for key in ("then_window", "then_no_window"):
        window = step.get(key)
        if window is not None and not (isinstance(window, str) and window and _compiles(window)):
            return f"{key} needs a regular expression, got {window!r}"
    return None


def _compiles(pattern: str) -> bool:
    try:
        re.compile(pattern)
    except re.error:
        return False
    return True


def read_solutions(path: Path) -> list[Solution]:
    """The solutions of one stored file.

    Raises:
        SolutionError: the file does not parse, or a field or step is malformed (the message names which).
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SolutionError(f"{path}: cannot read it: {exc}") from None
    screen = data.get("screen") if isinstance(data, dict) else None
    if not (isinstance(screen, list) and len(screen) == 2 and all(isinstance(v, int) and v > 0 for v in screen)):
        raise SolutionError(f"{path}: 'screen' must be [width, height] in pixels")
    solutions = data.get("solutions")
    if not isinstance(solutions, dict):
        raise SolutionError(f"{path}: 'solutions' must be an object {{task id: solution}}")
    out = []
    for task_id, sol in solutions.items():
        steps = sol.get("steps") if isinstance(sol, dict) else None
        if not isinstance(steps, list) or not steps or not isinstance(sol.get("note"), str):
            raise SolutionError(f"{path}: task {task_id}: needs 'steps' (a non-empty list) and 'note' (a string)")
        for i, step in enumerate(steps):
            problem = check_step(step)
            if problem is None and _kind(step) in ("call_user", "finished") and i != len(steps) - 1:
                problem = f"{_kind(step)} ends the episode, so it can only be the last step"
            if problem:
                raise SolutionError(f"{path}: task {task_id}: step {i}: {problem}")
        out.append(Solution(task_id, path.stem, tuple(steps), sol["note"], (screen[0], screen[1])))
    return out


@lru_cache(maxsize=4)
def load_solutions(folder: Path = SOLUTIONS_DIR) -> dict[str, Solution]:
    """Every stored solution, by task id (cached per folder).

    Raises:
        SolutionError: a malformed file, or a task id solved in two files.
    """
    out: dict[str, Solution] = {}
    for path in sorted(folder.glob("*.json")):
        for sol in read_solutions(path):
            if sol.task_id in out:
                raise SolutionError(f"{path}: task {sol.task_id} is already solved in {out[sol.task_id].domain}.json")
            out[sol.task_id] = sol
    return out


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")


def reply_action(step: dict, point) -> tuple[str, str]:
    """(thought, action text) of one step as the policy would write it.

    Args:
        step: a stored step (checked by :func:`check_step`).
        point: ``(x, y) -> "(x,y)"``: screen pixels of the solution's screen to the reply's coordinates.
    """
    kind = _kind(step)
    value = step[kind]
    if kind in POINT_KINDS:
        return kind.replace("_", " "), f"{kind}(start_box='{point(*value)}')"
    if kind == "drag":
        return "drag", f"drag(start_box='{point(*value[0])}', end_box='{point(*value[1])}')"
    if kind == "scroll":
        return "scroll", f"scroll(start_box='{point(*value)}', direction='{step['direction']}')"
    if kind == "hotkey":
        return "press keys", f"hotkey(key='{value}')"
    if kind == "type":
        return "type", f"type(content='{_escape(value)}')"
    if kind == "wait":
        return "wait", "wait()"
    if kind == "call_user":
        return "this is not possible", "call_user()"
    return "done", f"finished(content='{_escape(value)}')"


async def wait_for_window(controller, pattern: str, *, present: bool = True,
                          timeout_s: float = WINDOW_WAIT_S) -> bool:
    """Wait until a visible window's title matches ``pattern`` (``xdotool search --onlyvisible --name``) in the
    desktop of ``controller`` (``present``), or until none does (not ``present``: a terminal told to ``exit`` once its
    command is done has closed), then until the screen stops changing for :data:`STILL_S` (the app has drawn itself:
    a terminal shows its prompt, so typed keys reach the shell; at most :data:`STILL_TIMEOUT_S`); True when that
    happened within ``timeout_s`` seconds, else False (logged)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        result = await controller.execute(["xdotool", "search", "--onlyvisible", "--name", pattern], timeout=10)
        if (result.get("returncode") == 0 and bool(result.get("output", "").strip())) == present:
            await settled_screenshot(controller, interval_s=STILL_S, timeout_s=STILL_TIMEOUT_S)
            return True
        if loop.time() > deadline:
            log.warning("%s window named %r after %.0f s; answering the next step anyway", "no" if present else "a",
                        pattern, timeout_s)
            return False
        await asyncio.sleep(0.2)


async def wait_for_command(controller, command: str, timeout_s: float = WINDOW_WAIT_S) -> bool:
    """Wait until ``command`` (a shell command run in the desktop of ``controller``) exits 0; True when it did within
    ``timeout_s`` seconds, else False (logged)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (await controller.execute(command, shell=True, timeout=10)).get("returncode") != 0:
        if loop.time() > deadline:
            log.warning("%r did not succeed in %.0f s; answering the next step anyway", command, timeout_s)
            return False
        await asyncio.sleep(0.2)
    return True
