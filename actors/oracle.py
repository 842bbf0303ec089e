"""The scripted oracle: a policy that solves the built-in tasks by reading the app's layout, for recording
demonstrations (``arpo eval --oracle``, then ``learner.replay_demos``) and for the tests.

The oracle is a real :class:`actors.policy.Policy`: it gets the prompt the episode loop built, finds the task by
its instruction in the decoded prompt, reads the desktop of its episode (``actors.episode.CURRENT_CONTROLLER``:
the app's layout file, ``/tmp/arpo/layout.json``, widget -> screen box) and answers one UI-TARS action per step in
the run's coordinate mode (``actors.coordinate_mode``), as the episode loop parses them. Its plan comes from the
task file itself (which app the task launches, what its evaluator expects), so new tasks of the same apps need no
new code here. An OSWorld task with a stored reference solution (``actors.osworld.solutions``) is answered step by
step from it; another task of an app it does not know raises LookupError, which the episode records as a policy
error. Steps beyond the plan answer ``finished``.
"""
from __future__ import annotations

import asyncio
import json
import re
import shlex
from collections import defaultdict

from actors.episode import CURRENT_CONTROLLER
from actors.osworld.solutions import Solution, load_solutions, reply_action, wait_for_command, wait_for_window
from arpo_async.config import ActorConfig
from arpo_async.model.inputs import PromptEncoder
from arpo_async.tasks import Task

LAYOUT = "/tmp/arpo/layout.json"


def _launch(task: Task) -> list[str]:
    for step in task.config:
        if step["type"] == "launch":
            cmd = step["parameters"]["command"]
            return cmd if isinstance(cmd, list) else shlex.split(cmd)
    return []


def _rules(expected: dict | list) -> list[dict]:
    items = expected if isinstance(expected, list) else [expected]
    return [e.get("rules", {}) for e in items if isinstance(e, dict)]


def plan(task: Task) -> list[tuple[str, str]]:
    """The steps that solve ``task``: ("click", layout key), ("type", text) or ("click_centre", ""), then finished.

    Raises:
        LookupError: a task of an app this oracle does not know.
    """
    argv = _launch(task)
    app = argv[1].rsplit("/", 1)[-1] if len(argv) > 1 and argv[0] == "python3" else (argv[0] if argv else "")
    rules = _rules(task.evaluator.get("expected", {}))
    if app == "button_grid.py":
        return [("click", rules[0]["expected"])]
    if app == "settings.py":
        section, switch = rules[0]["include"][0].split("/", 1)
        steps = [("click", section), ("click", f"{section}/{switch}")]
        return steps + ([("click", "Apply")] if "--apply" in argv else [])
    if app == "form.py":
        steps = []
        for r in rules:
            for line in r.get("include", []) or [r.get("expected", "")]:
                name, value = line.strip().split(": ", 1)
                steps += [("click", name), ("type", value)]
        return steps + [("click", "Save")]
    if app == "checklist.py":
        return [("click", item) for item in rules[0]["include"]] + [("click", "Save")]
    if app == "menu_app.py":
        menu = rules[0]["expected"]
        return [("click", menu.split("/", 1)[0]), ("click", menu)]
    if app == "xterm":
        result = task.evaluator["result"]
        if task.evaluator["func"] == "file_contains":
            line = f"echo {shlex.quote(' '.join(rules[0]['expected']))} > {result['path']}"
        else:
            line = "mkdir -p " + re.search(r"test -d (\S+)", str(result["command"]))[1]
        return [("click_centre", ""), ("type", line + "\n")]
    raise LookupError(f"the oracle does not know the app of task {task.id}: {argv}")


async def _widget(key: str, timeout_s: float = 10.0) -> dict:
    """The screen box of ``key`` in the app's layout file, once the app has written it there (it rewrites the
    file when its window settles after a click)."""
    controller = CURRENT_CONTROLLER.get()
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        layout = json.loads(await controller.get_file(LAYOUT) or b"{}")
        if key in layout or asyncio.get_running_loop().time() > deadline:
            return layout[key]
        await asyncio.sleep(0.05)


class OraclePolicy:
    """Solves the tasks it is given (see module docstring); steps beyond the plan answer ``finished``.

    Its replies are written as the run's action grammar writes them (``actors``: ``coordinate_mode``, zero-padded
    coordinates with ``fixed_width_coordinates``, a thought of at most ``max_thought_chars`` letters), so as
    demonstrations they are replies the policy itself could sample; a task whose plan is done answers ``finished``
    (set ``--max-steps`` to the plan's length where the grammar has no ``finished``).

    Args:
        tasks: the tasks it may be asked about (found by their instruction in the prompt).
        encoder: the prompt encoder of the episode loop (to decode the prompt; its processor gives the image size
            the policy sees, for ``coordinate_mode = "absolute"``).
        actors: the run's actors section (screen size and the grammar's settings above); default: the defaults.
    """

    def __init__(self, tasks: list[Task], encoder: PromptEncoder, actors: ActorConfig | None = None) -> None:
        ac = actors if actors is not None else ActorConfig()
        self.tasks = sorted(tasks, key=lambda t: -len(t.instruction))  # the longest match first
        self.encoder, self.screen = encoder, ac.screen_size
        self.scale = (1000, 1000) if ac.coordinate_mode == "relative1000" else encoder.resized_size(*ac.screen_size)
        self.digits = (len(str(self.scale[0] - 1)), len(str(self.scale[1] - 1))) if ac.fixed_width_coordinates \
            else (0, 0)
        self.thought_chars = max(1, ac.max_thought_chars)
        self.steps: dict[str, int] = defaultdict(int)

    async def aclose(self) -> None:
        """Nothing to close (the interface `arpo eval` closes every policy through)."""

    def _task(self, input_ids: list[int]) -> Task:
        text = self.encoder.decode(input_ids, skip_special_tokens=False)
        for task in self.tasks:
            if task.instruction in text:
                return task
        raise LookupError("no known instruction in the prompt")

    def _point(self, x: float, y: float) -> str:
        """Screen pixels -> the reply's coordinates (the inverse of actors.uitars.actions' mapping)."""
        (sw, sh), (w, h), (dx, dy) = self.screen, self.scale, self.digits
        return f"({min(w - 1, round(x / sw * w)):0{dx}d},{min(h - 1, round(y / sh * h)):0{dy}d})"

    async def _solution_reply(self, solution: Solution, index: int) -> str:
        """Step ``index`` of a stored reference solution (``finished`` past its end), once what the step before waits
        for has happened (``then_window``, ``then_no_window``)."""
        before = solution.steps[index - 1] if 0 < index <= len(solution.steps) else {}
        if before.get("then_command"):
            await wait_for_command(CURRENT_CONTROLLER.get(), before["then_command"])
        for key, present in (("then_window", True), ("then_no_window", False)):
            if before.get(key):
                await wait_for_window(CURRENT_CONTROLLER.get(), before[key], present=present)
        if index >= len(solution.steps):
            return self._reply("done", "finished(content='done')")
        (sw, sh), (w, h) = solution.screen, self.screen
        return self._reply(*reply_action(solution.steps[index], lambda x, y: self._point(x * w / sw, y * h / sh)))

    def _reply(self, thought: str, action: str) -> str:
        return f"Thought: {thought[:self.thought_chars]}\nAction: {action}"

    async def generate(self, *, input_ids, images, sampling_params, rid, episode_id):
        from actors.policy import text_generation

        task = self._task(list(input_ids))
        index = self.steps[episode_id]
        self.steps[episode_id] += 1
        solution = load_solutions().get(task.id)
        if solution is not None:
            return text_generation(await self._solution_reply(solution, index))
        steps = plan(task)
        if index >= len(steps):
            return text_generation(self._reply("done", "finished(content='done')"))
        kind, arg = steps[index]
        if kind == "type":
            escaped = arg.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")
            return text_generation(self._reply("type", f"type(content='{escaped}')"))
        if kind == "click_centre":
            point = self._point(self.screen[0] / 2, self.screen[1] / 2)
        else:
            box = await _widget(arg)
            point = self._point(box["cx"], box["cy"])
        return text_generation(self._reply("click", f"click(start_box='{point}')"))
