"""A multi-step success goes through the real replay buffers, a checkpoint of them and the batcher's injection
whole: every step's prompt ids, screenshots (by index), sampled ids, behaviour log-probs and token versions reach
the training samples exactly as the actor recorded them."""

from __future__ import annotations

import io

import msgpack
import pytest
from PIL import Image

from arpo_async.messages import Outcome, Step, Trajectory
from arpo_async.tasks import Task
from learner.algo.batcher import Batcher
from learner.algo.samples import train_samples
from learner.algo.replay import REPLAY_MODES, make_replay
from learner.rollouts.scheduler import Group
from learner.train.checkpoint import decode_trajectory, encode_trajectory

TASK = Task.from_dict({"id": "form-name", "instruction": "Type Alice, then click Save.", "config": [],
                       "evaluator": {"func": "infeasible"}})


def png(colour: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (32, 18), colour).save(out, "PNG")
    return out.getvalue()


def three_step_success() -> Trajectory:
    """Three steps with a 2-screenshot window, sampled across versions 4 and 5 (step 1 spans the publication)."""
    steps = [Step([10, 11, 99, 12], [0], [21, 22], [-0.125, -1.5], [4, 4],
                  "Thought: the field\nAction: click(start_box='(500,300)')", "click(640,216)"),
             Step([10, 11, 99, 13, 99, 12], [0, 1], [23, 24, 25], [-0.75, -0.0625, -2.25], [4, 5, 5],
                  "Thought: type it\nAction: type(content='Alice')", "type('Alice')"),
             Step([10, 13, 99, 14, 99, 12], [1, 2], [26], [-0.5], [5],
                  "Thought: save\nAction: click(start_box='(500,700)')", "click(640,504)")]
    return Trajectory("three", "actor/0", TASK.id, "g0", 0, Outcome.SUCCESS, 1.0, True, steps,
                      [png("white"), png("gray"), png("green")], assigned_version=4)


def failure(name: str, group: str, index: int, version: int) -> Trajectory:
    step = Step([10, 99, 12], [0], [30], [-1.0], [version], "Action: wait()", "wait()")
    return Trajectory(name, "actor/1", TASK.id, group, index, Outcome.FAILURE, 0.0, True, [step], [png("black")],
                      assigned_version=version)


def group(group_id: str, trajectories: list[Trajectory]) -> Group:
    return Group(group_id, TASK, len(trajectories), results=dict(enumerate(trajectories)))


@pytest.mark.parametrize("mode", [m for m in REPLAY_MODES if m != "off"])
@pytest.mark.parametrize("through_checkpoint", [False, True])
def test_a_replayed_multi_step_success_trains_every_step_as_sampled(mode, through_checkpoint):
    success = three_step_success()
    batcher = Batcher(make_replay(mode), max_staleness=1, groups_per_step=1)
    seeded = batcher.add_group(group("g0", [success] + [failure(f"f{i}", "g0", i, 5) for i in (1, 2, 3)]),
                               version=5)
    assert seeded is not None and not seeded.injected
    batcher.take_batch()
    (stored, score), = batcher.replay.stored(TASK.id)
    assert stored == three_step_success() and score == 1.0
    if through_checkpoint:  # a resumed learner replays the same trajectory
        state = msgpack.unpackb(msgpack.packb(batcher.replay.state_dict(encode=encode_trajectory)), raw=False)
        batcher.replay = make_replay(mode, seed=1)
        batcher.replay.load_state_dict(state, decode=decode_trajectory)

    failed = [failure(f"h{i}", "g1", i, 7) for i in range(4)]
    scored = batcher.add_group(group("g1", failed), version=7)  # lag 3 > max_staleness: replayed, not dropped
    assert scored is not None and scored.injected and sum(scored.replayed) == 1
    at = scored.replayed.index(True)
    assert scored.trajectories[at] == three_step_success()
    assert scored.policy_lag[at] == 3 and scored.fresh_policy_lag == [0, 0, 0]

    samples = train_samples(batcher.take_batch())
    replayed = [s for s in samples if s.replayed]
    assert len(samples) == 3 + 3 and len(replayed) == 3
    original = three_step_success()
    for sample, step in zip(replayed, original.steps):
        assert sample.prompt_ids.tolist() == step.prompt_ids.tolist()
        assert sample.output_ids.tolist() == step.output_ids.tolist()
        assert sample.images == [original.screenshots[i] for i in step.image_indices]
        assert sample.behaviour_logprobs.tolist() == step.logprobs.tolist()
        assert sample.advantage == scored.advantages[at] > 0
    assert [s.versions.tolist() for s in scored.trajectories[at].steps] == [[4, 4], [4, 5, 5], [5]]
