"""Typed schema of every message between actors and the learner.

Owns: the message dataclasses, the trajectory record and the Outcome enum.
Invariants: every message has a ``TYPE`` (its wire ``type``); fields hold only msgpack-native values
(int, float, str, bytes, bool, lists and dicts of them, nested message dataclasses), a string enum (Outcome,
which travels as its value) or a 1-D NumPy array of a declared dtype (:data:`TokenArray`, :data:`LogprobArray`);
screenshots are raw bytes. A step's token ids, behaviour log-probs and token versions are packed arrays from the
actor that records them, over the wire (see codec), to the trainer's tensors: no list of Python ints on the way.
Bumping SCHEMA_VERSION is required for any change a peer of the previous version would misread.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Annotated, Any, ClassVar

import numpy as np

from arpo_async.text import encodable

SCHEMA_VERSION = 2
"""2: a list of dataclasses (a trajectory's steps) travels as a table of columns (arpo_async.codec)."""

INT32 = np.dtype("<i4")
FLOAT64 = np.dtype("<f8")
TokenArray = Annotated[np.ndarray, INT32]
"""A 1-D array of token ids or policy versions: little-endian int32 (the wire's dtype). :func:`int_array` makes one."""
LogprobArray = Annotated[np.ndarray, FLOAT64]
"""A 1-D array of log-probs (nats): little-endian float64 (the wire's dtype). :func:`float_array` makes one."""


def int_array(values: Any) -> np.ndarray:
    """``values`` (a sequence of integers or an integer array) as a 1-D int32 array; no copy when it is one.

    Integers outside int32 keep a wider integer dtype (int64 / uint64), so that validation can name the bad value
    (no id of a real vocabulary is that large) and the codec refuses to encode it; nothing is truncated.

    Raises:
        TypeError: not a 1-D sequence of integers (floats, bools, nested lists, integers past 64 bits).
    """
    if type(values) is np.ndarray and (values.dtype is INT32 or values.dtype == INT32) and values.ndim == 1:
        return values  # already one (a decoded step's arrays): the common case, kept cheap ("is": ~10x cheaper)
    arr = _one_dim(values, INT32, "iu", "integers")
    if arr.dtype.itemsize < 4 or arr.dtype == INT32 or (arr.min() >= -(1 << 31) and arr.max() < 1 << 31):
        return arr.astype(INT32, copy=False)
    return arr


def float_array(values: Any) -> np.ndarray:
    """``values`` (a sequence of numbers or a numeric array) as a 1-D float64 array; no copy when it is one.

    Raises:
        TypeError: not a 1-D sequence of real numbers.
    """
    if type(values) is np.ndarray and (values.dtype is FLOAT64 or values.dtype == FLOAT64) and values.ndim == 1:
        return values
    return _one_dim(values, FLOAT64, "iuf", "numbers").astype(FLOAT64, copy=False)


def _one_dim(values: Any, dtype: np.dtype, kinds: str, what: str) -> np.ndarray:
    """``values`` as a 1-D NumPy array whose dtype kind is in ``kinds`` (an empty one of ``dtype``)."""
    if type(values) is np.ndarray and values.dtype == dtype and values.ndim == 1:
        return values
    arr = np.asarray(values)
    if arr.size == 0 and arr.ndim == 1:
        return np.zeros(0, dtype)
    if arr.ndim != 1 or arr.dtype.kind not in kinds:
        raise TypeError(f"expected a 1-D sequence of {what}, got a {arr.ndim}-D array of {arr.dtype}")
    return arr


class Outcome(enum.StrEnum):
    """How an episode ended. ENV_ERROR, TASK_ERROR and ABORTED are never the agent's fault and never enter training.

    A StrEnum: a member equals, formats and serialises (JSON, msgpack) as its value, the name on the wire."""

    SUCCESS = "SUCCESS"
    """The evaluator scored the final desktop state as solved."""
    FAILURE = "FAILURE"
    """The agent finished (or gave up) and the evaluator scored the state as unsolved."""
    TRUNCATED = "TRUNCATED"
    """The step budget ran out before the agent finished; the state was still evaluated."""
    ENV_ERROR = "ENV_ERROR"
    """The desktop died or misbehaved (container gone, controller timeout, setup failed)."""
    TASK_ERROR = "TASK_ERROR"
    """The task itself is at fault: it does not load, or a setup step, getter or metric raised an error nobody
    expected (a parameter of the wrong type, an unknown option). Counted per task; the learner sets aside a task
    that fails this way ``learner.task_error_limit`` times in a row."""
    POLICY_ERROR = "POLICY_ERROR"
    """The model's reply did not parse as a UI-TARS action (trained on, with the format penalty)."""
    ABORTED = "ABORTED"
    """The inference server stayed unreachable, or the actor was shut down mid-episode."""

    @property
    def trainable(self) -> bool:
        return self not in (Outcome.ENV_ERROR, Outcome.TASK_ERROR, Outcome.ABORTED)


@dataclass
class Step:
    """One policy step of an episode: the exact tokens sampled, with their behaviour log-probs.

    Shapes: ``prompt_ids`` [P] int32, ``output_ids`` [T] int32, ``logprobs`` [T] float64 (nats), ``versions`` [T]
    int32 (the policy version that produced each output token); ``image_indices`` index the trajectory's
    ``screenshots`` in the order their images appear in ``prompt_ids``. Lists given to the constructor become
    arrays (:func:`int_array`, :func:`float_array`; TypeError for values that are not integers / numbers); arrays of
    the right dtype are kept as they are (a decoded step's are read-only views of the received message). Two steps
    are equal when every field holds equal values.
    """

    prompt_ids: TokenArray
    image_indices: list[int]
    output_ids: TokenArray
    logprobs: LogprobArray
    versions: TokenArray
    text: str
    action: str
    """The parsed action as a compact string (e.g. "click(640,360)"), or "" when the reply did not parse."""
    generate_s: float = 0.0
    act_s: float = 0.0
    observe_s: float = 0.0
    settle_s: float = 0.0
    """Seconds the screen took to settle after this step's action (actors.settle: the wait is the next step's
    ``observe_s``, or before the evaluator after the last step); 0.0 when no action was settled after it."""
    settle_timed_out: bool = False
    """True when that wait ended at ``actors.settle_timeout_s`` with the screen still changing."""
    acted_at: float = 0.0
    """Wall-clock time (Unix seconds) the step's action was taken, or its end decided (finished, FAIL, a reply that
    did not parse); 0.0 when not recorded. ``arpo eval`` prints it as OSWorld's ``action_timestamp``."""

    def __post_init__(self) -> None:
        self.prompt_ids = int_array(self.prompt_ids)
        self.output_ids = int_array(self.output_ids)
        self.logprobs = float_array(self.logprobs)
        self.versions = int_array(self.versions)
        self.text, self.action = encodable(self.text), encodable(self.action)

    def __eq__(self, other: object) -> bool:
        if type(other) is not Step:
            return NotImplemented
        return all(_equal(getattr(self, f.name), getattr(other, f.name)) for f in fields(self))


def _equal(a: Any, b: Any) -> bool:
    """``a == b`` as one bool, arrays compared element by element (shapes and values; not the dtype)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    return a == b


@dataclass
class Trajectory:
    """One episode of one rollout, as the actor sends it to the learner."""

    TYPE: ClassVar[str] = "trajectory"
    trajectory_id: str
    actor_id: str
    task_id: str
    group_id: str
    rollout_index: int
    outcome: Outcome
    """How the episode ended; the wire carries its value (a string naming the member). A string naming a member is
    accepted when the trajectory is built and turned into the member."""
    score: float
    """Evaluator score in [0, 1] from the desktop's real state (0 when not evaluated)."""
    format_ok: bool
    """False when a reply did not parse (ARPO's format reward is then -1)."""
    steps: list[Step]
    screenshots: list[bytes]
    """Encoded images (PNG/JPEG), indexed by ``Step.image_indices``. On a decoded trajectory each is a read-only
    memoryview of the ZeroMQ frame it arrived in (bytes-like, no copy; see arpo_async.codec)."""
    error: str = ""
    """For ENV_ERROR / ABORTED / POLICY_ERROR: the error's type and message."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds per stage: reset_s, setup_s, episode_s, evaluate_s."""
    assigned_version: int = 0
    """Policy version the learner announced when it handed out this rollout."""
    desktop: str = ""
    """Name of the desktop container the episode ran in."""
    grammar: str = ""
    """The regex the replies were constrained by (SGLang's ``sampling_params.regex``; "" = unconstrained). The
    learner finds the tokens this grammar forced from it and leaves them out of the loss."""
    session: str = ""
    """The session of the WorkRequest that got this rollout (:attr:`Hello.session`): the learner takes a
    trajectory for its slot only with the session the slot was handed out under, so a peer that copies another's
    routing id cannot submit for its rollouts."""
    final_screenshot: int = -1
    """Index in ``screenshots`` of the settled screen after the last action, the one the evaluator read; -1 when
    not kept (training rollouts keep none: ``actors.episode.EpisodeRunner.keep_final_screenshot``)."""

    def __post_init__(self) -> None:
        self.outcome = Outcome(self.outcome)  # ValueError for a string that names no Outcome
        self.error, self.desktop, self.grammar = encodable(self.error), encodable(self.desktop), encodable(self.grammar)

    def oldest_version(self) -> int | None:
        """The oldest policy version among the generated tokens of all steps (min of every ``step.versions``),
        or None when no step generated a token."""
        lows = [int(step.versions.min()) for step in self.steps if len(step.versions)]
        return min(lows) if lows else None


@dataclass
class Hello:
    """Actor -> learner on connect and after the learner restarts: who I am and what I still hold."""

    TYPE: ClassVar[str] = "hello"
    actor_id: str
    slots: int
    held_trajectories: list[str] = field(default_factory=list)
    run_id: str = ""
    """The run this actor belongs to (config ``resolved_run_id``); a learner of another run refuses it. Empty:
    not checked (an embedding agent, an older actor)."""
    session: str = ""
    """A secret the actor process drew for itself (at least 128 random bits; ``secrets.token_urlsafe(16)``). Its
    WorkRequests and Trajectories name it, and the rollouts it gets belong to it, not to the routing id, which any
    peer can copy. The actor draws it rather than the learner, because an answer to a Hello goes to whoever holds
    the routing id's route at that moment (ROUTER_HANDOVER), which may be a peer that copied it; the learner never
    sends it back. A Hello without one is refused (reason ``session``)."""


@dataclass
class Heartbeat:
    """Actor -> learner every few seconds; carries queue depths for observability."""

    TYPE: ClassVar[str] = "heartbeat"
    actor_id: str
    running: int
    waiting: int
    unacked: int
    outbox: int = 0
    """Messages queued in the actor process's outbox (for the learner's socket) when the heartbeat was sent."""


@dataclass
class WorkRequest:
    """Actor -> learner: one EnvActor is idle and asks for a rollout."""

    TYPE: ClassVar[str] = "work_request"
    request_id: str
    actor_id: str
    run_id: str = ""
    """As :attr:`Hello.run_id`: a learner of another run hands this request nothing."""
    session: str = ""
    """The session of this actor's Hello (:attr:`Hello.session`); a request that names no session this peer
    opened is refused (reason ``session``)."""


@dataclass
class Assignment:
    """Learner -> actor: one rollout of one group, or one evaluation episode. ``task`` is the task's OSWorld JSON
    dict.

    The last three fields were added without a schema bump: a peer that predates them decodes an Assignment without
    them to their defaults (a training rollout), and one that meets them refuses the message (an unknown field,
    WireError) instead of misreading it. :func:`arpo_async.validation.check_assignment` checks their values.
    """

    TYPE: ClassVar[str] = "assignment"
    request_id: str
    task: dict
    group_id: str
    rollout_index: int
    policy_version: int
    evaluation: bool = False
    """True: a held-out evaluation episode (learner.rollouts.evaluation_rounds): its trajectory is acked like any other
    and never trained on. The actor runs it the same way, with the overrides below."""
    max_steps: int = 0
    """Step budget of this episode; 0 = the actor's own (actors.max_steps)."""
    temperature: float = -1.0
    """Sampling temperature of this episode (0 = greedy); negative = the actor's own (actors.temperature)."""


@dataclass
class Ack:
    """Learner -> actor: the learner holds these trajectories; the actor may forget them."""

    TYPE: ClassVar[str] = "ack"
    trajectory_ids: list[str]


@dataclass
class LearnerStatus:
    """Learner -> actor: reply to hello and heartbeat, and the version announcement after each publish.

    ``learner_id`` changes when the learner restarts; actors then say hello again and resend what they hold.
    """

    TYPE: ClassVar[str] = "learner_status"
    learner_id: str
    policy_version: int


@dataclass
class Shutdown:
    """Learner -> actor: the run is over; finish nothing new, remove desktops and exit."""

    TYPE: ClassVar[str] = "shutdown"
    reason: str
    refused: bool = False
    """True: the learner refuses this actor (it belongs to another run); the actor exits non-zero with ``reason``."""


@dataclass
class Reject:
    """Learner -> actor: a message could not be used (the reason says why); nothing else happens."""

    TYPE: ClassVar[str] = "reject"
    reason: str


MESSAGE_TYPES: dict[str, type] = {
    cls.TYPE: cls
    for cls in (Trajectory, Hello, Heartbeat, WorkRequest, Assignment, Ack, LearnerStatus, Shutdown, Reject)
}
