"""The multi-turn path end to end, on real desktops: what step k of an episode prompts with (earlier screenshots
and replies, as UI-TARS lays them out) is exactly what the learner trains on, and an episode that spans a weight
publication of the real arpo-serve records each step's policy version, which the staleness rule and the off-policy
correction then use.

Reference layout: OSWorld's UI-TARS-1.5 agent (``mm_agents/uitars15_v1.py``, ``predict``) keeps every earlier
reply as an assistant turn (box tokens re-added) and shows the screenshot of reply i only while
``i + history_n > len(replies)``, then the current screenshot: with a window of 2 screenshots, step 2 shows
reply 0 without its screenshot, then screenshot 1, reply 1, screenshot 2. The expected prompts below are written
out in the tiny model's Qwen2-VL chat format by hand, not built with arpo_async.prompt.
"""
from __future__ import annotations

import asyncio
import copy
import json
import shutil

import pytest
import torch

from actors import ActorConfig, DesktopEnv, EpisodeRunner, Outcome, load_task
from arpo_async.prompt import action_space_prompt
from arpo_async.engine import EngineReply
from arpo_async.inference_client import Generation, PolicyClient
from arpo_async.model.inputs import PromptEncoder, load_policy
from arpo_async.sglang_engine import SGLangEngine
from learner.algo.batcher import Batcher, ScoredGroup, policy_lag
from learner.algo.samples import train_samples
from learner.algo.grpo import correction_weights
from learner.algo.replay import make_replay, trajectory_version
from learner.rollouts.scheduler import Group
from learner.train.policy_forward import CompletionLogprobs, PixelCache, check_pad_id, collate, image_pad_problem
from tests.support import ServeProcess, free_port, until

pytestmark = pytest.mark.docker

LAYOUT = "/tmp/arpo/layout.json"
RESULT = "/tmp/arpo/form.txt"
SCREEN = (1280, 720)
IMG = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
GEN = "<|im_start|>assistant\n"


def turn(role: str, text: str) -> str:
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


def expected_prompts(style: str, instruction: str, boxed: list[str]) -> list[str]:
    """Steps 0..2 of a 2-screenshot window (OSWorld's rule), written out; ``boxed``: replies 0 and 1 with box tokens."""
    if style == "uitars":
        head = turn("system", "Your are a helpful assistant.") + turn("user", action_space_prompt(instruction))
        last = IMG
    else:  # compact: no action space; the bare instruction after the current screenshot
        head = turn("system", "GUI agent.")
        last = f"<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{instruction}<|im_end|>\n"
    a0, a1 = turn("assistant", boxed[0]), turn("assistant", boxed[1])
    return [head + last + GEN,
            head + IMG + a0 + last + GEN,
            head + a0 + IMG + a1 + last + GEN]  # screenshot 0 left the window; reply 0 stays


async def layout_centre(env: DesktopEnv, widget: str) -> tuple[int, int]:
    """A widget's centre in relative1000 coordinates, from the Tk app's layout file."""
    box = json.loads(await env.controller.get_file(LAYOUT))[widget]
    return box["cx"] * 1000 // SCREEN[0], box["cy"] * 1000 // SCREEN[1]


@pytest.mark.parametrize("style", ["uitars", "compact"])
async def test_step_prompts_carry_the_window_of_screenshots_and_every_reply_as_trained(tiny_model, style):
    config = ActorConfig(max_steps=5, history_images=2, prompt_style=style)
    encoder = PromptEncoder(tiny_model)
    sent: list[dict] = []  # what each /generate call received, in order

    async with DesktopEnv(config) as env:
        async def policy(*, input_ids, images, sampling_params, rid, episode_id):
            """Fills the Name field: click it, type Alice, click Save, finished; answers as a server would."""
            step = len(sent)
            if step == 0:
                reply = "Thought: the name field\nAction: click(start_box='({},{})')".format(
                    *await layout_centre(env, "Name"))
            elif step == 1:
                reply = "Thought: type the name\nAction: type(content='Alice')"
            elif step == 2:
                reply = "Thought: save it\nAction: click(start_box='({},{})')".format(
                    *await layout_centre(env, "Save"))
            else:  # Tk runs Save's command on its own time: the evaluator must not read the file before it
                await until(lambda: env.controller.get_file(RESULT), 10, f"the form app to write {RESULT}",
                            ok=lambda v: v is not None)
                reply = "Thought: done\nAction: finished(content='saved')"
            output_ids = encoder.tokenize(reply) + [encoder.eos_token_ids[0]]
            expanded = encoder.expand_image_pads(input_ids, [SCREEN] * len(images))
            sent.append({"input_ids": list(input_ids), "images": list(images), "reply": reply,
                         "output_ids": output_ids})
            return Generation(text=reply, output_ids=output_ids, logprobs=[-0.25 - step] * len(output_ids),
                              weight_version=3, token_versions=[3] * len(output_ids), finish_reason="stop",
                              prompt_tokens=len(expanded), latency_s=0.0)

        runner = EpisodeRunner(encoder, policy, config)
        traj = await runner.run_task(await env.reset_desktop(), "form-name", desktop=env.desktop.name)

    assert traj.outcome == Outcome.SUCCESS and traj.score == 1.0, (traj.outcome, traj.error,
                                                                   [s.action for s in traj.steps])
    assert len(traj.steps) == len(sent) == 4
    observed = [call["images"][-1] for call in sent]  # each step's own screenshot is the last image it was shown
    assert observed[0] != observed[2]  # "Alice" was typed in between: the window must move over real screens

    boxed = [sent[0]["reply"].replace("start_box='(", "start_box='<|box_start|>(").replace(")')", ")<|box_end|>')"),
             sent[1]["reply"]]
    assert "<|box_start|>(" in boxed[0] and boxed[0] != sent[0]["reply"]
    texts = expected_prompts(style, "Type Alice into the Name field, then click Save.", boxed)
    windows = [[0], [0, 1], [1, 2]]
    for k, (step, call, text, window) in enumerate(zip(traj.steps, sent, texts, windows)):
        expected_ids = encoder.expand_image_pads(encoder.tokenize(text), [SCREEN] * len(window))
        assert step.prompt_ids.tolist() == expected_ids, (k, encoder.decode(step.prompt_ids,
                                                                             skip_special_tokens=False))
        assert call["input_ids"] == encoder.collapse_image_pads(expected_ids), k  # what the server was sent
        assert call["images"] == [observed[i] for i in window], k
        assert [traj.screenshots[i] for i in step.image_indices] == call["images"], k
        assert step.text == call["reply"] and step.output_ids.tolist() == call["output_ids"], k
        assert step.versions.tolist() == [3] * len(step.output_ids)
        assert step.logprobs.tolist() == [-0.25 - k] * len(step.output_ids)
    assert [s.action.split("(")[0] for s in traj.steps] == ["click", "type", "click", "finished"]

    # The learner trains on the same ids and screenshots the server ran, and its forward accepts them.
    group = ScoredGroup("form-name", [traj], [1.0], [1.0], False, 1.0, [0])
    samples = train_samples([group])
    assert len(samples) == 4
    model, image_processor = load_policy(tiny_model)
    pixels = PixelCache(image_processor)
    for sample, call, step in zip(samples, sent, traj.steps):
        assert encoder.collapse_image_pads(sample.prompt_ids.tolist()) == call["input_ids"]
        assert sample.prompt_ids is step.prompt_ids and sample.images == call["images"]  # the step's own arrays
        assert sample.output_ids.tolist() == call["output_ids"] and sample.behaviour_logprobs is step.logprobs
        assert image_pad_problem(model, sample, pixels) is None
    with torch.no_grad():
        logprobs = CompletionLogprobs(model)(collate(model, samples, pixels, check_pad_id(model)))
    assert logprobs.shape == (sum(len(s.output_ids) for s in samples),) and torch.isfinite(logprobs).all()


async def test_an_episode_across_a_weight_publication_keeps_each_steps_version_and_behaviour_logprobs(
        tiny_model, tmp_path):
    from transformers import AutoModelForImageTextToText

    v1 = shutil.copytree(tiny_model, tmp_path / "v1")  # version 1: the same policy, every weight moved
    changed = AutoModelForImageTextToText.from_pretrained(tiny_model)
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    changed.save_pretrained(v1)

    server = ServeProcess(tiny_model, free_port(), tmp_path)
    config = ActorConfig(max_steps=3, grammar_actions=("wait",))  # three steps whatever the random policy says
    published: list[EngineReply] = []
    try:
        await asyncio.to_thread(server.start)
        async with PolicyClient([server.url]) as client:
            class PublishesAfterStepZero:
                """The real client; after the first reply of the episode the learner publishes version 1."""

                async def generate(self, **kw) -> Generation:
                    gen = await client.generate(**kw)
                    if not published:
                        published.append(await SGLangEngine(client, server.url).load_weights_from_disk(str(v1), 1))
                    return gen

            async with DesktopEnv(config) as env:
                runner = EpisodeRunner(PromptEncoder(tiny_model), PublishesAfterStepZero(), config)
                traj = await runner.run_task(await env.reset_desktop(), "grid4-green", desktop=env.desktop.name)
    finally:
        await asyncio.to_thread(server.stop)

    assert traj.outcome == Outcome.TRUNCATED and traj.assigned_version == 0, (traj.outcome, traj.error)
    assert published and published[0].ok, published
    assert [sorted(set(s.versions.tolist())) for s in traj.steps] == [[0], [1], [1]]
    assert all(len(s.versions) == len(s.output_ids) == len(s.logprobs) > 0 for s in traj.steps)

    # Behaviour log-probs: each step's are those of the version that sampled it, as the learner computes them.
    samples = train_samples([ScoredGroup("grid4-green", [traj], [0.0], [1.0], False, 0.0, [1])])
    assert [s.behaviour_logprobs.tolist() for s in samples] == [s.logprobs.tolist() for s in traj.steps]
    per_version = {}
    for version, folder in ((0, tiny_model), (1, v1)):
        model, image_processor = load_policy(folder)
        with torch.no_grad():
            out = CompletionLogprobs(model)(collate(model, samples, PixelCache(image_processor), check_pad_id(model)))
        per_version[version] = out.split([len(s.output_ids) for s in samples])
    behaviour = [torch.tensor(s.behaviour_logprobs) for s in samples]
    for k, step in enumerate(traj.steps):
        own, other = step.versions[0], 1 - step.versions[0]
        assert torch.max(torch.abs(behaviour[k] - per_version[own][k])) < 1e-4, k
        assert torch.max(torch.abs(behaviour[k] - per_version[other][k])) > 1e-3, k
    # The decoupled correction against the learner at version 1 weighs only step 0's tokens away from 1.
    weights, _ = correction_weights(torch.cat(per_version[1]).double(), torch.cat(behaviour).double(),
                                    mode="decoupled", cap=1e9)
    first = len(samples[0].output_ids)
    assert torch.allclose(weights[first:], torch.ones_like(weights[first:]), atol=1e-3)
    assert torch.max(torch.abs(weights[:first] - 1)) > 1e-3

    # Staleness: the trajectory is as old as its oldest token (version 0), not its last step (version 1).
    assert policy_lag(traj, 1) == 1 and policy_lag(traj, 2) == 2 and trajectory_version(traj) == 0
    solved = copy.deepcopy(traj)
    solved.trajectory_id, solved.rollout_index, solved.score, solved.outcome = "solved", 1, 1.0, Outcome.SUCCESS
    group = Group("g", load_task("grid4-green"), 2, results={0: traj, 1: solved})
    strict = Batcher(make_replay("off"), max_staleness=0, groups_per_step=1)
    assert strict.add_group(group, version=1) is None and strict.drops["stale"] == 2
    lenient = Batcher(make_replay("off"), max_staleness=1, groups_per_step=1)
    scored = lenient.add_group(group, version=1)
    assert scored is not None and scored.policy_lag == [1, 1] and scored.fresh_policy_lag == [1, 1]
    assert lenient.add_group(group, version=2) is None and lenient.drops["stale"] == 2
