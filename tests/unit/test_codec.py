"""Codec: a round trip for every message type, and clear WireErrors for corrupt or hostile input."""

import msgpack
import numpy as np
import pytest

from arpo_async import codec
from arpo_async.messages import (Ack, Assignment, Heartbeat, Hello, LearnerStatus, MESSAGE_TYPES, Reject, Shutdown,
                                 Step, Trajectory, WorkRequest)

LIMIT = 64 * 1024 * 1024


def sample_trajectory() -> Trajectory:
    step = Step(prompt_ids=[1, 2, 3, 151655, 151655], image_indices=[0], output_ids=[7, 8, 9],
                logprobs=[-0.5, -1.25, -3.0e-7], versions=[3, 3, 4], text="Thought: x\nAction: wait()",
                action="wait()", generate_s=0.5, act_s=0.01, observe_s=0.02)
    return Trajectory(trajectory_id="t1", actor_id="host-1/0", task_id="grid4-red", group_id="g0-grid4-red",
                      rollout_index=2, outcome="SUCCESS", score=1.0, format_ok=True, steps=[step, step],
                      screenshots=[b"\x89PNG" + bytes(range(256)) * 40, b"small"], timings={"episode_s": 1.5},
                      assigned_version=3)


SAMPLES = [
    sample_trajectory(),
    Hello("a", 8, ["t1", "t2"]),
    Heartbeat("a", 3, 1, 0),
    WorkRequest("a-r1", "a"),
    Assignment("a-r1", {"id": "t", "config": [{"type": "sleep", "parameters": {"seconds": 1}}]}, "g1", 0, 5),
    Ack(["t1"]),
    LearnerStatus("abc", 2),
    Shutdown("done"),
    Reject("bad"),
]


def test_every_message_type_has_a_sample():
    assert {type(m).TYPE for m in SAMPLES} == set(MESSAGE_TYPES)


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).TYPE)
def test_round_trip(message):
    frames = codec.encode(message)
    assert codec.decode(frames, max_bytes=LIMIT) == message


def test_screenshots_travel_as_raw_frames():
    traj = sample_trajectory()
    frames = codec.encode(traj)
    assert frames[1] == traj.screenshots[0]  # the big screenshot is its own frame, byte for byte
    assert len(frames) == 2  # the small one stays inline
    assert b"base64" not in frames[0]


def test_token_ids_pack_as_int32_arrays():
    traj = sample_trajectory()
    header = codec.encode(traj)[0]
    packed_ids = np.asarray(traj.steps[0].prompt_ids, dtype="<i4").tobytes()
    packed_logprobs = np.asarray(traj.steps[0].logprobs, dtype="<f8").tobytes()
    assert packed_ids in header and packed_logprobs in header


def hostile(body_or_header):
    return [msgpack.packb(body_or_header, use_bin_type=True)]


@pytest.mark.parametrize("frames,reason", [
    ([], "empty"),
    ([b"\xc1"], "not valid msgpack"),
    ([b"\x92\x01"], "not valid msgpack"),
    (hostile([1, 2]), "map with a string 'type'"),
    (hostile({"type": "pickle", "schema": 1, "body": {}}), "unknown message type"),
    (hostile({"type": "ack", "schema": 99, "body": {"trajectory_ids": []}}), "schema"),
    (hostile({"type": "ack", "schema": 1, "body": {}}), "missing field 'trajectory_ids'"),
    (hostile({"type": "ack", "schema": 1, "body": {"trajectory_ids": "t1"}}), "expected a list"),
    (hostile({"type": "ack", "schema": 1, "body": {"trajectory_ids": [], "evil": 1}}), "unknown field"),
    (hostile({"type": "learner_status", "schema": 1, "body": {"learner_id": "x", "policy_version": True}}),
     "expected an integer"),
    ([msgpack.packb({"type": "hello", "schema": 1, "body": {"actor_id": msgpack.ExtType(1, b"\x05\0\0\0"),
                                                               "slots": 1}})], "blob reference"),
    ([msgpack.packb({"type": "hello", "schema": 1, "body": {"actor_id": msgpack.ExtType(42, b""), "slots": 1}})],
     "unknown msgpack extension"),
    ([b"x" * 2000], "exceeds the limit"),
])
def test_bad_input_raises_wire_error(frames, reason):
    with pytest.raises(codec.WireError, match=reason):
        codec.decode(frames, max_bytes=1000)


def test_truncated_trajectory_is_rejected():
    frames = codec.encode(sample_trajectory())
    with pytest.raises(codec.WireError):
        codec.decode([frames[0][:-10], *frames[1:]], max_bytes=LIMIT)
    with pytest.raises(codec.WireError, match="blob reference"):
        codec.decode(frames[:1], max_bytes=LIMIT)


def test_encode_refuses_non_messages_and_out_of_range_ids():
    with pytest.raises(codec.WireError):
        codec.encode({"type": "ack"})
    traj = sample_trajectory()
    traj.steps[0].output_ids = [2**40]
    with pytest.raises(codec.WireError, match="int32"):
        codec.encode(traj)
