"""learner.checkpoint.capture takes the replay buffer's trajectories by reference (no encoding on the event loop);
encode_snapshot, run where the checkpoint is written, gives exactly the frames an eager encoding gives."""

import os
import uuid

import pytest

from arpo_async.messages import Step, Trajectory
from learner.checkpoint import capture, decode_trajectory, encode_snapshot, encode_trajectory
from learner.replay import make_replay
from tests.unit.test_queue_depths import make_service


def success(task_id: str) -> Trajectory:
    step = Step([1, 2, 3], [0], [4, 5], [-0.5, -0.25], [0, 0], "Thought: x\nAction: wait()", "wait()")
    return Trajectory(uuid.uuid4().hex, "a/0", task_id, f"g-{task_id}", 0, "SUCCESS", 1.0, True, [step],
                      [os.urandom(6000)])


@pytest.mark.parametrize("mode", ["arpo", "prioritized"])
def test_capture_defers_encoding_and_the_saved_frames_are_the_eager_ones(mode):
    replay = make_replay(mode, capacity_per_task=4, seed=1)
    for task in ("t1", "t2"):
        replay.add_group(task, [success(task), success(task)], [1.0, 1.0])
    assert all(replay.stored(t) for t in ("t1", "t2"))
    snapshot = capture(make_service(), replay)
    held = [entry[0] for entries in snapshot["replay"]["tasks"].values() for entry in entries]
    assert held and all(isinstance(ref.trajectory, Trajectory) for ref in held)  # objects, not yet frames
    encoded = encode_snapshot(snapshot)
    assert encoded["replay"] == replay.state_dict(encode=encode_trajectory)
    assert encoded["service"] == snapshot["service"]
    frames = [entry[0] for entries in encoded["replay"]["tasks"].values() for entry in entries]
    assert frames and all(isinstance(decode_trajectory(f), Trajectory) for f in frames)
    assert all(isinstance(f, list) and all(isinstance(b, bytes) for b in f) for f in frames)
