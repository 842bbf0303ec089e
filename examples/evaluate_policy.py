"""Score your own policy on our desktops with the Python API (`actors.eval.evaluate`, the code `arpo eval` runs).

Run from the repository root, after `arpo desktop build` (Docker must be running):

    python examples/evaluate_policy.py                       # the grid4 family's held-out split, 2 desktops
    python examples/evaluate_policy.py --split settings-test --desktops 4 --out evals/centre

The policy here is an async function that always clicks the middle of the screen, then says finished. Replace
it with your agent: it gets the prompt as token ids with the screenshots as PNG bytes (actors.policy.Policy);
``actors.episode.CURRENT_CONTROLLER.get()`` gives it the episode's desktop if it needs more than the screenshot
(a file, the accessibility tree). The results land in OUT as OSWorld's runner lays them out, with report.md.
"""
from __future__ import annotations

import argparse
import asyncio
from collections import Counter
from pathlib import Path

from actors.eval import evaluate
from actors.eval.report import headline, task_table
from arpo_async.config import load_config
from arpo_async.model.init_model import create_tiny_model

steps_taken: Counter[str] = Counter()


async def click_centre(*, input_ids, images, sampling_params, rid, episode_id) -> str:
    """One UI-TARS reply per step (coordinates 0..999 of each side, actors.coordinate_mode relative1000)."""
    steps_taken[episode_id] += 1
    if steps_taken[episode_id] == 1:
        return "Thought: try the middle\nAction: click(start_box='(500,500)')"
    return "Thought: done\nAction: finished(content='done')"


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--split", default="grid4-test", help="a built-in split name or a split file")
    p.add_argument("--desktops", type=int, default=2)
    p.add_argument("--out", default=None, help="results folder (default: keep nothing on disk)")
    args = p.parse_args()
    model = Path("runs/tiny-model")  # its tokenizer builds the prompt (arpo run creates the same one)
    if not (model / "config.json").exists():
        create_tiny_model(model)
    config = load_config(None, [f"model={str(model)!r}"])
    report = await evaluate(click_centre, split=args.split, desktops=args.desktops, repeats=1, max_steps=3,
                            out=args.out, config=config,
                            progress=lambda p: print(p.line(), flush=True))
    print(task_table(report))
    overall = report["overall"]
    print("\n".join(headline(report)))  # OSWorld's score first, then the figures beside it
    return 0 if overall["episodes"] == report["planned"] else 1


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
