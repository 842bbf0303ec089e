"""Generated GUI instructions that name one target element: the tiny policy's tokenizer corpus.

Role: the instruction vocabulary of `init_model`'s tokenizer, so that label names are whole tokens as in a real
tokenizer. The phrasings cover the built-in tasks' instructions ("Click the Green button.", "Click the button
labelled Cherry.") and others; the names cover common colours, fruits and widget labels. A task's labels need not
be among them (tests/data/tasks/shapes uses others): they are then several tokens, as rare words are.
"""

from __future__ import annotations

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



def corpus_lines() -> list[str]:
    """Every template with every name, and the thought ``Thought: click <Name>`` for every name: text for the
    tokenizer's training corpus (unchanged lines keep the tokenizer, and so every token id, the same)."""
    lines = [t.format(name=n.capitalize()) for t in TEMPLATES for n in NAMES]
    lines += [f"Thought: click {n.capitalize()}" for n in NAMES]
    return lines
