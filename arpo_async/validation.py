"""What a decoded message may say: the checks the learner runs on every message after the codec's type checks.

The codec (arpo_async.codec) guarantees a message has the right fields of the right types. This module checks
that their values make sense for the run: a score in [0, 1], finite log-probs <= 0, token ids inside the
vocabulary, image references inside the screenshot list, no token from a policy version the learner has not
published, and sizes within :class:`WireLimits`. A message that fails raises :class:`InvalidMessage` with a
short ``reason`` (counted in metrics by reason) and a detail for the log and the sender's ``Reject``.

Why here and not in the learner: actors run the same checks before sending (a trajectory the learner would
reject is a bug on the actor's side), and the fuzzer (tests/wire_fuzz.py, whose command line is bench/fuzz_wire.py;
tests/unit/test_validation.py) drives codec and checks together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from arpo_async.messages import Assignment, Hello, Outcome, Trajectory, WorkRequest

__all__ = ["InvalidMessage", "WireLimits", "check_assignment", "check_hello", "check_trajectory",
           "check_work_request"]


class InvalidMessage(ValueError):
    """A decoded message whose values the learner cannot use.

    Attributes:
        reason: short key for metrics (``score``, ``logprobs``, ``lengths``, ``token_ids``, ``image_indices``,
            ``versions``, ``size``, ``timings``, ``outcome``, ``fields``, ``sampling``; the learner's own checks
            add ``run``, ``session``, ``owner``, ``task``, ``duplicate``, ``slots``).
        detail: what exactly is wrong (the field path and value).
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class WireLimits:
    """Largest values one message may carry (each far above what a real episode needs)."""

    max_steps: int = 512
    """Policy steps per trajectory (OSWorld budgets are 15-100)."""
    max_prompt_tokens: int = 262_144
    """Prompt tokens of one step (15 screenshots of a 7B VLM are about 40k)."""
    max_output_tokens: int = 32_768
    """Generated tokens of one step."""
    max_screenshots: int = 4_096
    """Screenshots per trajectory (also the codec's frame limit)."""
    max_text_chars: int = 1 << 20
    """Characters of a step's text or action, and of a trajectory's error."""
    max_id_chars: int = 256
    """Characters of an id (trajectory, actor, task, group, request, desktop)."""
    max_timings: int = 64
    """Entries of a timings map."""
    max_slots: int = 4_096
    """Rollout slots one actor process may announce in its Hello."""
    max_held: int = 100_000
    """Trajectory ids a Hello may list as held."""


def _fail(reason: str, detail: str) -> None:
    raise InvalidMessage(reason, detail)


def _check_id(name: str, value: str, limits: WireLimits, *, empty_ok: bool = False) -> None:
    if len(value) > limits.max_id_chars:
        _fail("size", f"{name} has {len(value)} characters (most {limits.max_id_chars})")
    if not value and not empty_ok:
        _fail("fields", f"{name} is empty")


def _span(values: np.ndarray) -> tuple[int, int]:
    """(min, max) of a non-empty integer array, as Python ints (vectorised: one pass each over packed values)."""
    return int(values.min()), int(values.max())


def _all_below(ids: np.ndarray, bound: int | None) -> bool:
    """True when every value of the non-empty integer array ``ids`` is in [0, bound) ([0, inf) for None). An int32
    array takes one pass: viewed as uint32, a negative value is 2^31 or more, so one maximum checks both ends."""
    if ids.dtype == np.int32 and bound is not None and bound <= 1 << 31:
        return int(ids.view(np.uint32).max()) < bound
    return ids.min() >= 0 and (bound is None or ids.max() < bound)


def _check_token_ids(name: str, ids: np.ndarray, vocab_size: int | None) -> None:
    if not len(ids):
        return
    low, high = _span(ids)
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        bad = low if low < 0 else high
        _fail("token_ids", f"{name} holds {bad}, outside [0, {vocab_size if vocab_size is not None else 'inf'})")


def _values_ok(steps: list, vocab_size: int | None, version: int | None) -> bool:
    """True when the token ids, log-probs and versions of all ``steps`` pass the per-step value checks of
    :func:`check_trajectory`, tested over all steps at once (a dozen NumPy calls per trajectory instead of a dozen
    per step). False when any fails or is not a 1-D array of its kind: the per-step checks then find and name the
    first problem, in the same order as ever."""
    if not steps:
        return True
    try:
        prompt_ids, output_ids, logprobs, versions = (
            _covering([getattr(step, name) for step in steps])
            for name in ("prompt_ids", "output_ids", "logprobs", "versions"))
    except (TypeError, ValueError):  # a 0-d value, mixed dimensions, ragged nesting
        return False
    for arr, kinds in ((prompt_ids, "iu"), (output_ids, "iu"), (logprobs, "iuf"), (versions, "iu")):
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in kinds):
            return False
    for ids in (prompt_ids, output_ids):
        if ids.size and not _all_below(ids, vocab_size):
            return False
    if versions.size and (versions.min() < 0 or (version is not None and versions.max() > version)):
        return False
    return bool((np.isfinite(logprobs) & (logprobs <= 0.0)).all())


def _covering(arrays: list) -> np.ndarray:
    """One array holding every value of ``arrays`` (maybe more): the array they are all views of, when it is one
    1-D array (a decoded trajectory's steps are views of one column of the table they arrived in: no copy), else
    their concatenation. (Each must be a 1-D view of the same dtype: a 2-D or reinterpreted view of a column is
    concatenated, so the dimension and kind checks see it.) Checks that pass on it pass on each of them; where it holds more and a check fails, the
    per-step checks decide."""
    base = getattr(arrays[0], "base", None)
    if type(base) is np.ndarray and base.ndim == 1 and all(
            getattr(a, "base", None) is base and a.ndim == 1 and a.dtype is base.dtype for a in arrays):
        return base
    return np.concatenate(arrays)


def _arrays(where: str, step) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A step's (prompt_ids, output_ids, logprobs, versions) as 1-D integer / float arrays (no copy for the arrays
    a decoded or locally built step holds; a list assigned to a field after construction is converted)."""
    try:
        arrays = tuple(np.asarray(getattr(step, name))
                       for name in ("prompt_ids", "output_ids", "logprobs", "versions"))
    except (TypeError, ValueError) as e:  # ragged nesting
        _fail("fields", f"{where}: {e}")
    for name, arr, kinds in zip(("prompt_ids", "output_ids", "logprobs", "versions"), arrays,
                                ("iu", "iu", "iuf", "iu")):
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in kinds):
            _fail("fields", f"{where}.{name} is a {arr.ndim}-D array of {arr.dtype}, not 1-D "
                            f"{'numbers' if kinds == 'iuf' else 'integers'}")
    return arrays


def check_trajectory(traj: Trajectory, *, vocab_size: int | None, version: int | None,
                     limits: WireLimits = WireLimits()) -> None:
    """Raise InvalidMessage unless every value of ``traj`` is one the learner can train on or count.

    Args:
        traj: a decoded trajectory (types already checked by the codec).
        vocab_size: the policy's vocabulary; token ids must be in [0, vocab_size) (None: only >= 0).
        version: the learner's current policy version; no token may carry a newer one (None: not checked).
        limits: size limits.
    Raises:
        InvalidMessage: the first problem found (reason + detail).
    """
    for name in ("trajectory_id", "actor_id", "task_id", "group_id"):
        _check_id(name, getattr(traj, name), limits)
    _check_id("desktop", traj.desktop, limits, empty_ok=True)
    _check_id("session", traj.session, limits, empty_ok=True)
    try:
        Outcome(traj.outcome)
    except ValueError:
        _fail("outcome", f"unknown outcome {traj.outcome[:40]!r}")
    if traj.rollout_index < 0 or traj.rollout_index > 1 << 20:
        _fail("fields", f"rollout_index {traj.rollout_index} out of range")
    if not math.isfinite(traj.score) or not 0.0 <= traj.score <= 1.0:
        _fail("score", f"score {traj.score!r} is not a finite number in [0, 1]")
    if traj.assigned_version < 0 or (version is not None and traj.assigned_version > version):
        _fail("versions", f"assigned_version {traj.assigned_version} (learner at {version})")
    if len(traj.error) > limits.max_text_chars or len(traj.grammar) > limits.max_text_chars:
        _fail("size", "error or grammar too long")
    if len(traj.timings) > limits.max_timings:
        _fail("size", f"{len(traj.timings)} timings (most {limits.max_timings})")
    for key, value in traj.timings.items():
        if len(key) > limits.max_id_chars or not math.isfinite(value) or not 0.0 <= value <= 1e7:
            _fail("timings", f"timings[{key[:40]!r}] = {value!r} is not a finite number of seconds >= 0")
    if len(traj.steps) > limits.max_steps:
        _fail("size", f"{len(traj.steps)} steps (most {limits.max_steps})")
    if not traj.steps and traj.outcome == Outcome.SUCCESS:  # an episode evaluates only after the policy acted
        _fail("lengths", "a SUCCESS trajectory with no step (nothing the policy did to learn from)")
    if len(traj.screenshots) > limits.max_screenshots:
        _fail("size", f"{len(traj.screenshots)} screenshots (most {limits.max_screenshots})")
    if not -1 <= traj.final_screenshot < len(traj.screenshots):
        _fail("image_indices", f"final_screenshot {traj.final_screenshot} but {len(traj.screenshots)} screenshots")
    values_ok = _values_ok(traj.steps, vocab_size, version)  # then the per-step value checks are skipped
    for i, step in enumerate(traj.steps):
        where = f"steps[{i}]"
        prompt_ids, output_ids, logprobs, versions = (
            (step.prompt_ids, step.output_ids, step.logprobs, step.versions) if values_ok else _arrays(where, step))
        n = len(output_ids)
        if n == 0 and traj.outcome.trainable:
            _fail("lengths", f"{where}.output_ids is empty")
        if len(logprobs) != n or len(versions) != n:
            _fail("lengths", f"{where}: {n} output ids, {len(logprobs)} log-probs, {len(versions)} "
                             "versions (must be equal)")
        if len(prompt_ids) > limits.max_prompt_tokens or n > limits.max_output_tokens:
            _fail("size", f"{where}: {len(prompt_ids)} prompt / {n} output tokens")
        if len(step.text) > limits.max_text_chars or len(step.action) > limits.max_text_chars:
            _fail("size", f"{where}: text or action too long")
        if not values_ok:
            _check_token_ids(f"{where}.prompt_ids", prompt_ids, vocab_size)
            _check_token_ids(f"{where}.output_ids", output_ids, vocab_size)
            good = np.isfinite(logprobs) & (logprobs <= 0.0)
            if not good.all():
                bad = float(logprobs[np.argmin(good)])
                _fail("logprobs", f"{where}.logprobs holds {bad!r} (log-probs are finite and <= 0)")
            if n:
                low, high = _span(versions)
                if low < 0 or (version is not None and high > version):
                    _fail("versions", f"{where}.versions span {low}..{high}; the learner has published up to "
                                      f"{version}")
        if step.image_indices and (min(step.image_indices) < 0
                                   or max(step.image_indices) >= len(traj.screenshots)):
            _fail("image_indices", f"{where}.image_indices {min(step.image_indices)}..{max(step.image_indices)} "
                                   f"but {len(traj.screenshots)} screenshots")
        if not math.isfinite(step.acted_at) or not 0.0 <= step.acted_at <= 1e11:
            _fail("timings", f"{where}.acted_at = {step.acted_at!r} is not a finite Unix time >= 0")
        for name in ("generate_s", "act_s", "observe_s", "settle_s"):
            value = getattr(step, name)
            if not math.isfinite(value) or not 0.0 <= value <= 1e7:
                _fail("timings", f"{where}.{name} = {value!r} is not a finite number of seconds >= 0")


def check_work_request(request: WorkRequest, limits: WireLimits = WireLimits()) -> None:
    """Raise InvalidMessage for an empty or oversized request id or actor id, or an oversized session."""
    _check_id("request_id", request.request_id, limits)
    _check_id("actor_id", request.actor_id, limits)
    _check_id("session", request.session, limits, empty_ok=True)


def check_hello(hello: Hello, limits: WireLimits = WireLimits()) -> None:
    """Raise InvalidMessage for an empty or oversized actor id, an oversized session, slots outside [0, max_slots]
    or too many held trajectory ids."""
    _check_id("actor_id", hello.actor_id, limits)
    _check_id("session", hello.session, limits, empty_ok=True)
    if not 0 <= hello.slots <= limits.max_slots:
        _fail("fields", f"slots {hello.slots} outside [0, {limits.max_slots}]")
    if len(hello.held_trajectories) > limits.max_held:
        _fail("size", f"{len(hello.held_trajectories)} held trajectory ids (most {limits.max_held})")


MAX_TEMPERATURE = 100.0
"""Highest sampling temperature an Assignment may ask for (any useful one is below 2)."""


def check_assignment(assignment: Assignment, limits: WireLimits = WireLimits()) -> None:
    """Raise InvalidMessage (reason ``fields`` or ``sampling``) for an empty or oversized request or group id, a
    negative rollout index or policy version, a step budget outside [0, ``limits.max_steps``] (0 = the actor's
    own), or a temperature that is not a finite number <= MAX_TEMPERATURE (a negative one = the actor's own)."""
    _check_id("request_id", assignment.request_id, limits)
    _check_id("group_id", assignment.group_id, limits)
    if assignment.rollout_index < 0 or assignment.policy_version < 0:
        _fail("fields", f"rollout_index {assignment.rollout_index} / policy_version {assignment.policy_version} "
                        "must be >= 0")
    if not 0 <= assignment.max_steps <= limits.max_steps:
        _fail("sampling", f"max_steps {assignment.max_steps} outside [0, {limits.max_steps}]")
    if not math.isfinite(assignment.temperature) or assignment.temperature > MAX_TEMPERATURE:
        _fail("sampling", f"temperature {assignment.temperature!r} is not a finite number <= {MAX_TEMPERATURE:g}")
