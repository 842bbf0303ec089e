"""Wire fuzzer: hostile and corrupt trajectories through the learner's codec and validation.

Each case starts from a valid trajectory (2 steps, 2 screenshots, token ids of a 771-token vocabulary, learner at
policy version 5), applies one mutation and knows whether the result is still valid: NaN / infinite /
out-of-range scores, log-probs and timings, token ids that are negative or past the vocabulary (also as plain
msgpack integers up to 2^40, not the packed int32 arrays actors send), output ids, log-probs and versions of
different lengths, image indices outside the screenshots, versions newer than the learner's, a boolean schema,
unknown outcomes, wrong field types, oversized fields, step-table columns whose lengths do not fit their values,
and random byte flips in the header frame (whose result may be valid or not). Every case goes through ``codec.decode`` then ``validation.check_trajectory``:

- rejected: WireError or InvalidMessage, with a reason;
- wrong accept: a case built invalid that passed both (target 0);
- crash: any other exception (target 0).

Test infrastructure: tests/integration/test_wire_validation.py runs it and builds its own cases from
:func:`base_trajectory`, :func:`reencode` and :func:`set_step_value`; test_hostile_peer.py sends such cases to a
real learner; ``python -m bench.fuzz_wire`` is its command line (10,000 cases, the figures in docs/benchmarks.md).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Callable

import msgpack
import numpy as np

from arpo_async import codec
from arpo_async.messages import Outcome, Step, Trajectory
from arpo_async.validation import InvalidMessage, check_trajectory

VOCAB = 771
VERSION = 5
MAX_BYTES = 64 << 20


def base_trajectory(rng: random.Random) -> Trajectory:
    """A valid trajectory drawn from ``rng``: 2 steps of 1-20 output ids each, 2 screenshots (100 B or 5 KB of
    random bytes), token ids below :data:`VOCAB`, versions up to :data:`VERSION`."""
    steps = []
    for k in range(2):
        n = rng.randint(1, 20)
        steps.append(Step(prompt_ids=[rng.randrange(VOCAB) for _ in range(rng.randint(5, 60))], image_indices=[k],
                          output_ids=[rng.randrange(VOCAB) for _ in range(n)],
                          logprobs=[-rng.random() * 5 for _ in range(n)], versions=[rng.randint(0, VERSION)] * n,
                          text="Thought: x\nAction: click(start_box='(1,2)')", action="click(1,2)",
                          generate_s=rng.random(), act_s=rng.random(), observe_s=rng.random()))
    return Trajectory(trajectory_id=f"t{rng.randrange(1 << 30)}", actor_id="a", task_id="grid4-red", group_id="g1",
                      rollout_index=rng.randrange(8), outcome=rng.choice(["SUCCESS", "FAILURE", "TRUNCATED"]),
                      score=rng.choice([0.0, 1.0, 0.5]), format_ok=True, steps=steps,
                      screenshots=[rng.randbytes(rng.choice([100, 5000])) for _ in range(2)],
                      timings={"episode_s": rng.random() * 10}, assigned_version=rng.randint(0, VERSION))


def reencode(frames: list[bytes], mutate: Callable[[dict], None]) -> list[bytes]:
    """Decode the header keeping extension values as they are, let ``mutate`` change it, encode it again."""
    header = msgpack.unpackb(frames[0], raw=False, ext_hook=lambda code, data: msgpack.ExtType(code, data))
    mutate(header)
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


def set_step_value(header: dict, index: int, field: str, value: Any) -> None:
    """Make step ``index`` of a trajectory header (from :func:`reencode`) hold ``value`` in ``field``, as a hostile
    peer would send it. The steps travel as a table (arpo_async.codec, schema 2): in an array column ``[values,
    lengths]`` a list becomes the step's part of the values, the whole column then a plain msgpack list (the other
    steps' values unpacked) with the lengths re-packed, and anything else replaces the column's values; in any other
    column it replaces the step's value."""
    column = header["body"]["steps"][1][field]
    if not (len(column) == 2 and isinstance(column[1], msgpack.ExtType)):
        column[index] = value
        return
    if not isinstance(value, list):
        column[0] = value
        return
    values, lengths = column
    if values.code not in (2, 3):
        raise ValueError(f"the {field} column travels in a frame of its own: mutate a trajectory with fewer ids")
    sizes = np.frombuffer(lengths.data, "<i4").tolist()
    flat = np.frombuffer(values.data, "<f8" if values.code == 3 else "<i4").tolist()
    starts = [0, *np.cumsum(sizes).tolist()]
    rows = [flat[start:end] for start, end in zip(starts, starts[1:])]
    rows[index], sizes[index] = value, len(value)
    column[:] = [[v for row in rows for v in row], msgpack.ExtType(2, np.array(sizes, "<i4").tobytes())]


BAD_FLOATS = [math.nan, math.inf, -math.inf]


def _set_step(field: str, value: Any) -> Callable[[dict], None]:
    def mutate(header: dict) -> None:
        set_step_value(header, 0, field, value)
    return mutate


def mutations(rng: random.Random, traj: Trajectory) -> tuple[str, Any, bool | None]:
    """(name, a Trajectory to encode or a header mutation, valid?); None = either (byte flips)."""
    step = traj.steps[0]
    n = len(step.output_ids)
    kind = rng.randrange(23)
    if kind == 0:
        traj.score = rng.choice(BAD_FLOATS + [-0.1, 1.5, 1e308])
        return "score", traj, False
    if kind == 1:
        step.logprobs[rng.randrange(n)] = rng.choice(BAD_FLOATS + [0.5, 1e-3])
        return "logprobs", traj, False
    if kind == 2:
        target = rng.choice(["logprobs", "versions", "output_ids"])
        values = getattr(step, target)
        setattr(step, target, np.concatenate([values, values[:1]]) if rng.random() < 0.5 or len(values) < 2
                else values[:-1])
        return "lengths", traj, False
    if kind == 3:
        bad = rng.choice([-1, VOCAB, VOCAB + 5, 2**31 - 1, -(2**31)])
        target = rng.choice(["prompt_ids", "output_ids"])
        getattr(step, target)[0] = bad
        return "token_ids", traj, False
    if kind == 4:  # a plain msgpack list of huge ints, as a hostile peer would send
        bad = rng.choice([2**40, -(2**40), 2**32 + 1])
        return "token_ids_plain", _set_step(rng.choice(["prompt_ids", "output_ids"]),
                                            [bad] + step.output_ids[1:].tolist()), False
    if kind == 5:
        step.image_indices = [rng.choice([-1, 2, 3, 1000])]
        return "image_indices", traj, False
    if kind == 6:
        step.versions = [rng.choice([VERSION + 1, 10**6, -1])] * n
        return "versions", traj, False
    if kind == 7:
        traj.assigned_version = rng.choice([VERSION + 1, -1])
        return "assigned_version", traj, False
    if kind == 8:
        return "schema_bool", lambda h: h.__setitem__("schema", True), False
    if kind == 9:
        traj.timings = {"episode_s": rng.choice(BAD_FLOATS + [-1.0])}
        return "timings", traj, False
    if kind == 10:
        step.generate_s = rng.choice(BAD_FLOATS + [-2.0])
        return "step_timings", traj, False
    if kind == 11:
        traj.outcome = rng.choice(["WIN", "", "success", "x" * 100])
        return "outcome", traj, False
    if kind == 12:
        field, value = rng.choice([("score", "1.0"), ("format_ok", 1), ("steps", {}), ("screenshots", [1]),
                                   ("rollout_index", 1.5), ("rollout_index", True), ("timings", [1.0])])
        return "types", lambda h: h["body"].__setitem__(field, value), False
    if kind == 13:
        traj.steps = traj.steps * 300
        return "too_many_steps", traj, False
    if kind == 14:
        step.text = "x" * ((1 << 20) + 1)
        return "long_text", traj, False
    if kind == 15:
        traj.trajectory_id = rng.choice(["", "y" * 300])
        return "ids", traj, False
    if kind == 16:
        return "unknown_field", lambda h: h["body"].__setitem__("evil", 1), False
    if kind == 17:
        return "missing_field", lambda h: h["body"].pop("score"), False
    if kind == 18:
        traj.rollout_index = rng.choice([-1, 2**40])
        return "rollout_index", traj, False
    if kind == 19:  # valid variations
        traj.outcome = rng.choice([Outcome.ENV_ERROR, Outcome.ABORTED, Outcome.POLICY_ERROR])
        traj.score = 0.0
        return "valid_outcomes", traj, True
    if kind == 20:
        traj.steps[0].image_indices = []
        traj.score = rng.random()
        return "valid_values", traj, True
    if kind == 21:  # the steps table's shape: a column's lengths that do not fit its values or its rows
        field = rng.choice(["prompt_ids", "image_indices", "output_ids", "logprobs", "versions"])
        sizes = rng.choice([[1], [1, 2, 3], [-1, 10**6], [10**6, 0], [2**31 - 1, 2**31 - 1]])
        return "table_lengths", lambda h: h["body"]["steps"][1][field].__setitem__(
            1, msgpack.ExtType(2, np.array(sizes, "<i4").tobytes())), False
    return "byte_flip", None, None


@dataclass
class Tally:
    """Counts of one fuzz run; ``crashes``, ``wrong_accepts`` and ``valid_rejected`` must stay 0."""

    cases: int = 0
    rejected: int = 0
    crashes: int = 0
    wrong_accepts: int = 0
    valid_rejected: int = 0


def run_fuzz(cases: int, seed: int, *, on_crash: Callable[[str, BaseException], None] | None = None) -> Tally:
    """Run ``cases`` cases from ``seed``; see the module docstring."""
    rng = random.Random(seed)
    tally = Tally()
    for _ in range(cases):
        traj = base_trajectory(rng)
        name, mutation, valid = mutations(rng, traj)
        tally.cases += 1
        try:
            if isinstance(mutation, Trajectory):
                try:
                    frames = codec.encode(mutation)
                except codec.WireError:  # our own encoder refuses it (e.g. an id past int32): so would a peer's
                    tally.rejected += 1
                    continue
            else:
                frames = codec.encode(base_trajectory(random.Random(rng.random())) if mutation is None else traj)
                if mutation is None:
                    header = bytearray(frames[0])
                    for _ in range(rng.randint(1, 4)):
                        header[rng.randrange(len(header))] = rng.randrange(256)
                    frames = [bytes(header), *frames[1:]]
                else:
                    frames = reencode(frames, mutation)
            decoded = codec.decode(frames, max_bytes=MAX_BYTES)
            if not isinstance(decoded, Trajectory):
                raise InvalidMessage("fields", f"a {type(decoded).__name__}, not a trajectory")
            check_trajectory(decoded, vocab_size=VOCAB, version=VERSION)
        except (codec.WireError, InvalidMessage):
            tally.rejected += 1
            tally.valid_rejected += valid is True
            continue
        except Exception as error:  # noqa: BLE001 - counting crashes is the point
            tally.crashes += 1
            if on_crash is not None:
                on_crash(name, error)
            continue
        tally.wrong_accepts += valid is False
    return tally

