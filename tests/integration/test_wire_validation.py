"""Codec + validation against hostile and corrupt trajectories (arpo_async.validation, the fuzzer in
tests/wire_fuzz.py, whose command line is bench/fuzz_wire.py)."""

from __future__ import annotations

import math
import random

import msgpack
import pytest

from arpo_async import codec
from arpo_async.validation import InvalidMessage, check_hello, check_trajectory
from arpo_async.messages import Hello
from tests.wire_fuzz import VERSION, VOCAB, base_trajectory, reencode, run_fuzz, set_step_value


def test_fuzz_2000_cases_no_crash_no_wrong_accept():
    crashes = []
    tally = run_fuzz(2000, seed=1, on_crash=lambda name, e: crashes.append((name, repr(e))))
    assert tally.cases == 2000
    assert crashes == [] and tally.crashes == 0
    assert tally.wrong_accepts == 0 and tally.valid_rejected == 0
    assert 1000 < tally.rejected < 2000  # most mutations are invalid; the valid ones pass


def _traj():
    return base_trajectory(random.Random(7))


@pytest.mark.parametrize("mutate, reason", [
    (lambda t: setattr(t, "score", math.nan), "score"),
    (lambda t: setattr(t, "score", 1.5), "score"),
    (lambda t: t.steps[0].logprobs.__setitem__(0, 0.25), "logprobs"),
    (lambda t: t.steps[0].logprobs.__setitem__(0, -math.inf), "logprobs"),
    (lambda t: setattr(t.steps[0], "versions", t.steps[0].versions[:-1]), "lengths"),
    (lambda t: t.steps[0].output_ids.__setitem__(0, VOCAB), "token_ids"),
    (lambda t: t.steps[1].prompt_ids.__setitem__(0, -3), "token_ids"),
    (lambda t: setattr(t.steps[0], "image_indices", [2]), "image_indices"),
    (lambda t: setattr(t.steps[0], "versions", [VERSION + 1] * len(t.steps[0].output_ids)), "versions"),
    (lambda t: setattr(t, "timings", {"episode_s": math.nan}), "timings"),
    (lambda t: setattr(t.steps[1], "settle_s", math.nan), "timings"),  # metrics.jsonl's stage_s.settle
    (lambda t: setattr(t.steps[0], "settle_s", -0.5), "timings"),
    (lambda t: setattr(t.steps[0], "settle_s", math.inf), "timings"),
    (lambda t: setattr(t, "outcome", "WIN"), "outcome"),
    (lambda t: setattr(t, "steps", t.steps * 300), "size"),
    (lambda t: (setattr(t, "outcome", "SUCCESS"), setattr(t, "steps", [])), "lengths"),  # issue 24 item 8
])
def test_each_bad_value_has_its_reason(mutate, reason):
    traj = _traj()
    check_trajectory(traj, vocab_size=VOCAB, version=VERSION)  # the base is valid
    mutate(traj)
    with pytest.raises(InvalidMessage) as caught:
        check_trajectory(traj, vocab_size=VOCAB, version=VERSION)
    assert caught.value.reason == reason


def test_boolean_schema_and_plain_huge_ids_are_refused():
    traj = _traj()
    n = len(traj.steps[0].output_ids)
    frames = codec.encode(traj)
    with pytest.raises(codec.WireError, match="schema"):
        codec.decode(reencode(frames, lambda h: h.__setitem__("schema", True)), max_bytes=1 << 26)
    ids = [2**40] + [1] * (n - 1)  # a plain msgpack list, not the packed int32 array actors send
    huge = reencode(frames, lambda h: set_step_value(h, 0, "output_ids", ids))
    decoded = codec.decode(huge, max_bytes=1 << 26)  # the codec checks types; the value is validation's
    with pytest.raises(InvalidMessage, match="token_ids"):
        check_trajectory(decoded, vocab_size=VOCAB, version=VERSION)
    column = msgpack.unpackb(huge[0], raw=False, ext_hook=lambda c, d: d)["body"]["steps"][1]["output_ids"]
    assert column[0][:n] == ids  # the step's ids travelled as plain msgpack integers


def test_settle_fields_travel_and_wrong_types_are_refused_naming_the_step():
    """Step.settle_s and Step.settle_timed_out (actors.settle's wait after the step's action) arrive as sent; a peer
    that sends a string or a number where the timed-out flag is a bool, or a string as seconds, is refused by the
    codec with the step and field named."""
    traj = _traj()
    traj.steps[0].settle_s, traj.steps[0].settle_timed_out = 0.25, True
    decoded = codec.decode(codec.encode(traj), max_bytes=1 << 26)
    assert [(s.settle_s, s.settle_timed_out) for s in decoded.steps] == [(0.25, True), (0.0, False)]
    check_trajectory(decoded, vocab_size=VOCAB, version=VERSION)
    frames = codec.encode(traj)
    for field, value in (("settle_timed_out", 1), ("settle_timed_out", "yes"), ("settle_s", "0.2")):
        with pytest.raises(codec.WireError, match=rf"steps\[1\]\.{field}"):
            codec.decode(reencode(frames, lambda h: set_step_value(h, 1, field, value)), max_bytes=1 << 26)


def test_hello_slots_are_bounded():
    check_hello(Hello("a", 8))
    for slots in (-1, 10**6):
        with pytest.raises(InvalidMessage, match="slots"):
            check_hello(Hello("a", slots))


def test_the_first_problem_is_named_in_step_order():
    """Token ids, log-probs and versions are checked over all steps at once; when that finds a problem the per-step
    checks name the first one, in step order, as they always did."""
    traj = _traj()
    traj.steps[0].image_indices = [2]  # a problem of step 0 that the all-steps check does not look at
    traj.steps[1].output_ids[0] = VOCAB  # and a token id past the vocabulary in step 1
    with pytest.raises(InvalidMessage) as caught:
        check_trajectory(traj, vocab_size=VOCAB, version=VERSION)
    assert caught.value.reason == "image_indices"
    traj.steps[0].image_indices = [0]
    with pytest.raises(InvalidMessage, match=r"steps\[1\]\.output_ids holds 771") as caught:
        check_trajectory(traj, vocab_size=VOCAB, version=VERSION)
    assert caught.value.reason == "token_ids"
    traj.steps[1].output_ids[0] = 0
    traj.steps[1].logprobs = traj.steps[1].logprobs.tolist()  # a list assigned after construction is checked too
    traj.steps[1].logprobs[-1] = math.nan
    with pytest.raises(InvalidMessage, match=r"steps\[1\]\.logprobs holds nan"):
        check_trajectory(traj, vocab_size=VOCAB, version=VERSION)


def test_a_decoded_trajectory_is_checked_on_its_columns_and_a_problem_still_names_its_step():
    """A decoded trajectory's steps are views of one column per field: the all-steps check reads the column once,
    and when it finds a problem the per-step checks name the step; a step's array that is not a plain 1-D view of
    its column (here a 2-D one) is never vouched for by the column."""
    traj = _traj()
    traj.steps[1].output_ids[0] = VOCAB
    decoded = codec.decode(codec.encode(traj), max_bytes=1 << 26)
    assert decoded.steps[0].output_ids.base is decoded.steps[1].output_ids.base  # views of one column
    with pytest.raises(InvalidMessage, match=r"steps\[1\]\.output_ids holds 771"):
        check_trajectory(decoded, vocab_size=VOCAB, version=VERSION)
    decoded = codec.decode(codec.encode(_traj()), max_bytes=1 << 26)
    check_trajectory(decoded, vocab_size=VOCAB, version=VERSION)
    column = decoded.steps[0].prompt_ids.base
    decoded.steps[0].prompt_ids = column[:4].reshape(2, 2)  # assigned after construction, as a caller could
    with pytest.raises(InvalidMessage, match=r"steps\[0\]\.prompt_ids is a 2-D array"):
        check_trajectory(decoded, vocab_size=VOCAB, version=VERSION)
