"""Capacity probe: how many supervised steps a policy needs to *fit* a button-grid family's correct replies.

bench_learning.py and probe_learning.py ask whether RL learns the family. This probe asks the easier question
underneath: given the right answer for every task (teacher forcing, full batch), how fast can the policy learn
to write it? RL gets far less signal per step than this (one reward per sampled reply), so a policy that needs
hundreds of supervised steps here will not learn the family in the ~60 RL steps a 15-minute run gives.

Per task of the family it captures the real desktop's screenshot after setup and the target button's box
(`probe_learning.capture_scenes`), and supervises the reply ``Thought: click <Label>\\nAction:
click(start_box='(x,y)')`` with (x, y) the box centre in the resized image's coordinates (UI-TARS-1.5's
convention, as the actors parse it), in the real UI-TARS prompt. Loss: mean token NLL over all tasks, AdamW.
Every 10 steps it checks whether greedy decoding under teacher forcing writes each task's reply exactly.

Usage:
  python bench/probe_capacity.py --model runs/tiny-model --steps 150 --lr 3e-3
  arpo init-model --out runs/tiny-w256 --hidden-size 256
  python bench/probe_capacity.py --model runs/tiny-w256 --steps 150 --lr 1e-3

Prints a line every 10 steps and as its last line key=value figures: steps until every task's reply is exact
(``inf`` if never), the final loss (nats per token) and the seconds per step.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from actors.uitars.prompt import build_messages  # noqa: E402
from arpo_async.config import load_config  # noqa: E402
from arpo_async.model.inputs import PromptEncoder, completion_logits, load_policy, token_logprobs  # noqa: E402
from bench._arpo_run import ROOT, ensure_model  # noqa: E402
from bench._common import result_line  # noqa: E402
from bench.bench_learning import TASK_SETUP  # noqa: E402
from bench.probe_learning import Scene, capture_scenes  # noqa: E402


def correct_reply(scene: Scene, label: str, resized: tuple[int, int], screen: tuple[int, int]) -> str:
    """The reply that clicks the centre of ``scene``'s target box, in resized-image coordinates (pixels)."""
    b = scene.box
    x = round((b["x"] + b["w"] / 2) * resized[0] / screen[0])
    y = round((b["y"] + b["h"] / 2) * resized[1] / screen[1])
    return f"Thought: click {label}\nAction: click(start_box='({x},{y})')"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="grid4", help="grid4 or grid8")
    p.add_argument("--model", type=Path, default=ROOT / "runs" / "tiny-model",
                   help="policy folder; created when missing (tiny random policy)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args(argv)
    if args.steps < 1 or not args.lr > 0:
        p.error("--steps must be >= 1 and --lr > 0")
    import torch

    model_dir = ensure_model(args.model)
    try:
        model, processor = load_policy(model_dir)
        config = load_config(None, TASK_SETUP + [f'learner.task_ids=["{args.family}-"]'])
        scenes = asyncio.run(capture_scenes(config))
    except ValueError as e:  # a folder that is not a checkpoint (ModelInputError), or no task of the family
        raise SystemExit(f"probe_capacity: {e}") from None
    screen = config.actors.screen_size
    torch.manual_seed(0)
    encoder = PromptEncoder(model_dir)
    resized = encoder.resized_size(*screen)
    examples = []
    for scene in scenes:
        label = scene.task.expected_string  # capture_scenes checked that it names a button
        prompt = encoder.encode(build_messages(scene.task.instruction, []).messages, [screen])
        examples.append((prompt, scene.screenshot, encoder.tokenize(correct_reply(scene, label, resized, screen))))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    started, exact_at, loss_value = time.monotonic(), math.inf, math.nan
    for step in range(1, args.steps + 1):
        model.train()
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for prompt, shot, target in examples:
            loss = -token_logprobs(model, processor, prompt, [shot], target).mean() / len(examples)
            loss.backward()
            total += loss.item()
        optimizer.step()
        loss_value = total
        if step % 10 == 0:
            model.eval()
            with torch.no_grad():
                exact = sum(completion_logits(model, processor, prompt, [shot], target).argmax(-1).tolist() == target
                            for prompt, shot, target in examples)
            print(f"step {step:4d} loss {total:.3f} nats/token, greedy reply exact for {exact}/{len(examples)} tasks "
                  f"({time.monotonic() - started:.0f} s)", flush=True)
            if exact == len(examples) and math.isinf(exact_at):
                exact_at = step
    seconds = (time.monotonic() - started) / args.steps
    print(result_line({"steps_to_all_exact": "inf" if math.isinf(exact_at) else int(exact_at),
                       "final_loss": loss_value, "s_per_step": seconds,
                       "hidden_size": model.config.text_config.hidden_size}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
