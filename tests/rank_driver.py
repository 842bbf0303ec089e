"""Drives the real Trainer on fixed samples, on one rank or under torchrun (tests/integration/test_ranks.py).

    python tests/rank_driver.py MODEL OUT --steps 3                                  # one rank
    python -m torch.distributed.run --nproc-per-node 2 tests/rank_driver.py MODEL OUT --steps 3 --save-at 2
    python -m torch.distributed.run --nproc-per-node 2 tests/rank_driver.py MODEL OUT --resume CKPT --steps 3

Under torchrun rank 0 drives the others through learner.train.distributed.LeadTrainer and they run
learner.train.distributed.follow, as in arpo-learner. Step k trains on batch k (the same samples with advantages that
change per step); ``--save-at K`` writes a checkpoint (``OUT/ckpt``) after K steps; ``--resume`` loads one and
continues at its step count. Rank 0 writes ``OUT/losses.json`` ({step: loss}) and the full weights
(``OUT/weights``).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from arpo_async.config import LearnerConfig  # noqa: E402
from arpo_async.model.inputs import PromptEncoder  # noqa: E402
from learner.train.distributed import LeadTrainer, follow, init_ranks, leave  # noqa: E402
from learner.train.trainer import Trainer, TrainSample  # noqa: E402
from learner.train.trainer_checkpoint import checkpoint_name  # noqa: E402

REPLIES = ("T\nAction: click(start_box='(045,730)')", "Thought: wait\nAction: wait()", "Action: hotkey(key='ctrl s')",
           "Thought: the save button\nAction: click(start_box='(512,100)')", "Action: type(content='hello')")
COLOURS = ("red", "blue", "green", "yellow", "purple")


def screenshot(colour: str) -> bytes:
    image = Image.new("RGB", (320, 180), "white")
    ImageDraw.Draw(image).rectangle([20, 20, 120, 80], fill=colour)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def batch(model: Path, step: int) -> list[TrainSample]:
    """Five samples of different lengths (one without a screenshot), advantages depending on ``step``."""
    encoder = PromptEncoder(model)
    out = []
    for i, (reply, colour) in enumerate(zip(REPLIES, COLOURS)):
        images = [screenshot(colour)]
        content = [{"type": "image"}, {"type": "text", "text": f"Click the {colour} button."}]
        prompt = encoder.encode([{"role": "user", "content": content}], [(320, 180)])
        output = encoder.tokenize(reply + "<|im_end|>")
        behaviour = [-2.0 - 0.1 * ((i + j) % 7) for j in range(len(output))]
        out.append(TrainSample(prompt, images, output, behaviour, advantage=((i + step) % 3) - 1.0,
                               replayed=i == 4))
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--resume", type=Path)
    p.add_argument("--budget", type=int, default=0, help="max_tokens_per_microbatch")
    args = p.parse_args()
    group = init_ranks(torch.device("cpu"), timeout_s=120)
    trainer = Trainer(args.model, LearnerConfig(lr=1e-3, correction="decoupled",
                                                max_tokens_per_microbatch=args.budget), group)
    if not group.lead:
        code = follow(trainer, group)
        dist.destroy_process_group()
        leave(code)
    driver = LeadTrainer(trainer, group, timeout_s=120) if group.sharded else trainer
    if args.resume:
        driver.load_checkpoint(args.resume / checkpoint_name(trainer))
    losses = {}
    for step in range(trainer.steps, args.steps):
        losses[step] = driver.train_step(batch(args.model, step))["loss"]
        if args.save_at and trainer.steps == args.save_at:
            driver.save_checkpoint(args.out / "ckpt" / checkpoint_name(trainer))
    driver.save_weights(args.out / "weights", overwrite=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "losses.json").write_text(json.dumps(losses))
    if group.sharded:
        driver.stop()
        dist.destroy_process_group()
        leave(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
