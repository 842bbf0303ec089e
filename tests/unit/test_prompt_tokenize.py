"""PromptEncoder.tokenize (segments between added tokens, remembered) gives exactly the tokenizer's own ids."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer

from arpo_async.prompt import build_messages
from arpo_async.model import inputs
from arpo_async.model.inputs import PromptEncoder

REPLY = "Thought: I click the red button.\nAction: click(start_box='<|box_start|>(640,360)<|box_end|>')"


@pytest.fixture(scope="module")
def encoder(tiny_model) -> PromptEncoder:
    return PromptEncoder(tiny_model)


@pytest.fixture(scope="module")
def reference(tiny_model) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


def test_the_fast_path_is_taken_for_qwen_special_tokens(encoder):
    assert encoder._added_split is not None  # otherwise the tests below compare the tokenizer with itself


def test_episode_prompts_match_the_tokenizer(encoder, reference):
    replies: list[str] = []
    for step in range(15):
        text = encoder.render(build_messages("Click the button labelled red.", replies, history_images=2).messages)
        assert encoder.tokenize(text) == reference.encode(text, add_special_tokens=False).ids, step
        assert encoder.tokenize(text) == reference.encode(text, add_special_tokens=False).ids  # from the cache
        replies.append(REPLY.replace("red", f"red {step}"))


def test_random_text_around_added_tokens_matches_the_tokenizer(encoder, reference):
    rng = random.Random(7)
    added = [a.content for a in reference.get_added_tokens_decoder().values()]
    pieces = added + ["<|im", "_start|>", "<|", "|>", " ", "  ", "\n", "\n\n ", "\t", "x", "Hello", "wörld", "日本",
                      "'s", "123", "click(", ")", "\u00e9", "\U0001f600", "a b", " \n"]
    for _ in range(500):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        assert encoder.tokenize(text) == reference.encode(text, add_special_tokens=False).ids, repr(text)


def test_a_full_cache_is_emptied_and_results_stay_exact(encoder, reference, monkeypatch):
    monkeypatch.setattr(inputs, "SEGMENT_CACHE_SIZE", 3)
    for i in range(20):
        text = f"<|im_start|>user\nsegment {i}<|im_end|>\n<|im_start|>assistant\n"
        assert encoder.tokenize(text) == reference.encode(text, add_special_tokens=False).ids
        assert len(encoder._segment_ids) <= 3
