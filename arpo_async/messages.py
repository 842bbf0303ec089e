"""Typed schema of every message between actors and the learner.

Owns: the message dataclasses, the trajectory record and the Outcome enum.
Invariants: every message has a ``TYPE`` (its wire ``type``); fields hold only msgpack-native values
(int, float, str, bytes, bool, lists and dicts of them, nested message dataclasses) or a string enum (Outcome,
which travels as its value); screenshots are raw
bytes; token ids and log-probs are plain lists on the message and packed arrays on the wire (see codec).
Bumping SCHEMA_VERSION is required for any change a peer of the previous version would misread.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import ClassVar

SCHEMA_VERSION = 1


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

    Shapes: ``len(output_ids) == len(logprobs) == len(versions)``; ``image_indices`` index the
    trajectory's ``screenshots`` in the order their images appear in ``prompt_ids``.
    """

    prompt_ids: list[int]
    image_indices: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    text: str
    action: str
    """The parsed action as a compact string (e.g. "click(640,360)"), or "" when the reply did not parse."""
    generate_s: float = 0.0
    act_s: float = 0.0
    observe_s: float = 0.0


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

    def __post_init__(self) -> None:
        self.outcome = Outcome(self.outcome)  # ValueError for a string that names no Outcome


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


@dataclass
class Assignment:
    """Learner -> actor: one rollout of one group. ``task`` is the task's OSWorld JSON dict."""

    TYPE: ClassVar[str] = "assignment"
    request_id: str
    task: dict
    group_id: str
    rollout_index: int
    policy_version: int


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
