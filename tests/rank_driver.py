"""Drives the real Trainer on fixed samples, on one rank or under torchrun (tests/integration/test_ranks.py).

    python tests/rank_driver.py MODEL OUT --steps 3                                  # one rank
    python -m torch.distributed.run --nproc-per-node 2 tests/rank_driver.py MODEL OUT --steps 3 --save-at 2
    python -m torch.distributed.run --nproc-per-node 2 tests/rank_driver.py MODEL OUT --resume CKPT --steps 3
    python -m torch.distributed.run --nproc-per-node 2 tests/rank_driver.py MODEL OUT --every-call

Under torchrun rank 0 drives the others through learner.train.lead_trainer.LeadTrainer and they run
learner.train.lead_trainer.follow, as in arpo-learner. Step k trains on batch k (the same samples with advantages that
change per step); ``--save-at K`` writes a checkpoint (``OUT/ckpt``) after K steps; ``--resume`` loads one and
continues at its step count. Rank 0 writes ``OUT/losses.json`` ({step: loss}) and the full weights
(``OUT/weights``). ``--every-call`` instead calls every method of learner.train.train_engine.TrainEngine once on
the driver (the Trainer, or rank 0's LeadTrainer) and writes what each returned to ``OUT/calls.json``
(:func:`every_call`).
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
from learner.train.distributed import init_ranks, leave  # noqa: E402
from learner.train.lead_trainer import LeadTrainer, follow  # noqa: E402
from learner.train.train_engine import TrainEngine  # noqa: E402
from learner.train.trainer import Trainer, TrainerInputError, TrainSample  # noqa: E402

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


def every_call(driver: TrainEngine, model: Path, out: Path) -> dict:
    """Every TrainEngine call once, in an order that lets each be checked: what each returned (JSON-able)."""
    samples = batch(model, 0)
    found = {"is_engine": isinstance(driver, TrainEngine), "steps_before": driver.steps,
             "model_dir": str(driver.model_dir), "vocab_size": driver.vocab_size,
             "checkpoint_name": driver.checkpoint_name}
    found["logprobs"] = driver.compute_logprobs(samples)
    try:  # refused on every rank alike (the other ranks log it and wait for the next command)
        driver.train_batch(samples[:1], minibatches=2)
    except TrainerInputError as error:
        found["refused"] = str(error)
    stats = driver.train_batch(samples, minibatches=2)
    found["train_batch"] = {"loss": stats["loss"], "optimizer_steps": stats["optimizer_steps"]}
    found["train_step_loss"] = driver.train_step(samples, proximal_logprobs=found["logprobs"])["loss"]
    full = driver.full_state_dict()
    found["full"] = {name: list(t.shape) for name, t in full.items()}
    found["checkpoint_names"] = sorted(driver.checkpoint_state_dict())
    found["weights"] = str(driver.save_weights(out / "weights", dtype="bfloat16"))
    path = driver.save_checkpoint(out / "ckpt" / driver.checkpoint_name)
    found["steps_saved"] = driver.steps
    driver.train_step(samples)
    found["steps_trained_on"] = driver.steps
    driver.load_checkpoint(path)
    found["steps_loaded"] = driver.steps
    found["logprobs_loaded"] = driver.compute_logprobs(samples)
    found["full_loaded_equal"] = all(bool((t == full[k]).all()) for k, t in driver.full_state_dict().items())
    return found


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--resume", type=Path)
    p.add_argument("--budget", type=int, default=0, help="max_tokens_per_microbatch")
    p.add_argument("--every-call", action="store_true", help="call each TrainEngine method once (calls.json)")
    args = p.parse_args()
    group = init_ranks(torch.device("cpu"), timeout_s=120)
    trainer = Trainer(args.model, LearnerConfig(lr=1e-3, correction="decoupled",
                                                max_tokens_per_microbatch=args.budget), group)
    if not group.lead:
        code = follow(trainer, group)
        dist.destroy_process_group()
        leave(code)
    driver: TrainEngine = LeadTrainer(trainer, group, timeout_s=120) if group.sharded else trainer
    args.out.mkdir(parents=True, exist_ok=True)
    if args.every_call:
        (args.out / "calls.json").write_text(json.dumps(every_call(driver, args.model, args.out)))
    else:
        if args.resume:
            driver.load_checkpoint(args.resume / driver.checkpoint_name)
        losses = {}
        for step in range(driver.steps, args.steps):
            losses[step] = driver.train_step(batch(args.model, step))["loss"]
            if args.save_at and driver.steps == args.save_at:
                driver.save_checkpoint(args.out / "ckpt" / driver.checkpoint_name)
        driver.save_weights(args.out / "weights", overwrite=True)
        (args.out / "losses.json").write_text(json.dumps(losses))
    if group.sharded:
        driver.stop()
        dist.destroy_process_group()
        leave(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
