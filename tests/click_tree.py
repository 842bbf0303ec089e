"""Click trees: the desktop states a task reaches in up to ``depth`` clicks on its app's widgets, from a real desktop.

Role: what the learning probe (tests/learning_probe.py) consults instead of a desktop per episode. A node is one
state of the app after the task's setup and a path of clicks: its screenshot (cursor drawn in, as the actors see
it), the widget boxes the app reports (``/tmp/arpo/layout.json``: key -> box in screen pixels), each task's
evaluator score in that state (actors.evaluation.evaluate, the episode's step budget ran out) and one child per
widget: the state after a click on the widget's centre. A click that lands on no widget leaves the state as it was
(:meth:`Node.after_click`).

Capture (:func:`capture_trees`): tasks whose setup steps are equal share one tree (each node is scored by each of
their evaluators). A node is reached by replaying its path from the boot state: the controller's in-place reset
(POST /reset), the task's setup, then each click of the path through the actors' own ``perform``, each once the
screen shows the recorded state of the node it is made from (so a replay that diverges fails instead of recording
something else). A state is recorded once screenshot and layout stop changing for ``SETTLE_S``.

Invariants: every node above ``depth`` has one child per widget of its layout; nodes at ``depth`` have none; the
tree is built breadth first, so a node's children exist before its grandchildren are captured.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Callable

from actors.desktop.controller_client import ControllerClient
from actors.episode import perform
from actors.evaluation import SetupContext, evaluate, run_setup
from actors.osworld.downloads import DownloadCache
from actors.uitars.actions import Action
from arpo_async.config import ActorConfig
from arpo_async.tasks import Task

LAYOUT_FILE = "/tmp/arpo/layout.json"
SETTLE_S = 0.3
"""A state is recorded when screenshot and layout have not changed for this long (the app redraws and rewrites
its layout file on its own time after a click; 0.05 s after it, for the settings app)."""
POLL_S = 0.05


class CaptureError(RuntimeError):
    """The desktop did not settle, a replay did not reach its recorded state, or the app reports no widget."""


@dataclass(frozen=True)
class Node:
    """One state of an app: what the policy sees there, where its widgets are, what each evaluator says.

    Attributes:
        screenshot: the screen as the actors capture it (``actors.screenshot_format``).
        boxes: widget key -> ``{"x", "y", "w", "h", "cx", "cy"}`` in screen pixels (the app's layout file, less
            its ``_window`` entry).
        scores: task id -> evaluator score in [0, 1] of an episode that ends here.
        children: widget key -> the state after a click on its centre (empty at the tree's depth).
    """

    screenshot: bytes
    boxes: dict[str, dict]
    scores: dict[str, float]
    children: dict[str, Node] = field(default_factory=dict)

    def widget_at(self, x: float, y: float) -> str | None:
        """The key of the widget whose box holds screen point (x, y), or None (app boxes do not overlap)."""
        for key, b in self.boxes.items():
            if b["x"] <= x < b["x"] + b["w"] and b["y"] <= y < b["y"] + b["h"]:
                return key
        return None

    def after_click(self, x: float, y: float) -> Node:
        """The state after a click at screen point (x, y): the child of the widget there, else this state.

        Raises:
            KeyError: the click lands on a widget of a node at the tree's depth (no children captured).
        """
        key = self.widget_at(x, y)
        return self if key is None else self.children[key]

    def size(self) -> int:
        """Nodes in this subtree, this one included."""
        return 1 + sum(child.size() for child in self.children.values())


async def capture_trees(controllers: list[ControllerClient], tasks: list[Task], config: ActorConfig, depth: int, *,
                        log: Callable[[str], None] = print) -> dict[str, Node]:
    """Capture the click tree of every task; task id -> its tree's root.

    Args:
        controllers: desktops with the controller's /reset (a fleet's); the replays of a tree's level are shared
            out among them.
        tasks: feasible tasks whose apps write ``LAYOUT_FILE``; tasks with equal setup steps share a tree.
        config: the actors' screen, screenshot format, action backend and deadlines.
        depth: clicks per path (the episode's ``actors.max_steps``); a tree holds sum(w^d, d <= depth) nodes for
            w widgets per state (the settings app, depth 2: 1 + 3 + 15).
    Raises:
        CaptureError: see the class; ValueError: an infeasible task (its score depends on the agent's FAIL, which
            a tree of clicks does not hold).
    """
    by_setup: dict[str, list[Task]] = {}
    for task in tasks:
        if task.infeasible:
            raise ValueError(f"task {task.id} is infeasible: a click tree cannot score it")
        by_setup.setdefault(json.dumps(task.config, sort_keys=True), []).append(task)
    roots: dict[str, Node] = {}
    for same in by_setup.values():
        t0 = time.perf_counter()
        root = await _capture_tree(controllers, same, config, depth)
        log(f"click tree of {', '.join(t.id for t in same)}: {root.size()} states, depth {depth}, "
            f"{time.perf_counter() - t0:.1f} s")
        roots.update((t.id, root) for t in same)
    return roots


async def _capture_tree(controllers: list[ControllerClient], tasks: list[Task], config: ActorConfig,
                        depth: int) -> Node:
    root = await _replay(controllers[0], tasks, config, None, [])
    if not root.boxes:
        raise CaptureError(f"the app of {tasks[0].id} reports no widget in {LAYOUT_FILE} after its setup")
    level: list[tuple[Node, list[str]]] = [(root, [])]
    for _ in range(depth):
        jobs: asyncio.Queue[tuple[Node, list[str]]] = asyncio.Queue()
        for node, path in level:
            for key in node.boxes:
                jobs.put_nowait((node, [*path, key]))

        async def worker(c: ControllerClient) -> None:
            while not jobs.empty():
                parent, path = jobs.get_nowait()
                parent.children[path[-1]] = await _replay(c, tasks, config, root, path)

        async with asyncio.TaskGroup() as tg:
            for c in controllers:
                tg.create_task(worker(c))
        level = [(node.children[key], [*path, key]) for node, path in level for key in node.boxes]
    return root


async def _replay(c: ControllerClient, tasks: list[Task], config: ActorConfig, root: Node | None,
                  path: list[str]) -> Node:
    """Reset, set up, click ``path`` (keys from ``root`` down) and record the state reached."""
    await c.reset(timeout=config.setup_timeout_s)
    async with asyncio.timeout(config.setup_timeout_s):
        await run_setup(c, tasks[0].config, SetupContext(DownloadCache(), tasks[0].id))
    node = root
    for key in path:
        await _showing(c, config, node.screenshot, path)
        box = node.boxes[key]
        await perform(c, [Action("click", (float(box["cx"]), float(box["cy"])))], backend=config.action_backend,
                      timeout_s=config.step_timeout_s)
        node = node.children.get(key)  # None for the last key: the state this replay records
    shot, boxes = await _settled(c, config)
    scores = {}
    for task in tasks:
        async with asyncio.timeout(config.setup_timeout_s):
            scores[task.id] = float(await evaluate(c, task, None))
    return Node(shot, boxes, scores)


async def _observe(c: ControllerClient, config: ActorConfig) -> tuple[bytes, dict[str, dict]]:
    shot = await c.screenshot(config.screenshot_format, config.screenshot_quality)
    data = await c.get_file(LAYOUT_FILE)
    layout = json.loads(data) if data else {}
    return shot, {k: v for k, v in sorted(layout.items()) if k != "_window"}


async def _settled(c: ControllerClient, config: ActorConfig) -> tuple[bytes, dict[str, dict]]:
    """Screenshot and widget boxes once neither has changed for ``SETTLE_S`` (deadline ``step_timeout_s``)."""
    deadline = time.monotonic() + config.step_timeout_s
    last, since = await _observe(c, config), time.monotonic()
    while time.monotonic() - since < SETTLE_S:
        if time.monotonic() > deadline:
            raise CaptureError(f"the screen did not settle within {config.step_timeout_s} s")
        await asyncio.sleep(POLL_S)
        now = await _observe(c, config)
        if now != last:
            last, since = now, time.monotonic()
    return last


async def _showing(c: ControllerClient, config: ActorConfig, shot: bytes, path: list[str]) -> None:
    """Wait until the screen is ``shot`` (deadline ``step_timeout_s``)."""
    deadline = time.monotonic() + config.step_timeout_s
    while await c.screenshot(config.screenshot_format, config.screenshot_quality) != shot:
        if time.monotonic() > deadline:
            raise CaptureError(f"replaying {path}: the screen never showed the recorded state within "
                               f"{config.step_timeout_s} s (is the app deterministic?)")
        await asyncio.sleep(POLL_S)
