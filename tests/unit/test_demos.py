"""Demonstrations (arpo_async.demos): an `arpo eval` episode folder read back as a trajectory of this run's prompt,
refused at another screen size, adapted to another history length; injected into an all-failed group with the
tokens its rollouts' grammar makes the sampler emit; and the trainer's treatment of their tokens (behaviour
log-probs = the pre-update policy's: importance weight exactly 1, whatever the stored numbers)."""

from __future__ import annotations

import io
import math

import pytest
from PIL import Image

from actors.eval.results import EpisodeRecord, write_episode
from actors.uitars.grammar import action_regex
from arpo_async.config import LearnerConfig
from arpo_async.demos import (DEMONSTRATION_ACTOR, DemonstrationError, demonstration, is_demonstration,
                              load_demonstrations)
from arpo_async.messages import Outcome, Step, Trajectory
from arpo_async.model.inputs import PromptEncoder
from arpo_async.prompt import build_messages
from arpo_async.tasks import Task
from learner.algo.batcher import Batcher
from learner.algo.forced_tokens import ForcedTokens
from learner.algo.replay import make_replay
from learner.algo.samples import train_samples
from learner.algo.train_sample import TrainSample
from learner.rollouts.scheduler import Group
from learner.train.trainer import Trainer

REPLIES = ["Thought: open Sound.\nAction: click(start_box='(120,80)')",
           "Thought: turn Mute on.\nAction: click(start_box='(500,300)')",
           "Thought: done.\nAction: finished(content='')"]


def png(size=(1280, 720), colour="white") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="PNG")
    return out.getvalue()


def recorded_episode(encoder: PromptEncoder, *, size=(1280, 720), history_images=5) -> Trajectory:
    """An episode as the actors record it (actors.episode: one screenshot per step, prompts from build_messages)."""
    shots = [png(size, colour) for colour in ("white", "grey", "black")]
    steps = []
    for i, text in enumerate(REPLIES):
        prompt = build_messages("Turn on Mute.", REPLIES[:i], history_images=history_images, style="compact")
        ids = encoder.encode(prompt.messages, [size] * len(prompt.image_indices))
        out = encoder.tokenize(text)
        steps.append(Step(prompt_ids=ids, image_indices=prompt.image_indices, output_ids=out,
                          logprobs=[-1.0] * len(out), versions=[3] * len(out), text=text, action=""))
    return Trajectory("t1", "actor-1", "settings-sound-mute", "g1", 0, Outcome.SUCCESS, 1.0, True, steps, shots)


def write(out, trajectory: Trajectory, *, success=True, task_id="settings-sound-mute"):
    record = EpisodeRecord("settings", task_id, 0, 1.0 if success else 0.0, success,
                           "success" if success else "failure", steps=len(trajectory.steps),
                           instruction="Turn on Mute.")
    write_episode(out, record, trajectory)


@pytest.fixture(scope="module")
def encoder(tiny_model) -> PromptEncoder:
    return PromptEncoder(tiny_model)


def test_an_eval_episode_comes_back_with_the_actors_prompt_ids(encoder, tmp_path):
    recorded = recorded_episode(encoder, history_images=2)
    write(tmp_path, recorded)
    write(tmp_path / "other", recorded, success=False)  # failures are not demonstrations
    demos = load_demonstrations(tmp_path, encoder, screen_size=(1280, 720), history_images=2, prompt_style="compact")
    assert list(demos) == ["settings-sound-mute"] and len(demos["settings-sound-mute"]) == 1
    demo = demos["settings-sound-mute"][0]
    assert is_demonstration(demo) and demo.actor_id == DEMONSTRATION_ACTOR and not is_demonstration(recorded)
    assert (demo.outcome, demo.score, demo.grammar) == (Outcome.SUCCESS, 1.0, "")
    assert [bytes(s) for s in demo.screenshots] == recorded.screenshots
    for mine, theirs in zip(demo.steps, recorded.steps, strict=True):
        assert list(mine.prompt_ids) == list(theirs.prompt_ids) and mine.image_indices == theirs.image_indices
        assert encoder.decode(list(mine.output_ids), skip_special_tokens=False) == theirs.text + "<|im_end|>"
        assert not mine.logprobs.any() and not mine.versions.any()  # none of ours: the trainer replaces them


def test_another_history_length_is_rebuilt_for_this_run(encoder, tmp_path):
    write(tmp_path, recorded_episode(encoder, history_images=5))
    demo = load_demonstrations(tmp_path, encoder, screen_size=(1280, 720), history_images=1,
                               prompt_style="compact")["settings-sound-mute"][0]
    assert [step.image_indices for step in demo.steps] == [[0], [1], [2]]  # one screenshot each, as this run shows


def test_another_screen_size_is_refused_naming_both(encoder, tmp_path):
    write(tmp_path, recorded_episode(encoder, size=(1920, 1080)))
    with pytest.raises(DemonstrationError, match=r"recorded at 1920x1080, this run's screen is 1280x720"):
        load_demonstrations(tmp_path, encoder, screen_size=(1280, 720), history_images=2, prompt_style="compact")


def test_no_usable_episode_is_an_error(encoder, tmp_path):
    with pytest.raises(DemonstrationError, match="not a folder"):
        load_demonstrations(tmp_path / "missing", encoder, screen_size=(1280, 720), history_images=2,
                            prompt_style="compact")
    write(tmp_path, recorded_episode(encoder), task_id="another-task")
    with pytest.raises(DemonstrationError, match="no successful episode"):
        load_demonstrations(tmp_path, encoder, screen_size=(1280, 720), history_images=2, prompt_style="compact",
                            task_ids=["settings-sound-mute"])
    with pytest.raises(DemonstrationError, match="one screenshot per reply"):
        demonstration("t", "Do it.", ["a"], [], 1.0, encoder, screen_size=(1280, 720), history_images=2,
                      prompt_style="compact")


@pytest.mark.parametrize("mode", ["arpo", "prioritized"])
def test_an_injected_demonstration_takes_the_tokens_its_group_was_sampled_with(tiny_model, encoder, mode):
    regex = action_regex(max_x=999, max_y=999, fixed_width=True, actions=("click",), max_thought_chars=1)
    reply = "Thought: c\nAction: click(start_box='(062,050)')"
    demo = demonstration("menu-export", "Use the File menu to choose Export.", [reply], [png()], 1.0, encoder,
                         screen_size=(1280, 720), history_images=1, prompt_style="compact", name="export/0")
    forced = ForcedTokens(tiny_model, 1280)
    replay = make_replay(mode)
    replay.add_group("menu-export", [demo], [1.0])
    batcher = Batcher(replay, max_staleness=4, groups_per_step=1, sampled_as=forced.as_sampled)
    group = Group("g0", Task.from_dict({"id": "menu-export", "instruction": "Use the File menu to choose Export.",
                                        "config": [], "evaluator": {"func": "infeasible"}}), 4)
    for k in range(4):  # four failed rollouts sampled under the regex
        out = encoder.tokenize("Thought: x\nAction: click(start_box='(500,500)')<|im_end|>")
        group.results[k] = Trajectory(f"r{k}", "actor-1", "menu-export", "g0", k, Outcome.FAILURE, 0.0, True,
                                      [Step(demo.steps[0].prompt_ids, [0], out, [-1.0] * len(out),
                                            [0] * len(out), "", "click(640,360)")], [png()], grammar=regex)
    scored = batcher.add_group(group, version=0)
    index = scored.replayed.index(True)
    injected = scored.trajectories[index]
    assert is_demonstration(injected) and injected.grammar == regex
    pieces = [encoder.decode([t], skip_special_tokens=False) for t in injected.steps[0].output_ids]
    assert pieces[:4] == ["Thought", ":", " ", "c"]  # the plain encoding has " c": never what the sampler emits
    assert [encoder.decode([t]) for t in demo.steps[0].output_ids][:3] == ["Thought", ":", " c"]
    mask = train_samples(batcher.take_batch(), forced)[index].loss_mask
    chosen = "".join(p for p, keep in zip(pieces, mask) if keep)
    assert chosen == "c062050"  # trained on the policy's choices only, like the rollouts beside it


@pytest.mark.parametrize("correction", ["arpo", "decoupled", "tis", "behaviour"])
def test_a_demonstration_trains_with_importance_weight_one(tiny_model, encoder, correction):
    demo = demonstration("settings-sound-mute", "Turn on Mute.", REPLIES[:1], [png()], 1.0, encoder,
                         screen_size=(1280, 720), history_images=2, prompt_style="compact")
    step = demo.steps[0]

    def sample(behaviour: float, is_demo: bool) -> TrainSample:
        return TrainSample(step.prompt_ids, [demo.screenshots[0]], step.output_ids,
                           [behaviour] * len(step.output_ids), 1.0, demonstration=is_demo)

    trainer = Trainer(tiny_model, LearnerConfig(lr=1e-4, correction=correction))
    for behaviour in (0.0, -50.0):  # whatever the numbers it carries
        stats = trainer.train_step([sample(behaviour, True)])
        assert stats["is_weight_mean"] == pytest.approx(1.0) and stats["is_weight_max"] == pytest.approx(1.0)
        assert stats["behaviour_kl"] == pytest.approx(0.0, abs=1e-6) and math.isfinite(stats["loss"])
    if correction in ("decoupled", "tis"):  # the same numbers as a rollout's would be weighted far from 1
        stats = trainer.train_step([sample(0.0, False)])
        assert abs(stats["is_weight_mean"] - 1.0) > 0.5 or stats["is_capped_frac"] > 0.5


def test_the_learner_stops_at_start_on_unusable_demonstrations(tiny_model, tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "learner.main", "--set", f"model={str(tiny_model)!r}", "--set",
                           f"learner.replay_demos={str(tmp_path / 'none')!r}", "--set",
                           f"run_dir={str(tmp_path / 'run')!r}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "learner.replay_demos" in done.stderr and "is not a folder" in done.stderr
