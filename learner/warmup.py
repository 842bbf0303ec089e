"""Supervised warm-up of a policy checkpoint: read the instruction and name its target in the thought.

Role: ARPO starts RL from UI-TARS-1.5, a model that has already been taught (by supervised training) to read an
instruction and say which element it will act on. The tiny random policy has no such skill, and RL alone does not
give it one in the minutes a CPU run lasts: its attention is near-uniform over a ~650-token prompt, so the
instruction's one distinguishing word barely reaches the click (bench/README.md, probe_learning.py). This module
gives the tiny policy the reading skill and nothing more: it trains the reply prefix
``Thought: click <name>\\nAction: `` for generated instructions (`arpo_async.model.instructions`) shown in the
real UI-TARS prompt (`actors.uitars.prompt.build_messages`) with a synthetic screenshot. The loss never sees a
coordinate or an action: *where* to click stays for RL to learn.

Loss: mean negative log-likelihood of the supervised tokens (teacher forcing), AdamW, gradient norm clipped at 1.
Curriculum: at step s of S an example shows the real prompt with probability s/S, otherwise only the instruction
and the screenshot (a ~120-token prompt instead of ~650), where the lookup is easier to find.
Cost and effect on the tiny policy (bench/README.md, probe_learning.py): about 0.7 s per step of 8 on 2 CPU cores;
the loss sits at chance for ~250 steps, then falls; after 2,100 steps the greedy thought names the target of 5 of
the 7 built-in grid instructions. The std 0.02 policy did not leave chance in 400 steps; use ``--init-std 0.1``.
It does not make the grid tasks easier for RL: afterwards the policy fitted grid4's full click replies *more slowly*
than a fresh std 0.1 policy (bench/probe_capacity.py: not within 150 supervised steps, against 120).
"""

from __future__ import annotations

import io
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from actors.uitars.prompt import build_messages
from arpo_async.model.inputs import PromptEncoder, completion_logits, load_policy, token_logprobs
from arpo_async.model.instructions import Instruction, sample_instruction, target_thought
from arpo_async.tasks import Task, load_tasks



def task_instructions(tasks: list[Task] | None = None) -> list[Instruction]:
    """The button-grid tasks' instructions (``related_apps`` has ``button_grid``; the built-in suite when ``tasks``
    is None), each with the thought naming the label its evaluator expects: the warm-up's accuracy probe."""
    out = []
    for task in load_tasks() if tasks is None else tasks:
        if "button_grid" in task.related_apps and task.expected_string is not None:
            out.append(Instruction(task.instruction, target_thought(task.expected_string)))
    return out


WARMUP_RECORD = "warmup.json"
"""File the warm-up writes into the checkpoint folder: its settings and final figures (provenance)."""


@dataclass(frozen=True)
class WarmupConfig:
    """Settings of `warm_up`.

    Attributes:
        steps: optimizer steps (>= 1).
        batch: instructions per step (>= 1).
        lr: AdamW learning rate.
        seed: seeds the instructions, the screenshots and torch.
        screen: (width, height) of the synthetic screenshots, in pixels (the run's ``actors.screen_size``).
    """

    steps: int = 300
    batch: int = 8
    lr: float = 5e-3
    seed: int = 0
    screen: tuple[int, int] = (1280, 720)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch < 1 or not self.lr > 0:
            raise ValueError(f"warm-up needs steps >= 1, batch >= 1 and lr > 0, got {self.steps}, {self.batch}, "
                             f"{self.lr}")


def synthetic_screenshot(rng: random.Random, screen: tuple[int, int]) -> bytes:
    """PNG bytes of a ``screen``-sized image with a few random coloured rectangles (a stand-in desktop)."""
    from PIL import Image, ImageDraw

    w, h = screen
    image = Image.new("RGB", (w, h), tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(2, 8)):
        x0, y0 = rng.randrange(w), rng.randrange(h)
        draw.rectangle((x0, y0, min(w, x0 + rng.randint(40, w // 2)), min(h, y0 + rng.randint(30, h // 2))),
                       fill=tuple(rng.randrange(256) for _ in range(3)))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def reply_prefix(instruction: Instruction) -> str:
    """The supervised text: ``Thought: <thought>\\nAction: `` (UI-TARS's reply format, up to the action)."""
    return f"Thought: {instruction.thought}\nAction: "


class _Example:
    """One tokenized warm-up example: prompt ids (the first step of an episode), screenshot, supervised ids."""

    def __init__(self, encoder: PromptEncoder, instruction: Instruction, screenshot: bytes, cfg: WarmupConfig,
                 short: bool = False):
        if short:  # the instruction and the screenshot alone: the curriculum's easy form
            messages = [{"role": "user", "content": [{"type": "text", "text": instruction.text}]},
                        {"role": "user", "content": [{"type": "image"}]}]
        else:
            messages = build_messages(instruction.text, []).messages
        self.prompt_ids = encoder.encode(messages, [cfg.screen])
        self.target_ids = encoder.tokenize(reply_prefix(instruction))
        self.screenshot = screenshot


def thought_accuracy(model, image_processor, encoder: PromptEncoder, instructions: list[Instruction],
                     screenshot: bytes, cfg: WarmupConfig) -> float:
    """Fraction of ``instructions`` whose whole supervised prefix (`reply_prefix`) is the model's greedy (argmax)
    choice at every token under teacher forcing, i.e. what greedy decoding would write. In [0, 1]."""
    import torch

    with torch.no_grad():
        hits = sum(_greedy_matches(model, image_processor, _Example(encoder, i, screenshot, cfg))
                   for i in instructions)
    return hits / max(1, len(instructions))


def _greedy_matches(model, image_processor, ex: _Example) -> bool:
    logits = completion_logits(model, image_processor, ex.prompt_ids, [ex.screenshot], ex.target_ids)
    return logits.argmax(-1).tolist() == ex.target_ids


def warm_up(model_dir: Path, cfg: WarmupConfig = WarmupConfig(), *,
            log: Callable[[str], None] = print) -> dict:
    """Train the reply prefix on generated instructions, then overwrite the checkpoint's weights in place.

    Args:
        model_dir: a Hugging Face Qwen2.5-VL / Qwen2-VL checkpoint folder (weights are replaced, tokenizer and
            configs kept).
        cfg: see `WarmupConfig`.
        log: receives a progress line every 25 steps and at the end.
    Returns:
        The record also written to ``model_dir/warmup.json``: the config, the final mean loss (nats per token over
        the last 25 steps), the greedy accuracy on the built-in button tasks' instructions
        (`thought_accuracy` over `task_instructions`) and the wall seconds.
    Raises:
        arpo_async.model.inputs.ModelInputError: the folder cannot be loaded.
    """
    import torch

    model_dir = Path(model_dir)
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    model, image_processor = load_policy(model_dir)
    encoder = PromptEncoder(model_dir)
    screenshots = [synthetic_screenshot(rng, cfg.screen) for _ in range(16)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    model.train()
    started, losses = time.monotonic(), []
    for step in range(1, cfg.steps + 1):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(cfg.batch):
            short = rng.random() >= step / cfg.steps  # curriculum: short prompts first, the real prompt by the end
            ex = _Example(encoder, sample_instruction(rng), rng.choice(screenshots), cfg, short)
            loss = -token_logprobs(model, image_processor, ex.prompt_ids, [ex.screenshot], ex.target_ids).mean()
            (loss / cfg.batch).backward()
            total += loss.item() / cfg.batch
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(total)
        if step % 25 == 0 or step == cfg.steps:
            recent = losses[-25:]
            log(f"[warm-up] step {step}/{cfg.steps} loss {sum(recent) / len(recent):.3f} nats/token "
                f"({time.monotonic() - started:.0f} s)")
    model.eval()
    record = {"config": asdict(cfg), "final_loss": round(sum(losses[-25:]) / len(losses[-25:]), 4),
              "task_thought_accuracy": thought_accuracy(model, image_processor, encoder, task_instructions(),
                                                        screenshots[0], cfg),
              "seconds": round(time.monotonic() - started, 1)}
    log(f"[warm-up] done: greedy thought right for {record['task_thought_accuracy']:.0%} of the built-in "
        f"button tasks' instructions")
    model.save_pretrained(model_dir, safe_serialization=True)
    (model_dir / WARMUP_RECORD).write_text(json.dumps(record, indent=2))
    return record
