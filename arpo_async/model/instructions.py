"""Generated GUI instructions that name one target element, for the tiny policy's tokenizer and warm-up.

Role: one source of the instruction vocabulary, shared by `init_model` (the tokenizer's training corpus, so the
names are whole tokens as in a real tokenizer) and `learner.warmup` (the supervised warm-up that teaches the tiny
policy to name the instruction's target in its thought). The phrasings cover the built-in tasks' instructions
("Click the Green button.", "Click the button labelled Cherry.") among others; the names cover common colours,
fruits and widget labels.

Invariant: every thought `target_thought` returns is ``[A-Za-z ]`` and at most `MAX_THOUGHT_CHARS` long,
so the action grammar (`actors.uitars.grammar.action_regex`, default ``max_thought_chars=20``) admits it.
"""

from __future__ import annotations

import random
from typing import NamedTuple

TEMPLATES: tuple[str, ...] = (
    "Click the {name} button.",
    "Click the button labelled {name}.",
    "Press the {name} button.",
    "Click on {name}.",
    "Select {name}.",
    "Choose the {name} option.",
    "Open the {name} menu.",
    "Click the {name} icon.",
)
"""Instruction phrasings; ``{name}`` is the target element's label, capitalised."""

NAMES: tuple[str, ...] = tuple((
    "red green blue yellow orange purple pink brown black white grey cyan "
    "cherry mango plum apple banana lemon "
    "save open close cancel help export"
).split())
"""Target labels (lowercase here); instructions and thoughts show them capitalised, as a label is shown."""

MAX_THOUGHT_CHARS = 20


class Instruction(NamedTuple):
    """One generated instruction and the thought that names its target (``"click <name>"``)."""

    text: str
    thought: str


def target_thought(name: str) -> str:
    """The warm-up thought for a target: ``"click <Name>"`` (capitalised). Raises ValueError if it is not
    ``[A-Za-z ]`` or longer than `MAX_THOUGHT_CHARS`."""
    thought = f"click {name.capitalize()}"
    if len(thought) > MAX_THOUGHT_CHARS or not all(c == " " or c.isascii() and c.isalpha() for c in thought):
        raise ValueError(f"thought {thought!r} is not 1..{MAX_THOUGHT_CHARS} characters of [A-Za-z ]")
    return thought


def sample_instruction(rng: random.Random, names: tuple[str, ...] = NAMES) -> Instruction:
    """A random instruction (uniform template, uniform name) and its target thought."""
    name = rng.choice(names)
    return Instruction(rng.choice(TEMPLATES).format(name=name.capitalize()), target_thought(name))


def corpus_lines() -> list[str]:
    """Every template with every name, and every thought: text for the tokenizer's training corpus."""
    lines = [t.format(name=n.capitalize()) for t in TEMPLATES for n in NAMES]
    lines += [f"Thought: {target_thought(n)}" for n in NAMES]
    return lines
