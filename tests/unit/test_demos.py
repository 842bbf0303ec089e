"""Demonstrations (arpo_async.demos): an `arpo eval` episode folder read back as a trajectory of this run's prompt,
refused at another screen size, adapted to another history length; injected into an all-failed group with the
tokens its rollouts' grammar makes the sampler emit; and the trainer's treatment of their tokens (behaviour
log-probs = the pre-update policy's: importance weight exactly 1, whatever the stored numbers). A hostile or damaged
folder (links, FIFOs, oversized files, bad scores, bad text, deep JSON) is refused with one line naming the file."""

from __future__ import annotations

import io
import json
import math
import os
import re

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


# Issue 48 item 5: a hostile or damaged demonstrations folder. Each case damages one honest episode folder (as
# `arpo eval` writes it) and must be refused with one line naming the file, never hang, never read a link or a file
# over its cap. On b190f2c they raised ReplayError / TypeError / RecursionError, read /dev/zero until MemoryError,
# blocked on the FIFO, or were accepted (the last six of CASES marked "accepted").

def _rewrite_step(folder, n: int = 0, **fields) -> None:
    lines = (folder / "traj.jsonl").read_text().splitlines()
    step = json.loads(lines[n])
    step.update(fields)
    lines[n] = json.dumps(step)
    (folder / "traj.jsonl").write_text("\n".join(lines) + "\n")


def _rewrite_record(folder, **fields) -> None:
    record = json.loads((folder / "episode.json").read_text())
    record.update(fields)
    (folder / "episode.json").write_text(json.dumps(record))


def _replace_with_link(path, target) -> None:
    path.unlink()
    path.symlink_to(target)


def _replace_with_fifo(path) -> None:
    path.unlink()
    os.mkfifo(path)


def _seen(folder, n: int):
    """The screenshot file step ``n`` (from 1) acted on, as traj.jsonl names it (``observation_file``)."""
    line = (folder / "traj.jsonl").read_text().splitlines()[n - 1]
    return folder / json.loads(line)["observation_file"]


def _outside_png(folder):
    outside = folder.parents[2] / "outside.png"  # beside the demonstrations folder, not in it
    outside.write_bytes(png())
    return outside


def _huge_png(path) -> None:
    with open(path, "wb") as file:  # a real 1280x720 PNG made 200 MB long (sparse: nothing is written)
        file.write(png())
        file.truncate(200 << 20)


NESTED = "[" * 200_000 + "]" * 200_000
CASES = {
    "nan score": (lambda f: _rewrite_record(f, score=math.nan), "episode.json: score nan is not a finite"),
    "infinite score": (lambda f: _rewrite_record(f, score=math.inf), "episode.json: score inf is not a finite"),
    "score above 1": (lambda f: _rewrite_record(f, score=1e308), "episode.json: score 1e.308 is not a finite"),
    "score true": (lambda f: _rewrite_record(f, score=True), "episode.json: score True is not a finite"),
    "surrogate in a reply": (lambda f: _rewrite_step(f, 1, response="Thought: \ud800"),
                             r"traj.jsonl line 2: response is not valid UTF-8"),
    "surrogate in the instruction": (lambda f: _rewrite_record(f, instruction="Turn \udfff on."),
                                     "episode.json: instruction is not valid UTF-8"),
    "surrogate in a file name": (lambda f: _rewrite_step(f, 0, observation_file="\ud800.png"),
                                 "traj.jsonl line 1: observation_file is not valid UTF-8"),
    "nested traj.jsonl": (lambda f: (f / "traj.jsonl").write_text(NESTED + "\n"),
                          "traj.jsonl line 1: not JSON: RecursionError"),
    "nested episode.json": (lambda f: (f / "episode.json").write_text('{"success": true, "x": ' + NESTED + "}"),
                            "episode.json: not JSON: RecursionError"),
    "screenshot linked to /dev/zero": (lambda f: _replace_with_link(_seen(f, 1), "/dev/zero"),
                                       "step_0.png: is a symbolic link"),
    "screenshot a FIFO": (lambda f: _replace_with_fifo(_seen(f, 2)), r"step_1_\d{8}@\d{12}.png: is not a regular"),
    "traj.jsonl a FIFO": (lambda f: _replace_with_fifo(f / "traj.jsonl"), "traj.jsonl: is not a regular file"),
    "episode.json a FIFO": (lambda f: _replace_with_fifo(f / "episode.json"), "episode.json: is not a regular file"),
    "traj.jsonl over its cap": (lambda f: os.truncate(f / "traj.jsonl", 9 << 20), "traj.jsonl: 9437184 bytes, over"),
    "too many steps": (lambda f: (f / "traj.jsonl").write_text("{}\n" * 1001), "1001 steps, more than the 1000"),
    "a file name with a newline": (lambda f: _rewrite_step(f, 2, observation_file="x\ny.png"),
                                   r"x\\ny.png: cannot be read: No such file"),
    "screenshot named ..": (lambda f: _rewrite_step(f, 0, observation_file=".."), "must name a file of the episode"),
    # accepted on b190f2c:
    "success at the threshold": (lambda f: _rewrite_record(f, score=0.1),
                                 "success is true but score 0.1 is not above learner.success_threshold 0.1"),
    "success below the threshold": (lambda f: _rewrite_record(f, score=0.0), "score 0.0 is not above"),
    "a 200 MB PNG": (lambda f: _huge_png(_seen(f, 3)), r"step_2_\d{8}@\d{12}.png: 209715200 bytes, over the cap of "
                                                       "4734976"),
    "screenshot linked outside": (lambda f: _replace_with_link(_seen(f, 1), _outside_png(f)),
                                  "step_0.png: is a symbolic link"),
    "screenshot linked inside": (lambda f: _replace_with_link(_seen(f, 2), _seen(f, 1)),
                                 r"step_1_\d{8}@\d{12}.png: is a symbolic link"),
    "episode.json linked outside": (lambda f: _replace_with_link(f / "episode.json", f.parents[2] / "e.json"),
                                    "episode.json: is a symbolic link"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_demonstration_folder_is_refused_with_one_line_naming_the_file(encoder, tmp_path, case):
    damage, message = CASES[case]
    demos = tmp_path / "demos"
    folder = write_episode(demos, EpisodeRecord("settings", "settings-sound-mute", 0, 1.0, True, "success", steps=3,
                                                instruction="Turn on Mute."), recorded_episode(encoder))
    (tmp_path / "e.json").write_text((folder / "episode.json").read_text())  # an honest record outside the folder
    assert sorted(re.sub(r"_\d{8}@\d{12}", "", p.name) for p in folder.iterdir()) == [
        "episode.json", "result.txt", "step_0.png", "step_1.png", "step_2.png", "step_3.png", "traj.jsonl"]
    load_demonstrations(demos, encoder, screen_size=(1280, 720), history_images=2, prompt_style="compact")  # honest
    damage(folder)
    with pytest.raises(DemonstrationError) as refused:
        load_demonstrations(demos, encoder, screen_size=(1280, 720), history_images=2, prompt_style="compact",
                            task_ids=["settings-sound-mute"])
    text = str(refused.value)
    assert re.search(message, text), text
    assert "\n" not in text and str(folder) in text.replace("\\n", "\n")  # one line, naming the episode's file


def test_a_linked_folder_is_not_walked_into(encoder, tmp_path):
    """A symbolic link to a folder of episodes (here one of another task, outside) is not followed: only the
    folder's own episodes are demonstrations."""
    write(tmp_path / "demos", recorded_episode(encoder))
    write(tmp_path / "elsewhere", recorded_episode(encoder), task_id="another-task")
    (tmp_path / "demos" / "linked").symlink_to(tmp_path / "elsewhere")
    demos = load_demonstrations(tmp_path / "demos", encoder, screen_size=(1280, 720), history_images=2,
                                prompt_style="compact")
    assert list(demos) == ["settings-sound-mute"]


@pytest.mark.parametrize("case", ["nan score", "screenshot a FIFO"])
def test_the_learner_reports_a_hostile_demonstration_in_one_line_and_exits_2(tiny_model, encoder, tmp_path, case):
    """The learner's start (arpo-learner, a real process): one error line naming the file, exit 2 as for any bad
    configuration, no traceback, no hang (b190f2c: a ReplayError traceback, exit 1; the FIFO blocked it)."""
    import subprocess
    import sys

    folder = write_episode(tmp_path / "demos", EpisodeRecord("settings", "settings-sound-mute", 0, 1.0, True,
                                                             "success", steps=3, instruction="Turn on Mute."),
                           recorded_episode(encoder))
    CASES[case][0](folder)
    done = subprocess.run([sys.executable, "-m", "learner.main", "--set", f"model={str(tiny_model)!r}", "--set",
                           f"learner.replay_demos={str(tmp_path / 'demos')!r}", "--set",
                           f"run_dir={str(tmp_path / 'run')!r}"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and str(folder) in errors[0] and re.search(CASES[case][1], errors[0]), done.stderr
