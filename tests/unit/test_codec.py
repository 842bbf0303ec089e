"""Codec: a round trip for every message type, and clear WireErrors for corrupt or hostile input."""

import msgpack
import numpy as np
import pytest

from arpo_async import codec
from tests.support import huge_table
from arpo_async.validation import InvalidMessage, check_assignment
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
    Assignment("a-r2", {"id": "t"}, "L-e0-0-t", 1, 5, evaluation=True, max_steps=3, temperature=0.0),
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


def test_text_built_with_a_lone_surrogate_is_escaped_and_what_msgpack_cannot_pack_is_a_wire_error():
    step = Step([1], [], [2], [-0.1], [0], "Thought: \ud800", "click(\udfff)")
    traj = Trajectory("t", "a", "k", "g", 0, "FAILURE", 0.0, True, [step], [], error="E: \ud800")
    assert (step.text, step.action, traj.error) == ("Thought: \\ud800", "click(\\udfff)", "E: \\ud800")
    assert codec.decode(codec.encode(traj), max_bytes=LIMIT).error == "E: \\ud800"
    traj.error = "set later: \ud800"  # after construction: the codec refuses it with a WireError, nothing else
    with pytest.raises(codec.WireError, match="UnicodeEncodeError"):
        codec.encode(traj)
    traj.error, traj.rollout_index = "", 2**70
    with pytest.raises(codec.WireError, match="OverflowError"):
        codec.encode(traj)


@pytest.mark.parametrize("rows, reason", [(5000, "5000 rows, more than the 4096"),
                                          (100_000, "exceeds max_array_len")])
def test_a_table_of_too_many_rows_is_refused_from_its_lengths(rows, reason):
    with pytest.raises(codec.WireError, match=reason):
        codec.decode(huge_table(rows), max_bytes=LIMIT)
    assert len(codec.decode(huge_table(512), max_bytes=LIMIT).steps) == 512  # the learner's own cap still decodes


def test_decoded_token_arrays_are_packed_views_not_python_lists():
    traj = codec.decode(codec.encode(sample_trajectory()), max_bytes=LIMIT)
    for step in traj.steps:
        for values, dtype in ((step.prompt_ids, "<i4"), (step.output_ids, "<i4"), (step.versions, "<i4"),
                              (step.logprobs, "<f8")):
            assert type(values) is np.ndarray and values.dtype == np.dtype(dtype) and values.ndim == 1
            assert not values.flags.writeable  # a view of the received bytes, not a copy
    assert traj.steps[0].prompt_ids.tolist() == [1, 2, 3, 151655, 151655]
    assert traj.steps[0].logprobs.tolist() == [-0.5, -1.25, -3.0e-7]  # float64: bit-exact


def test_a_decoded_screenshot_is_a_view_of_its_frame():
    frames = codec.encode(sample_trajectory())
    frame = bytearray(frames[1])
    traj = codec.decode([frames[0], frame], max_bytes=LIMIT)
    assert type(traj.screenshots[0]) is memoryview and traj.screenshots[0].readonly
    assert traj.screenshots[0] == sample_trajectory().screenshots[0] and traj.screenshots[1] == b"small"
    frame[0] = 0  # no copy was made: the screenshot is the frame's memory
    assert traj.screenshots[0][0] == 0
    assert codec.decode(codec.encode(traj), max_bytes=LIMIT) == traj  # a view encodes like bytes


def _with_step_field(name, value):
    header = msgpack.unpackb(codec.encode(sample_trajectory())[0], raw=False,
                             ext_hook=lambda code, data: msgpack.ExtType(code, data))
    column = header["body"]["steps"][1][name]  # [values, lengths] of both (equal) steps
    if isinstance(value, list):  # a plain msgpack list: both steps' values, with their lengths
        column[:] = [value * 2, msgpack.ExtType(2, np.array([len(value)] * 2, "<i4").tobytes())]
    else:
        column[0] = value
    return [msgpack.packb(header, use_bin_type=True), *codec.encode(sample_trajectory())[1:]]


def test_plain_lists_are_accepted_and_checked_item_by_item():
    traj = codec.decode(_with_step_field("output_ids", [7, 8, 9]), max_bytes=LIMIT)
    assert traj == sample_trajectory() and traj.steps[0].output_ids.dtype == np.int32
    traj = codec.decode(_with_step_field("logprobs", [-1, -0.5, 0]), max_bytes=LIMIT)
    assert traj.steps[0].logprobs.dtype == np.float64 and traj.steps[0].logprobs.tolist() == [-1.0, -0.5, 0.0]


@pytest.mark.parametrize("name,value,reason", [
    ("output_ids", [7, 8.0, 9], "expected an integer"),
    ("output_ids", [7, True, 9], "expected an integer"),
    ("output_ids", msgpack.ExtType(3, np.zeros(3).tobytes()), "expected a packed int32 array, got a float64"),
    ("output_ids", msgpack.ExtType(2, b"\0" * 5), "not a multiple of 4"),
    ("output_ids", "789", "expected a packed int32 array or a list"),
    ("output_ids", [[7], [8], [9]], "expected an integer"),
    ("logprobs", [-1.0, False, -2.0], "expected a number"),
    ("logprobs", {"a": 1}, "expected a packed float64 array or a list"),
    ("versions", [2**64 - 1, -1, 0], "integers"),
])
def test_array_fields_refuse_what_is_not_their_dtype(name, value, reason):
    with pytest.raises(codec.WireError, match=reason):
        codec.decode(_with_step_field(name, value), max_bytes=LIMIT)


def test_steps_hold_arrays_whatever_they_were_built_from():
    step = sample_trajectory().steps[0]
    assert type(step.prompt_ids) is np.ndarray and step.prompt_ids.dtype == np.int32
    assert step.logprobs.dtype == np.float64 and step == sample_trajectory().steps[0]
    assert Step([1, 2], [0], [3], [-0.5], [4], "t", "a") != Step([1, 2], [0], [3], [-0.5], [5], "t", "a")
    with pytest.raises(TypeError):
        Step([1.5], [0], [3], [-0.5], [4], "t", "a")  # a float is no token id: never truncated
    wide = Step([2**40], [0], [3], [-0.5], [4], "t", "a")  # kept wide for validation to name, never wrapped
    assert wide.prompt_ids.tolist() == [2**40]


def _header(frames):
    return msgpack.unpackb(frames[0], raw=False, ext_hook=lambda code, data: msgpack.ExtType(code, data))


def _packed_header(header, frames):
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


def test_steps_travel_as_one_table_with_an_array_per_column():
    frames = codec.encode(sample_trajectory())
    header = _header(frames)
    n, columns = header["body"]["steps"]
    assert header["schema"] == 2 and n == 2
    values, lengths = columns["prompt_ids"]
    assert values.code == 2 and np.frombuffer(values.data, "<i4").tolist() == [1, 2, 3, 151655, 151655] * 2
    assert np.frombuffer(lengths.data, "<i4").tolist() == [5, 5]
    assert columns["logprobs"][0].code == 3 and columns["text"] == ["Thought: x\nAction: wait()"] * 2
    decoded = codec.decode(frames, max_bytes=LIMIT)
    assert decoded == sample_trajectory()
    assert decoded.steps[1].prompt_ids.base is decoded.steps[0].prompt_ids.base  # views of one column


def test_a_schema_1_trajectory_with_one_map_per_step_still_decodes():
    """Trajectories saved in checkpoints before schema 2 load: their steps are a list of maps."""
    traj = sample_trajectory()
    frames = codec.encode(traj)
    header = _header(frames)
    header["schema"] = 1
    header["body"]["steps"] = [
        {"prompt_ids": msgpack.ExtType(2, s.prompt_ids.tobytes()), "image_indices": s.image_indices,
         "output_ids": msgpack.ExtType(2, s.output_ids.tobytes()), "logprobs": msgpack.ExtType(3, s.logprobs.tobytes()),
         "versions": msgpack.ExtType(2, s.versions.tobytes()), "text": s.text, "action": s.action,
         "generate_s": s.generate_s, "act_s": s.act_s, "observe_s": s.observe_s} for s in traj.steps]
    assert codec.decode(_packed_header(header, frames), max_bytes=LIMIT) == traj


def _table_case(mutate):
    frames = codec.encode(sample_trajectory())
    header = _header(frames)
    mutate(header["body"])
    return _packed_header(header, frames)


def _set_lengths(sizes):
    return lambda body: body["steps"][1]["output_ids"].__setitem__(1, msgpack.ExtType(2, np.array(sizes, "<i4")
                                                                                       .tobytes()))


@pytest.mark.parametrize("mutate,reason", [
    (lambda body: body.__setitem__("steps", {"rows": 2}), "expected a table"),
    (lambda body: body.__setitem__("steps", [2, {}]), "2 rows in 0 columns"),
    (lambda body: body["steps"].__setitem__(0, -1), "rows"),
    (lambda body: body["steps"][1].__setitem__("evil", [1, 2]), "unknown column"),
    (lambda body: body["steps"][1].pop("output_ids"), "missing column 'output_ids'"),
    (lambda body: body["steps"][1]["text"].pop(), "expected a list of 2 values"),
    (lambda body: body["steps"][1].__setitem__("act_s", [0.1, "x"]), r"steps\[1\]\.act_s: expected a number"),
    (lambda body: body["steps"][1].__setitem__("output_ids", [msgpack.ExtType(2, b"")]), r"\[values, lengths\]"),
    (_set_lengths([3]), "1 lengths for 2 rows"),
    (_set_lengths([7, -1]), ">= 0"),
    (_set_lengths([3, 4]), "add up to 7, not the 6 values"),
    (lambda body: body["steps"][1]["output_ids"].__setitem__(1, [3, 2**40]), "lengths must be int32"),
    (lambda body: body["steps"][1]["logprobs"].__setitem__(1, msgpack.ExtType(3, np.ones(2).tobytes())),
     "expected a packed int32 array, got a float64"),
])
def test_a_malformed_table_of_steps_is_refused_with_its_reason(mutate, reason):
    with pytest.raises(codec.WireError, match=reason):
        codec.decode(_table_case(mutate), max_bytes=LIMIT)


def test_a_table_whose_values_do_not_fit_their_row_names_the_step():
    traj = sample_trajectory()
    traj.steps = [traj.steps[0], Step([1], [0], [2], [-0.5], [1], "t", "a")]
    traj.steps[1].versions = np.array([2**40])
    with pytest.raises(codec.WireError, match=r"steps\[1\]\.versions"):
        codec.encode(traj)


def test_a_long_array_column_travels_in_a_frame_of_its_own_and_decodes_to_views_of_it():
    traj = sample_trajectory()
    traj.steps = [Step(np.arange(3000, dtype=np.int32), [0], [7], [-0.5], [3], "t", "a") for _ in range(2)]
    frames = codec.encode(traj)
    header = _header(frames)
    values, lengths = header["body"]["steps"][1]["prompt_ids"]
    assert values.code == 4 and len(frames) == 3  # header, the prompt ids, a screenshot (the other is inline)
    index = 1 + int.from_bytes(values.data, "little")
    assert bytes(frames[index]) == np.arange(3000, dtype="<i4").tobytes() * 2
    assert header["body"]["steps"][1]["output_ids"][0].code == 2  # 8 bytes: inline
    frame = bytearray(frames[index])
    decoded = codec.decode([*frames[:index], frame, *frames[index + 1:]], max_bytes=LIMIT)
    assert decoded == traj
    frame[:4] = (9).to_bytes(4, "little")  # no copy was made: the ids are the frame's memory
    assert decoded.steps[0].prompt_ids[0] == 9
    header["body"]["steps"][1]["prompt_ids"][0] = msgpack.ExtType(4, (7).to_bytes(4, "little"))
    with pytest.raises(codec.WireError, match="array frame reference 7 but only 2 blob frames"):
        codec.decode(_packed_header(header, frames), max_bytes=LIMIT)
    with pytest.raises(codec.WireError, match="not a multiple of 4"):
        codec.decode([*frames[:index], frames[index][:-1], *frames[index + 1:]], max_bytes=LIMIT)


def _assignment_body(**fields) -> dict:
    return {"request_id": "a-r1", "task": {"id": "t"}, "group_id": "g1", "rollout_index": 0, "policy_version": 5,
            **fields}


def test_an_assignment_without_the_evaluation_fields_is_a_training_rollout_of_the_actors_own_settings():
    """What a learner that predates the fields sends: their defaults, no evaluation and no override."""
    decoded = codec.decode(hostile({"type": "assignment", "schema": 2, "body": _assignment_body()}), max_bytes=LIMIT)
    assert (decoded.evaluation, decoded.max_steps, decoded.temperature) == (False, 0, -1.0)
    check_assignment(decoded)


@pytest.mark.parametrize(("fields", "reason"), [
    ({"evaluation": 1}, "evaluation: expected bool"),
    ({"max_steps": 2.0}, "max_steps: expected an integer"),
    ({"max_steps": True}, "max_steps: expected an integer"),
    ({"temperature": "0.5"}, "temperature: expected a number"),
])
def test_the_codec_refuses_evaluation_fields_of_the_wrong_type(fields, reason):
    with pytest.raises(codec.WireError, match=reason):
        codec.decode(hostile({"type": "assignment", "schema": 2, "body": _assignment_body(**fields)}),
                     max_bytes=LIMIT)


@pytest.mark.parametrize(("fields", "reason"), [
    ({"max_steps": -1}, "max_steps -1"),
    ({"max_steps": 100_000}, "max_steps 100000"),
    ({"temperature": float("nan")}, "temperature nan"),
    ({"temperature": 1e9}, "temperature 1000000000.0"),
    ({"rollout_index": -2}, "rollout_index -2"),
    ({"group_id": ""}, "group_id is empty"),
])
def test_validation_refuses_evaluation_values_an_actor_cannot_run(fields, reason):
    decoded = codec.decode(hostile({"type": "assignment", "schema": 2, "body": _assignment_body(**fields)}),
                           max_bytes=LIMIT)  # the right types: the codec lets them through
    with pytest.raises(InvalidMessage, match=reason):
        check_assignment(decoded)
    check_assignment(codec.decode(codec.encode(SAMPLES[5]), max_bytes=LIMIT))  # an evaluation one that is fine
