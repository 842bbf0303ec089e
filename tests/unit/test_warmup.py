"""The tiny policy's instruction vocabulary and its supervised warm-up (learner/warmup.py)."""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from actors.uitars.actions import parse_reply
from actors.uitars.grammar import action_regex
from arpo_async.model.inputs import PromptEncoder, load_policy, token_logprobs
from arpo_async.model.instructions import NAMES, TEMPLATES, Instruction, sample_instruction, target_thought
from arpo_async.tasks import load_tasks
from learner.warmup import (
    WARMUP_RECORD,
    WarmupConfig,
    _Example,
    reply_prefix,
    synthetic_screenshot,
    task_instructions,
    warm_up,
)


def test_every_target_thought_is_admitted_by_the_grammar_and_parses():
    pattern = re.compile(action_regex(actions=("click",)))
    for name in NAMES:
        reply = f"{reply_prefix(Instruction('', target_thought(name)))}click(start_box='(10,20)')"
        assert pattern.fullmatch(reply), reply
        parsed = parse_reply(reply, resized_size=(308, 168), screen_size=(1280, 720))
        assert parsed.thought == target_thought(name)
        assert parsed.action.point is not None


def test_target_thought_rejects_what_the_grammar_cannot_emit():
    assert target_thought("cherry") == "click Cherry"
    with pytest.raises(ValueError, match="A-Za-z"):
        target_thought("extraordinarily")  # "click Extraordinarily" is 21 characters
    with pytest.raises(ValueError, match="A-Za-z"):
        target_thought("f1")


def test_generated_instructions_cover_the_builtin_button_tasks():
    # The warm-up must teach the phrasing and the labels of the tasks RL is benchmarked on.
    grid = [t.instruction for t in load_tasks() if t.id.startswith("grid")]
    probes = task_instructions()
    assert sorted(grid) == sorted(i.text for i in probes)
    assert {i.thought for i in probes} == {f"click {n}" for n in
                                           ("Red", "Green", "Blue", "Yellow", "Cherry", "Mango", "Plum")}
    phrasings = {t.format(name=n.capitalize()) for t in TEMPLATES for n in NAMES}
    assert set(grid) <= phrasings
    rng = random.Random(0)
    drawn = {sample_instruction(rng).text for _ in range(2000)}
    assert set(grid) <= drawn


def test_task_labels_are_whole_tokens_of_the_tiny_tokenizer(tiny_model):
    encoder = PromptEncoder(tiny_model)
    for name in ("Green", "Yellow", "Cherry", "Plum"):
        assert len(encoder.tokenize(f" {name}")) == 1, name


def test_warmup_config_rejects_bad_values():
    with pytest.raises(ValueError, match="steps >= 1"):
        WarmupConfig(steps=0)
    with pytest.raises(ValueError, match="lr > 0"):
        WarmupConfig(lr=0.0)


def test_warm_up_raises_the_likelihood_of_the_reply_prefix_and_records_itself(tiny_model, tmp_path):
    model_dir = tmp_path / "policy"
    shutil.copytree(tiny_model, model_dir)
    cfg = WarmupConfig(steps=6, batch=2, lr=5e-3, seed=3)
    encoder = PromptEncoder(model_dir)
    shot = synthetic_screenshot(random.Random(0), cfg.screen)
    example = _Example(encoder, task_instructions()[1], shot, cfg)

    def prefix_logprob() -> float:
        model, processor = load_policy(model_dir)
        with torch.no_grad():
            return float(token_logprobs(model, processor, example.prompt_ids, [shot], example.target_ids).sum())

    before = prefix_logprob()
    lines: list[str] = []
    record = warm_up(model_dir, cfg, log=lines.append)
    after = prefix_logprob()

    assert after > before + 1.0  # nats over the 8 supervised tokens: the fixed format tokens are learnt first
    assert json.loads((model_dir / WARMUP_RECORD).read_text()) == json.loads(json.dumps(record))
    assert record["config"]["steps"] == 6 and record["final_loss"] > 0
    assert 0.0 <= record["task_thought_accuracy"] <= 1.0
    assert any("step 6/6" in line for line in lines) and "done" in lines[-1]
    old, new = load_file(str(tiny_model / "model.safetensors")), load_file(str(model_dir / "model.safetensors"))
    assert old.keys() == new.keys() and any(not torch.equal(old[k], new[k]) for k in old)


def test_init_model_cli_warms_up_the_policy_it_creates(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "arpo_async.cli", "init-model", "--out", str(tmp_path / "m"),
                           "--init-std", "0.1", "--warmup-steps", "1", "--seed", "4"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "m" / WARMUP_RECORD).read_text())
    assert record["config"]["steps"] == 1 and record["config"]["seed"] == 4
    assert json.loads((tmp_path / "m" / "config.json").read_text())["text_config"]["initializer_range"] == 0.1


def test_init_model_cli_rejects_negative_warmup_steps(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "arpo_async.cli", "init-model", "--out", str(tmp_path / "m"),
                           "--warmup-steps", "-1"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--warmup-steps must be >= 0" in proc.stderr
    assert not (tmp_path / "m").exists()
