"""learner.train.checkpoint.capture takes the replay buffer's trajectories by reference (no encoding on the event loop);
encode_snapshot, run where the checkpoint is written, gives exactly the frames an eager encoding gives, inline or
through the frames file (learner.train.frames_file)."""

import os
import uuid

import pytest

from arpo_async.messages import Step, Trajectory
from learner.algo.replay import make_replay
from learner.train.checkpoint import _Unencoded, capture, decode_trajectory, encode_snapshot, encode_trajectory
from learner.train.frames_file import FRAMES_KEY, FramesWriter, internalize, read_frames
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


def test_frames_file_round_trip_and_corruption(tmp_path):
    trajectories = [success("t1"), success("t2"), success("t1")]
    state = {"replay": {"tasks": {"t1": [[_Unencoded(trajectories[0]), 1.0], [_Unencoded(trajectories[2]), 1.0]],
                                  "t2": [(_Unencoded(trajectories[1]), 0.5)]}}, "other": [1, (2, "x")]}
    path = tmp_path / "replay.frames"
    with path.open("wb") as file:
        writer = FramesWriter(file)
        plain = encode_snapshot(state, writer)
    assert plain["replay"]["tasks"]["t1"][0][0] == {FRAMES_KEY: [0, 2]}  # header + one screenshot
    assert writer.count == 6 and plain["other"] == [1, (2, "x")]
    restored = internalize(plain, read_frames(path, 1 << 20))
    assert restored == encode_snapshot(state)  # the same frames as encoding in place
    assert decode_trajectory(restored["replay"]["tasks"]["t2"][0][0]) == trajectories[1]

    path.write_bytes(path.read_bytes()[:-10])  # a torn last frame
    with pytest.raises(ValueError, match="truncated"):
        read_frames(path, 1 << 20)
    with pytest.raises(ValueError, match="outside"):
        internalize({FRAMES_KEY: [5, 2]}, [b"a", b"b"])
