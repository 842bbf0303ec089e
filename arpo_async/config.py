"""Run configuration: frozen dataclasses, loaded from one TOML file with CLI overrides.

Owns: the one description of a run that every process (learner, actors, arpo-serve, `arpo run`) reads.
Invariants: configs are immutable once built and validated in ``__post_init__``; derived values are
properties; a TOML key or override that names no field is an error, never silently ignored.

TOML layout (every section and key optional)::

    run_dir = "runs/demo"
    [transport]  endpoint = "tcp://127.0.0.1:5555"
    [learner]    group_size = 4   groups_per_step = 2   steps = 3   lr = 5e-4 ...
    [actors]     actors = 8   inference_urls = ["http://127.0.0.1:30000"] ...
    [serve]      port = 30000 ...

CLI overrides use dotted keys: ``--set learner.lr=1e-3 --set actors.max_steps=5``.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the key and the reason."""


@dataclass(frozen=True)
class TransportConfig:
    """ZeroMQ link between actors (DEALER) and the learner (ROUTER)."""

    endpoint: str = "tcp://127.0.0.1:5555"
    """Learner's ROUTER endpoint; the learner binds it, actors connect to it."""
    max_message_mb: int = 256
    """Largest message a decoder accepts (MiB); larger frames are rejected and counted, never decoded."""
    high_water_mark: int = 256
    """ZeroMQ send/receive high-water mark (messages) on every socket."""
    heartbeat_s: float = 2.0
    """Actors send a heartbeat this often; the learner's reply tells them if it restarted."""
    resend_after_s: float = 30.0
    """An unacknowledged trajectory or unanswered work request is sent again after this many seconds."""

    def __post_init__(self) -> None:
        _require(self.endpoint.startswith(("tcp://", "ipc://", "inproc://")), "transport.endpoint",
                 f"must be a ZeroMQ endpoint (tcp://, ipc://), got {self.endpoint!r}")
        _require(self.max_message_mb > 0, "transport.max_message_mb", "must be > 0")
        _require(self.high_water_mark > 0, "transport.high_water_mark", "must be > 0")
        _require(self.heartbeat_s > 0, "transport.heartbeat_s", "must be > 0")

    @property
    def max_message_bytes(self) -> int:
        return self.max_message_mb * 1024 * 1024


@dataclass(frozen=True)
class LearnerConfig:
    """GRPO learner: groups, batches, optimiser, replay, publishing."""

    tasks: str = ""
    """Folder or file of OSWorld-format task JSON; empty = the built-in suite."""
    task_ids: tuple[str, ...] = ()
    """Restrict training to these task ids (or id prefixes, e.g. "grid4-"); empty = all tasks."""
    group_size: int = 4
    """G: rollouts of the same task per group (ARPO: 8)."""
    groups_per_step: int = 2
    """Groups with non-zero reward variance per optimizer step; batch = groups_per_step x group_size trajectories."""
    steps: int = 3
    """Stop after this many optimizer steps (0 = run until interrupted)."""
    max_staleness: int = 1
    """eta in AReaL's admission rule: work is handed out only while accepted + running < (eta + version + 1) x B.
    Larger = more throughput, more policy lag; 0 = synchronous."""
    lr: float = 5e-4
    """AdamW learning rate (ARPO uses 1e-6 for a 7B model; the tiny embedded model needs a larger one)."""
    weight_decay: float = 0.01
    """AdamW weight decay (ARPO: 0.01)."""
    grad_clip: float = 1.0
    """Gradient-norm clip (ARPO: 1.0)."""
    eps_low: float = 0.2
    """PPO clip lower bound (ARPO: 0.2)."""
    eps_high: float = 0.3
    """PPO clip-higher upper bound (ARPO: 0.3)."""
    dual_clip: float = 3.0
    """Dual-clip constant for negative advantages (ARPO: 3.0)."""
    replay: bool = True
    """ARPO's success replay: inject a stored success into all-failed groups."""
    replay_capacity: int = 8
    """Successes kept per task (ARPO: 8, oldest evicted first)."""
    format_reward_weight: float = 0.5
    """reward = score + weight x format reward (format reward -1 when a reply does not parse; ARPO: 0.5)."""
    rollout_retries: int = 2
    """A rollout that ends in ENV_ERROR or ABORTED is handed out again this many times before its group goes on without it."""
    torch_threads: int = 1
    """Threads for torch on the learner (the desktops need the other cores)."""
    keep_weights: int = 2
    """Published weight folders kept on disk (older ones are deleted)."""
    seed: int = 0
    """Seed for task order and replay draws."""

    def __post_init__(self) -> None:
        _require(self.group_size >= 2, "learner.group_size", "GRPO needs at least 2 rollouts per group")
        _require(self.groups_per_step >= 1, "learner.groups_per_step", "must be >= 1")
        _require(self.steps >= 0, "learner.steps", "must be >= 0")
        _require(self.max_staleness >= 0, "learner.max_staleness", "must be >= 0")
        _require(self.lr > 0, "learner.lr", "must be > 0")
        _require(0 < self.eps_low < 1 and self.eps_high > 0, "learner.eps_low/eps_high", "need 0 < eps_low < 1, eps_high > 0")
        _require(self.replay_capacity >= 1, "learner.replay_capacity", "must be >= 1")
        _require(self.keep_weights >= 1, "learner.keep_weights", "must be >= 1")

    @property
    def batch_trajectories(self) -> int:
        """B: trajectories per optimizer step."""
        return self.group_size * self.groups_per_step


@dataclass(frozen=True)
class ActorConfig:
    """Environment actors: desktops, episodes, the policy endpoint."""

    actors: int = 8
    """EnvActor coroutines (one desktop each) in this process."""
    inference_urls: tuple[str, ...] = ("http://127.0.0.1:30000",)
    """SGLang or arpo-serve base URLs; one episode sticks to one server."""
    max_steps: int = 5
    """Step budget per episode (ARPO: 15)."""
    history_images: int = 2
    """Screenshots kept in the prompt (the last k; ARPO keeps all 15)."""
    max_new_tokens: int = 64
    """Generated tokens per step."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts (ARPO: 1.0)."""
    top_p: float = 1.0
    """Nucleus sampling for rollouts."""
    constrained: bool = True
    """Ask the server for the UI-TARS action grammar (regex) so every reply parses."""
    coordinate_mode: str = "absolute"
    """How the model writes coordinates: "absolute" (UI-TARS-1.5, smart-resized pixels) or "relative1000"."""
    screen_width: int = 1280
    """Desktop screen width (pixels)."""
    screen_height: int = 720
    """Desktop screen height (pixels)."""
    desktop_memory_mb: int = 512
    """Memory limit per desktop container."""
    desktop_pids: int = 256
    """Process limit per desktop container."""
    image: str = ""
    """Desktop image; empty = arpo-desktop:<recipe version>, built by `arpo desktop build`."""
    policy_attempts: int = 6
    """Tries per /generate before the episode ends as ABORTED (exponential backoff between tries)."""
    policy_max_wait_s: float = 30.0
    """Longest backoff between /generate tries (seconds)."""
    setup_timeout_s: float = 120.0
    """Deadline for a task's setup steps and for its evaluation (seconds); missing it is an ENV_ERROR."""
    step_timeout_s: float = 120.0
    """Deadline for one desktop call (seconds); a desktop that misses it is treated as dead (ENV_ERROR)."""

    def __post_init__(self) -> None:
        _require(self.actors >= 1, "actors.actors", "must be >= 1")
        _require(len(self.inference_urls) >= 1, "actors.inference_urls", "needs at least one URL")
        _require(self.max_steps >= 1, "actors.max_steps", "must be >= 1")
        _require(self.history_images >= 1, "actors.history_images", "must be >= 1")
        _require(self.coordinate_mode in ("absolute", "relative1000"), "actors.coordinate_mode",
                 "must be 'absolute' or 'relative1000'")
        _require(self.temperature >= 0, "actors.temperature", "must be >= 0")

    @property
    def screen_size(self) -> tuple[int, int]:
        return (self.screen_width, self.screen_height)

    @property
    def sampling_params(self) -> dict[str, Any]:
        """SGLang sampling_params for rollouts (the regex is added by the actor when `constrained`)."""
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p}


@dataclass(frozen=True)
class ServeConfig:
    """The embedded inference server started by `arpo run` (arpo-serve on the CPU)."""

    host: str = "127.0.0.1"
    """Listen address."""
    port: int = 30000
    """Listen port."""
    max_batch: int = 16
    """Largest batch of concurrent /generate requests decoded together."""


@dataclass(frozen=True)
class RunConfig:
    """Everything one run needs. `model` is the policy checkpoint (HF folder) the run starts from."""

    run_dir: str = "runs/default"
    """Run folder: metrics.jsonl, weights/, logs/, checkpoints."""
    model: str = ""
    """Policy checkpoint folder (HF layout); empty = <run_dir>/../tiny-model created by `arpo init-model`."""
    run_id: str = ""
    """Label on every container of this run (for cleanup); empty = derived from run_dir."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    actors: ActorConfig = field(default_factory=ActorConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir)

    @property
    def model_path(self) -> Path:
        return Path(self.model) if self.model else self.run_path.parent / "tiny-model"

    @property
    def resolved_run_id(self) -> str:
        """Docker-label-safe id for this run's containers."""
        if self.run_id:
            return self.run_id
        name = self.run_path.resolve().name or "run"
        return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)


def _require(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {why}")


def load_config(path: str | Path | None = None, overrides: typing.Iterable[str] = ()) -> RunConfig:
    """Build a RunConfig from an optional TOML file plus ``section.key=value`` overrides.

    Raises:
        ConfigError: unreadable TOML, an unknown section or key, a value of the wrong type, or a value
            that fails validation. The message names the key.
    """
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read config {path}: {e}") from e
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        _set_dotted(data, key.strip(), _parse_scalar(raw.strip()))
    return _build(RunConfig, data, "")


def _parse_scalar(raw: str) -> Any:
    """Parse an override value as TOML (numbers, booleans, lists, quoted strings), else keep the raw string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key!r}: {part!r} is not a section")
    node[parts[-1]] = value


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ConfigError(f"unknown config key(s) {sorted(prefix + k for k in unknown)}; known: {sorted(names)}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, prefix + name)
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{prefix or 'config'}: {e}") from e


def _coerce(hint: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a table (section)")
        return _build(hint, value, key + ".")
    origin = typing.get_origin(hint)
    if origin is tuple:
        items = value if isinstance(value, (list, tuple)) else [value]
        (inner, *_rest) = typing.get_args(hint)
        return tuple(_coerce(inner, v, key) for v in items)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and not (isinstance(value, hint) and not (hint is int and isinstance(value, bool))):
        raise ConfigError(f"{key} must be {hint.__name__}, got {value!r}")
    return value


def to_dict(config: Any) -> dict[str, Any]:
    """The config as plain TOML-compatible data (for the run folder and for child processes)."""
    return dataclasses.asdict(config)


def dump_toml(config: RunConfig) -> str:
    """Serialise a RunConfig as TOML that `load_config` reads back to an equal config."""
    lines: list[str] = []
    nested: list[tuple[str, dict[str, Any]]] = []
    for key, value in to_dict(config).items():
        if isinstance(value, dict):
            nested.append((key, value))
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    for section, values in nested:
        lines.append(f"\n[{section}]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in values.items())
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise ConfigError(f"cannot write {value!r} as TOML")
