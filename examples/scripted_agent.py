"""A scripted agent, no model: it solves a built-in colour-button task through the embedding API.

Run from the repository root, after `arpo desktop build` (Docker must be running):

    python examples/scripted_agent.py              # grid4-green
    python examples/scripted_agent.py grid4-blue   # any grid4-* task: "Click the <Colour> button."

What it does: starts a desktop (DesktopEnv, removed on exit), resets it to the task, reads the colour from the
instruction, finds that colour's pixels in the screenshot, clicks their centre with a UI-TARS action string, says
finished, and prints the evaluator's score. Exit status 0 when the score is 1.0.
"""

from __future__ import annotations

import asyncio
import io
import re
import sys

import numpy as np
from PIL import Image

from actors import DesktopEnv

COLOURS = {"red": (0xD6, 0x27, 0x28), "green": (0x2C, 0xA0, 0x2C), "blue": (0x1F, 0x77, 0xB4),
           "yellow": (0xF2, 0xD2, 0x1B)}
"""The button colours of the built-in button-grid app (actors/desktop/image/apps/button_grid.py)."""


def find_colour(screenshot: bytes, rgb: tuple[int, int, int], tolerance: int = 40) -> tuple[int, int]:
    """Screen pixel (x, y) at the median of the pixels within ``tolerance`` (sum of |channel difference|) of
    ``rgb``. Raises LookupError when no pixel has that colour."""
    pixels = np.asarray(Image.open(io.BytesIO(screenshot)).convert("RGB"), dtype=np.int32)
    ys, xs = np.nonzero(np.abs(pixels - np.array(rgb)).sum(axis=-1) < tolerance)
    if len(xs) == 0:
        raise LookupError(f"no pixel of colour {rgb} on the screen")
    return int(np.median(xs)), int(np.median(ys))


async def solve(task_id: str) -> float:
    async with DesktopEnv() as env:
        obs = await env.reset(task_id)
        print(f"task {task_id}: {obs.instruction!r} on a {obs.screen_size[0]}x{obs.screen_size[1]} screen")
        match = re.search(r"Click the (\w+) button", obs.instruction)
        if match is None or match[1].lower() not in COLOURS:
            raise SystemExit(f"this script only knows the colour-button tasks, not {obs.instruction!r}")
        x, y = find_colour(obs.screenshot, COLOURS[match[1].lower()])
        obs = await env.step(f"click(start_box='({x},{y})')")
        print(f"step {obs.step}: clicked ({x},{y})")
        obs = await env.step("finished(content='done')")
        score = await env.evaluate()
        print(f"score {score:.1f}")
        return score


if __name__ == "__main__":
    score = asyncio.run(solve(sys.argv[1] if len(sys.argv) > 1 else "grid4-green"))
    sys.exit(0 if score == 1.0 else 1)
