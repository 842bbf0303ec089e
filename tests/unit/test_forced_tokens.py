"""Forced text of the action grammar: arpo-serve's jump-forward emits it as canonical tokens, and the learner's
loss mask finds it again from the tokens alone, for canonical and for sampled (SGLang-like) tokenizations; a
demonstration's reply is tokenized exactly as arpo-serve samples the same reply."""

from __future__ import annotations

import io
import re

import pytest
from PIL import Image

from actors.uitars.grammar import action_regex
from arpo_async.demos import demonstration
from arpo_async.prompt import build_messages
from arpo_async.model.inputs import PromptEncoder
from arpo_serve.engine import Engine, SamplingParams
from learner.algo.forced_tokens import ForcedTokens

REGEX = action_regex(max_x=999, max_y=999, fixed_width=True, actions=("click",), max_thought_chars=8)
REGEX_ONE_CHAR = action_regex(max_x=999, max_y=999, fixed_width=True, actions=("click",), max_thought_chars=1)
FORCED_TEXT = ("Thought: ", "\nAction: click(start_box='(", ",", ")')")
INSTRUCTION = "Click the Star button."


def _screenshot() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (1280, 720), (40, 120, 200)).save(buf, "PNG")
    return buf.getvalue()


def _generate(model, jump_forward: bool, n: int = 8, regex: str = REGEX):
    engine = Engine(model, seed=0, jump_forward=jump_forward)
    encoder = PromptEncoder(model)
    ids = encoder.encode(build_messages(INSTRUCTION, [], history_images=1, style="compact").messages,
                         [(1280, 720)])
    params = SamplingParams.from_json({"max_new_tokens": 64, "regex": regex})
    results = engine.generate_batch([engine.prepare(f"r{i}", ids, [_screenshot()], params, return_logprob=True)
                                     for i in range(n)])
    return engine, encoder, results


def test_jump_forward_emits_the_forced_text_as_its_canonical_tokens(tiny_model):
    engine, encoder, results = _generate(tiny_model, jump_forward=True)
    canonical = {tuple(encoder.tokenize(text)) for text in ("Thought: ", "Action: click(start_box='(")}
    for r in results:
        assert re.fullmatch(REGEX, r.text), r.text
        assert r.finish_reason["type"] == "stop" and r.output_ids[-1] == engine.end_token_ids[0]
        assert len(r.output_logprobs) == len(r.output_ids) and all(lp <= 0 for lp in r.output_logprobs)
        assert tuple(r.output_ids[:3]) in canonical  # "Thought: " exactly as the tokenizer writes it
        newline = r.output_ids.index(encoder.tokenize("\n")[0])
        after = tuple(r.output_ids[newline + 1: newline + 1 + len(encoder.tokenize("Action: click(start_box='("))])
        assert after in canonical


def test_without_jump_forward_the_fixed_text_takes_other_tokenizations(tiny_model):
    _, encoder, results = _generate(tiny_model, jump_forward=False, n=16)
    canonical = tuple(encoder.tokenize("Thought: "))
    assert any(tuple(r.output_ids[: len(canonical)]) != canonical for r in results)
    assert all(re.fullmatch(REGEX, r.text) for r in results)


@pytest.mark.parametrize("jump_forward", [True, False])
def test_the_loss_mask_keeps_exactly_the_chosen_text(tiny_model, jump_forward):
    engine, encoder, results = _generate(tiny_model, jump_forward=jump_forward)
    forced = ForcedTokens(tiny_model, engine.vocab_size)
    for r in results:
        mask = forced.loss_mask(REGEX, r.output_ids)
        assert len(mask) == len(r.output_ids)
        chosen = encoder.decode([t for t, keep in zip(r.output_ids, mask) if keep])
        fixed = encoder.decode([t for t, keep in zip(r.output_ids, mask) if not keep], skip_special_tokens=False)
        thought, x, y = re.fullmatch(r"Thought: (.*)\nAction: click\(start_box='\((\d{3}),(\d{3})\)'\)", r.text).groups()
        # what the policy chose: the thought, the newline that ends it, and the six digits; nothing else (a space
        # can go either way: " word" tokens cover the forced space after "Thought:" and a chosen word); a thought
        # at its 8-character limit must end, so its newline is forced too
        newline = "\n" if len(thought) < 8 else ""
        assert chosen.replace(" ", "") == thought.replace(" ", "") + newline + x + y, (r.text, chosen)
        assert fixed.endswith(("<|im_end|>", "<|endoftext|>")) and "Action" in fixed and not any(c.isdigit() for c in fixed)


def test_a_hand_written_sglang_style_tokenization_is_masked_like_the_canonical_one(tiny_model):
    encoder = PromptEncoder(tiny_model)
    forced = ForcedTokens(tiny_model, 1280)
    text_pieces = ["T", "hought", ":", " ", "go", "\n", "A", "ction", ":", " click", "(", "start", "_box", "='(",
                   "0", "4", "5", ",", "7", "3", "0", ")", "')"]
    ids = [encoder.tokenize(p) for p in text_pieces]
    assert all(len(i) == 1 for i in ids), "each piece must be one token of the tiny tokenizer"
    ids = [i[0] for i in ids] + [encoder.eos_token_ids[0]]
    mask = forced.loss_mask(REGEX, ids)
    chosen = "".join(p for p, keep in zip(text_pieces, mask) if keep)
    assert chosen == "go\n045730"
    assert mask[-1] is False  # the end token, once the action is complete, is forced too


def test_no_grammar_or_a_broken_one_keeps_every_token(tiny_model):
    forced = ForcedTokens(tiny_model, 1280)
    assert forced.loss_mask("", [5, 6, 7]) is None
    assert forced.loss_mask("(unclosed", [5, 6, 7]) is None and forced.bad_grammars == 1


def test_a_reply_that_leaves_the_grammar_counts_as_chosen_from_there(tiny_model):
    encoder = PromptEncoder(tiny_model)
    forced = ForcedTokens(tiny_model, 1280)
    ids = encoder.tokenize("Thought: go\nAction: wait()")
    mask = forced.loss_mask(REGEX, ids)
    wait_at = len(encoder.tokenize("Thought: go\nAction: "))
    assert not any(mask[:2]) and all(mask[wait_at:])


def _demonstration(encoder: PromptEncoder, reply: str):
    return demonstration("star", INSTRUCTION, [reply], [_screenshot()], 1.0, encoder, screen_size=(1280, 720),
                         history_images=1, prompt_style="compact")


def test_a_demonstration_is_tokenized_exactly_as_arpo_serve_samples_its_reply(tiny_model):
    # the judge is arpo-serve's own decode loop: each reply it sampled, given back as a demonstration's text,
    # must come out as the very tokens it sampled (a one-letter thought: each choice is one token, no ambiguity)
    engine, encoder, results = _generate(tiny_model, jump_forward=True, n=16, regex=REGEX_ONE_CHAR)
    forced = ForcedTokens(tiny_model, engine.vocab_size)
    plain_differs = 0
    for r in results:
        demo = _demonstration(encoder, r.text)
        sampled = forced.as_sampled(demo, REGEX_ONE_CHAR)
        assert list(sampled.steps[0].output_ids) == list(r.output_ids), r.text
        assert sampled.grammar == REGEX_ONE_CHAR and len(sampled.steps[0].logprobs) == len(r.output_ids)
        assert forced.loss_mask(REGEX_ONE_CHAR, sampled.steps[0].output_ids) == forced.loss_mask(REGEX_ONE_CHAR,
                                                                                                 r.output_ids)
        assert list(sampled.steps[0].prompt_ids) == list(demo.steps[0].prompt_ids)
        plain_differs += list(demo.steps[0].output_ids) != list(r.output_ids)
    # the plain encoding merges the forced space after "Thought:" with the chosen letter where the vocabulary has
    # such a token (" z"; 3 of these 16 replies): a token sequence the sampler never emits, so a policy trained on
    # it learns a reply it never samples
    assert plain_differs > 0


def test_a_demonstration_the_grammar_does_not_allow_or_a_rollout_is_left_as_it_is(tiny_model):
    encoder = PromptEncoder(tiny_model)
    forced = ForcedTokens(tiny_model, 1280)
    wordy = _demonstration(encoder, "Thought: open it\nAction: click(start_box='(120,080)')")  # 1 letter allowed
    assert forced.as_sampled(wordy, REGEX_ONE_CHAR) is wordy and forced.off_grammar_demonstrations == 1
    short = _demonstration(encoder, "Thought: o\nAction: click(start_box='(120,080)')")
    assert forced.as_sampled(short, "") is short  # an unconstrained group: the plain encoding is what it samples
    assert forced.as_sampled(short, REGEX_ONE_CHAR) is forced.as_sampled(short, REGEX_ONE_CHAR)  # cached
    rollout = _demonstration(encoder, "Thought: o\nAction: click(start_box='(120,080)')")
    rollout.actor_id = "actor-1"
    assert forced.as_sampled(rollout, REGEX_ONE_CHAR) is rollout
