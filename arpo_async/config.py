"""Run configuration: frozen dataclasses, loaded from one TOML file with CLI overrides.

Owns: the one description of a run that every process (learner, actors, arpo-serve, `arpo run`) reads; each key
is declared once, with its type, bounds, default and docstring.
Invariants: configs are immutable once built and validated when built, by pydantic from each field's type (strict:
a bool is no int, a str no number; an int is taken for a float, a list or a single value for a tuple) plus a
model validator for rules across fields; derived values are properties; a TOML key or override that names no
field is an error, never silently ignored. Every error, from `load_config` or from building a config directly
(``LearnerConfig(lr=0)``, ``dataclasses.replace``), is a :class:`ConfigError` naming the dotted key.

TOML layout (every section and key optional)::

    run_dir = "runs/demo"
    [transport]  endpoint = "tcp://127.0.0.1:5555"
    [learner]    group_size = 4   groups_per_step = 2   steps = 3   lr = 5e-4 ...
    [actors]     actors = 8   inference_urls = ["http://127.0.0.1:30000"] ...
    [serve]      port = 30000 ...
    [eval]       tasks = "grid4-test"   every_steps = 20   repeats = 2 ...
    [cluster]    servers = 1   learner_ranks = 2 ...   (read by `arpo launch` only)

CLI overrides use dotted keys: ``--set learner.lr=1e-3 --set actors.max_steps=5``; a value is read by its key's
type (a str key takes the text as written, ``--set run_id=2024``; any other a TOML value). An unknown key is
refused with the key it probably meant (``lr`` -> "did you mean learner.lr?").
Every field needs an attribute docstring (the string right below it): `arpo config show` prints it as the key's
documentation (arpo_async.config_doc reads them from this source) and tests/unit/test_config_show.py fails
without one.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import tomllib
import typing
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic.dataclasses
import tomli_w
from pydantic_core import ErrorDetails
from pydantic import (AfterValidator, BeforeValidator, ConfigDict, Field, NonNegativeFloat, NonNegativeInt,
                      PositiveFloat, PositiveInt, ValidationError, model_validator)

from arpo_async.success import DEFAULT_SUCCESS_THRESHOLD


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the key and the reason."""


def _as_tuple(value: Any) -> Any:
    """A TOML list becomes a tuple and a single value a 1-tuple (``--set actors.inference_urls=http://x``)."""
    return tuple(value) if isinstance(value, list) else value if isinstance(value, tuple) else (value,)


def _zmq_endpoint(value: str) -> str:
    if not value.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"must be a ZeroMQ endpoint (tcp://, ipc://), got {value!r}")
    return value


Strings = Annotated[tuple[str, ...], BeforeValidator(_as_tuple)]
"""A list of strings in TOML, a tuple here."""
Fraction = Annotated[float, Field(ge=0, le=1)]
"""A probability or fraction, in [0, 1]."""
Correction = Literal["arpo", "decoupled", "tis", "behaviour"]
"""learner.grpo.CORRECTION_MODES. This module imports nothing of learner/ or arpo_serve/, so a choice their code
also lists is spelt out here; tests/unit/test_config.py checks each such Literal against the code's tuple."""

_TYPE_NAMES = {"int_type": "int", "float_type": "float", "bool_type": "bool", "string_type": "str",
               "tuple_type": "a list"}
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


@typing.dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, Field))
def _config(section: str) -> typing.Callable[[type], type]:
    """Make ``cls`` a frozen pydantic dataclass validated strictly when built, whose validation errors are raised as
    one :class:`ConfigError` naming each key as ``section.key`` (``section`` "" for RunConfig's top-level keys).
    It stays a dataclass: `dataclasses.fields`, `replace` (which validates again) and `asdict` work on it."""
    def make(cls: type) -> type:
        cls = pydantic.dataclasses.dataclass(cls, frozen=True, config=ConfigDict(extra="forbid", strict=True))
        validate = cls.__init__

        @functools.wraps(validate)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            try:
                validate(self, *args, **kwargs)
            except ValidationError as error:
                raise _config_error(error, section, cls) from error

        cls.__init__ = __init__
        return cls
    return make


@_config("transport")
class TransportConfig:
    """ZeroMQ link between actors (DEALER) and the learner (ROUTER)."""

    endpoint: Annotated[str, AfterValidator(_zmq_endpoint)] = "tcp://127.0.0.1:5555"
    """Learner's ROUTER endpoint; the learner binds it, actors connect to it."""
    max_message_mb: PositiveInt = 256
    """Largest message a decoder accepts (MiB); larger frames are rejected and counted, never decoded."""
    high_water_mark: PositiveInt = 256
    """ZeroMQ send/receive high-water mark (messages) on every socket."""
    heartbeat_s: PositiveFloat = 2.0
    """Actors send a heartbeat this often; the learner's reply tells them if it restarted."""
    resend_after_s: float = 30.0
    """An unacknowledged trajectory or unanswered work request is sent again after this many seconds."""
    curve_secret_key_file: str = ""
    """ZeroMQ CURVE (authentication + encryption): this process's secret certificate, from `arpo keys` (the
    learner's own, or this actor host's). Empty = plain TCP (then keep the learner's port on a private network)."""
    curve_server_key_file: str = ""
    """Actors with CURVE: the learner's public certificate (``<name>.key`` from `arpo keys`)."""
    curve_authorized_dir: str = ""
    """The learner with CURVE: a folder of the public certificates (``*.key``) of the actor hosts allowed to
    connect; any other peer is refused during the handshake."""
    peer_timeout_s: float = 30.0
    """The learner forgets an actor process not heard from for this long (no heartbeat): its waiting work requests
    are dropped and its running rollouts handed out again at once. Keep it several heartbeats long."""
    max_slots_per_peer: PositiveInt = 1024
    """The most work requests one actor process may have waiting or running at once, whatever slots its Hello
    announces; the learner hands out rollouts round-robin over the processes that wait, so one process cannot
    starve another (learner.peers)."""

    @model_validator(mode="after")
    def _peer_timeout_spans_heartbeats(self) -> TransportConfig:
        if not self.peer_timeout_s > 2 * self.heartbeat_s:
            raise ValueError("peer_timeout_s: must be more than 2 heartbeats (transport.heartbeat_s)")
        return self

    @property
    def max_message_bytes(self) -> int:
        return self.max_message_mb * 1024 * 1024


@_config("learner")
class LearnerConfig:
    """GRPO learner: groups, batches, optimiser, replay, publishing."""

    tasks: str = ""
    """Folder or file of OSWorld-format task JSON; empty = the built-in suite."""
    osworld_files: str = ""
    """Local mirror of OSWorld's task files (its file cache's layout, <domain>/<task id>/<file name>, or files
    named by their Google Drive id), looked up before the network by `download` setup steps and `cloud_file`
    getters, so a user who has them runs OSWorld's tasks offline; empty = none (actors.osworld.downloads)."""
    task_ids: Strings = ()
    """Restrict training to these task ids (or id prefixes, e.g. "grid4-"); empty = all tasks."""
    group_size: Annotated[int, Field(ge=2)] = 4
    """G: rollouts of the same task per group (ARPO: 8)."""
    groups_per_step: PositiveInt = 2
    """Groups with non-zero reward variance per optimizer step; batch = groups_per_step x group_size trajectories."""
    steps: NonNegativeInt = 3
    """Stop after this many optimizer steps (0 = run until interrupted)."""
    max_staleness: NonNegativeInt = 1
    """eta in AReaL's admission rule: work is handed out only while accepted + running < (eta + version + 1) x B.
    Larger = more throughput, more policy lag; 0 = synchronous."""
    lr: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 5e-4
    """AdamW learning rate (ARPO uses 1e-6 for a 7B model; the tiny embedded model needs a larger one)."""
    weight_decay: NonNegativeFloat = 0.01
    """AdamW weight decay (ARPO: 0.01)."""
    grad_clip: NonNegativeFloat = 1.0
    """Clip the global gradient L2 norm to this before each optimizer step (ARPO: 1.0); 0 disables clipping."""
    eps_low: Annotated[float, Field(gt=0, lt=1)] = 0.2
    """PPO clip lower bound: ratio floor 1 - eps_low (ARPO: 0.2)."""
    eps_high: PositiveFloat = 0.3
    """PPO clip-higher upper bound: ratio ceiling 1 + eps_high (ARPO: 0.3; DAPO: 0.28)."""
    dual_clip: Annotated[float, Field(gt=1)] = 3.0
    """Dual-clip constant c for negative advantages: a token with A < 0 loses at most -c x A (ARPO: 3.0)."""
    replay: bool = True
    """ARPO's success replay: inject a stored success into all-failed groups."""
    replay_capacity: PositiveInt = 8
    """Successes kept per task (ARPO: 8, oldest evicted first)."""
    replay_mode: Literal["arpo", "prioritized", "off"] = "prioritized"
    """"arpo" (ARPO-exact: FIFO per task, uniform draw, all-failed groups only), "prioritized" or "off";
    replay = false forces "off"."""
    replay_max_total: PositiveInt = 256
    """Prioritized replay: most successes kept over all tasks (lowest priority evicted first); bounds memory."""
    replay_inject_below: Fraction = 0.0
    """Prioritized replay: also inject into groups whose success rate is below this (0 = all-failed groups only)."""
    replay_alpha: NonNegativeFloat = 1.0
    """Prioritized replay: exponent on (1 - task success EMA + 0.05), preferring tasks the policy fails."""
    replay_age_tau: PositiveFloat = 8.0
    """Prioritized replay: age scale in policy versions; priority x exp(-age / tau) prefers fresh successes."""
    replay_length_beta: NonNegativeFloat = 0.5
    """Prioritized replay: priority x steps^-beta prefers short successful episodes."""
    correction: Correction = "decoupled"
    """Off-policy correction: "arpo" (none), "decoupled" (AReaL), "tis" (slime truncated IS) or "behaviour"
    (PPO ratio against the sampler's log-probs); see learner.grpo.corrected_token_loss."""
    decoupled_cap: Annotated[float, Field(gt=1, allow_inf_nan=False)] = 5.0
    """"decoupled": tokens with pi_prox / pi_behav above this are left out of the loss (AReaL examples: 5.0)."""
    tis_cap: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 2.0
    """"tis": pi_prox / pi_behav is truncated at this (slime --tis-clip default: 2.0)."""
    baseline_k: NonNegativeInt = 0
    """Baseline pass: rollouts per task with the initial policy before training, keeping tasks with a success
    (ARPO's valuable tasks); 0 = no baseline pass."""
    baseline_min_success: PositiveInt = 1
    """Baseline pass: successes a task needs to be kept (ARPO: 1)."""
    baseline_drop_solved: bool = False
    """Baseline pass: also drop tasks solved in all k rollouts (they give only zero-variance groups)."""
    task_strategy: Literal["round_robin", "uncertainty"] = "round_robin"
    """Online task choice among active tasks: "round_robin" (shuffled, seeded) or "uncertainty" (weight p(1-p))."""
    task_window: PositiveInt = 8
    """Rollouts per task in its success window; a task solved in all of them is retired."""
    task_retire: bool = True
    """Retire tasks solved every time over the window (they would give only zero-variance groups)."""
    task_revisit_every: NonNegativeInt = 10
    """Every this many groups one goes to a retired task, which is reactivated if it fails (0 = never)."""
    task_revisit_prob: Fraction = 0.0
    """Probability that a group goes to a retired task (in addition to task_revisit_every; 0 = never)."""
    task_error_limit: NonNegativeInt = 3
    """A task whose rollouts end in TASK_ERROR (its setup, getter or metric is broken) this many times in a row is
    set aside for the rest of the run and named in metrics and on the progress line (0 = never)."""
    format_reward_weight: float = 0.5
    """reward = score + weight x format reward (format reward -1 when a reply does not parse; ARPO: 0.5)."""
    success_threshold: Annotated[float, Field(ge=0, lt=1)] = DEFAULT_SUCCESS_THRESHOLD
    """An episode is a success when its evaluator score is strictly above this (arpo_async.success.is_success), for
    every count: the actors' Outcome.SUCCESS, success rates, replay, task selection and the baseline pass. Default
    ARPO's replay rule, score > 0.1 (github.com/dvlab-research/ARPO); actors read it too, so give them the same file."""
    rollout_retries: int = 2
    """A rollout that ends in ENV_ERROR or ABORTED is handed out again this many times before its group goes on without it."""
    torch_threads: PositiveInt = 1
    """Threads for torch on the learner, per rank (the desktops need the other cores)."""
    device: Literal["auto", "cpu", "cuda"] = "cpu"
    """Where the learner trains: "cpu", "cuda" (each torchrun rank takes cuda:LOCAL_RANK) or "auto" (cuda when
    available). "cuda" on a machine without CUDA stops the learner at start with an error naming this key."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """"float32" or "bfloat16": bf16 parameters and activations in the forward and backward passes, with float32
    master weights, AdamW state, gradient reduction and log-softmax (learner.trainer)."""
    gradient_checkpointing: bool = False
    """Recompute decoder-layer activations in the backward pass (less memory for long multi-screenshot prompts,
    about a third more compute)."""
    max_tokens_per_microbatch: NonNegativeInt = 16384
    """Padded tokens per forward/backward pass: each step's samples are packed longest first under this budget and
    gradients accumulated; the step is the same for any value (0 = each rank's share in one pass). A sample longer
    than the budget stops the learner with an error naming this key."""
    logprob_chunk_tokens: PositiveInt = 1024
    """Completion tokens the trainer projects to the vocabulary at once (learner.policy_forward): peak extra memory
    chunk x vocab x 4 B of fp32 logits; the log-probs are the same for any value."""
    weight_sync: Literal["disk", "distributed"] = "disk"
    """How new weights reach the inference servers: "disk" (a weights folder per version, then
    /update_weights_from_disk) or "distributed" (broadcast over a process group per server, SGLang's
    /init_weights_update_group + /update_weights_from_distributed; nothing written to disk)."""
    sync_bucket_mb: PositiveFloat = 512.0
    """"distributed": most megabytes of tensors per /update_weights_from_distributed request."""
    sync_host: str = "127.0.0.1"
    """"distributed": the address the inference servers reach the learner's rank 0 at (master_address)."""
    sync_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """"distributed": "gloo", "nccl" or "auto" (nccl when learner.device is cuda, else gloo; arpo-serve takes gloo)."""
    sync_timeout_s: PositiveFloat = 120.0
    """"distributed": seconds a server may take to join or to receive the weights before it is skipped."""
    sync_load_format: Literal["tensors", "flattened_bucket"] = "tensors"
    """"distributed": "tensors" (one broadcast per tensor) or "flattened_bucket" (SGLang's load_format: one flat
    uint8 tensor per /update_weights_from_distributed request, fewer collectives)."""
    resync_interval_s: NonNegativeFloat = 10.0
    """Every this many seconds, ask each inference server for its weight_version and send the current weights to
    one that is behind the learner's policy version (a restarted server comes back with the run's base weights;
    its rollouts would stay too stale to train on, so with one server the run would never publish again); a server
    that does not answer is left for the next check (0 = never)."""
    verify_weights_every: NonNegativeInt = 0
    """After every this many publications, ask each server for its /weights_checker checksums and compare them
    with the learner's own; a mismatch stops the learner with an error naming the server (0 = never)."""
    stall_warning_s: NonNegativeFloat = 300.0
    """When no optimizer step happened for this long although groups came back (every one without a reward
    difference), the log and the progress line say why (0 = never)."""
    stall_timeout_s: NonNegativeFloat = 0.0
    """Stop the learner with an error (non-zero exit, so `arpo run` fails) after this long without an optimizer
    step while groups keep coming back without a reward difference (0 = never)."""
    dist_timeout_s: PositiveFloat = 1800.0
    """Under torchrun: seconds a collective may wait for the other ranks before the run fails (a dead rank is
    usually noticed at once; rank 0 pings the others when idle, so waiting for rollouts never trips it)."""
    keep_weights: PositiveInt = 2
    """Published weight folders kept on disk (older ones are deleted)."""
    seed: int = 0
    """Seed for task order and replay draws."""
    schedule: Literal["async", "lockstep"] = "async"
    """"async": hand out work whenever the staleness rule admits it (AReaL); "lockstep": ARPO's synchronous loop
    (hand out groups_per_step groups, wait for all of them, train, publish, repeat). Lockstep idles desktops."""
    updates_per_batch: PositiveInt = 1
    """Optimizer steps per training batch: its samples are split into this many mini-batches, one step each,
    all clipped against the same pre-update policy; the weights are then published once (ARPO: 2)."""
    checkpoint_every: NonNegativeInt = 1
    """Write a resumable checkpoint to <run>/checkpoints every this many optimizer steps (0 = never)."""
    keep_checkpoints: PositiveInt = 2
    """Checkpoints kept on disk (older ones are deleted after a new one is complete)."""
    tensorboard: bool = True
    """Also write every metrics.jsonl number to TensorBoard event files in <run>/tb/ (`tensorboard --logdir`)."""
    wandb_project: str = ""
    """Also log every metrics.jsonl number to this Weights & Biases project ("" = off; needs `pip install -e
    '.[wandb]'`; WANDB_MODE=offline writes the run under <run>/wandb without a network)."""
    stratified: bool = True
    """Each optimizer step's groups cover distinct tasks where the ready groups allow it (the oldest group of
    each task first), so one step is not dominated by whichever task was drawn twice; false = oldest groups first."""
    mask_forced_tokens: bool = True
    """Leave tokens the action grammar forced (fixed text such as "Action: click(") out of the loss: they are not
    the policy's choice. Found from the tokens and the trajectory's grammar, alike for SGLang and arpo-serve."""
    sample_trajectories: Fraction = 0.05
    """Fraction of received trajectories kept with their screenshots in <run>/trajectories for `arpo view` (chosen by
    a hash of the trajectory id; 0 = none). Every task's first success is kept besides (learner.trajectory_sample)."""
    sample_disk_mb: PositiveFloat = 200.0
    """Disk budget of <run>/trajectories in MiB: beyond it the oldest samples are deleted (first successes never)."""

    @property
    def batch_trajectories(self) -> int:
        """B: trajectories per optimizer step."""
        return self.group_size * self.groups_per_step

    @property
    def correction_cap(self) -> float:
        """The cap of the selected correction mode (unused by "arpo" and "behaviour")."""
        return self.tis_cap if self.correction == "tis" else self.decoupled_cap


@_config("actors")
class ActorConfig:
    """Environment actors: desktops, episodes, the policy endpoint."""

    actors: PositiveInt = 8
    """EnvActor coroutines (one desktop each) in this process."""
    inference_urls: Annotated[Strings, Field(min_length=1)] = ("http://127.0.0.1:30000",)
    """SGLang or arpo-serve base URLs; one episode sticks to one server."""
    max_steps: PositiveInt = 5
    """Step budget per episode (ARPO: 15)."""
    history_images: PositiveInt = 2
    """Screenshots kept in the prompt (the last k; ARPO keeps all 15)."""
    max_new_tokens: int = 64
    """Generated tokens per step."""
    temperature: NonNegativeFloat = 1.0
    """Sampling temperature for training rollouts (ARPO: 1.0)."""
    top_p: float = 1.0
    """Nucleus sampling for rollouts."""
    constrained: bool = True
    """Ask the server for the UI-TARS action grammar (regex) so every reply parses."""
    grammar_actions: Strings = ()
    """Actions the grammar allows (UI-TARS names, e.g. ["click", "finished"]); empty = the whole action space."""
    max_thought_chars: int = 20
    """Longest `Thought:` the grammar allows (characters of [A-Za-z ])."""
    coordinate_mode: Literal["relative1000", "absolute"] = "relative1000"
    """How the model writes coordinates: "relative1000" (0..999 of each screen side; the default, sized for the
    tiny policy) or "absolute" (UI-TARS-1.5's smart-resized pixels: use it with a real UI-TARS checkpoint)."""
    fixed_width_coordinates: bool = True
    """The grammar writes every coordinate zero-padded to the width of its maximum ("(045,730)"), so a policy
    that has not learnt yet clicks all of the screen alike; false = UI-TARS's plain integers."""
    prompt_style: Literal["compact", "uitars"] = "compact"
    """"compact" (the bare instruction and screenshots: a ~50-token prompt for small policies trained from
    scratch) or "uitars" (UI-TARS-1.5's action-space prompt: use it with a real UI-TARS checkpoint)."""
    screen_width: int = 1280
    """Desktop screen width (pixels)."""
    screen_height: int = 720
    """Desktop screen height (pixels)."""
    desktop_memory_mb: int = 512
    """Memory limit per desktop container."""
    desktop_pids: int = 256
    """Process limit per desktop container."""
    image: str = ""
    """Desktop image; empty = the image of image_profile at the recipe's version, built by `arpo desktop build
    [--profile P]` (and by `arpo run` when missing)."""
    image_profile: Literal["default", "osworld"] = "default"
    """Which desktop image to run when `image` is empty: "default" (arpo-desktop, small, the built-in Tk tasks)
    or "osworld" (arpo-desktop-osworld: OSWorld's apps and user session, ~2 GB, for OSWorld's tasks; give its
    desktops desktop_memory_mb >= 2048 for LibreOffice or chromium)."""
    policy_attempts: int = 6
    """Tries per /generate before the episode ends as ABORTED (exponential backoff between tries)."""
    policy_max_wait_s: float = 30.0
    """Longest backoff between /generate tries (seconds)."""
    setup_timeout_s: float = 120.0
    """Deadline for a task's setup steps and for its evaluation (seconds); missing it is an ENV_ERROR."""
    step_timeout_s: float = 120.0
    """Deadline for one desktop call (seconds); a desktop that misses it is treated as dead (ENV_ERROR)."""
    warm_spares: NonNegativeInt = 2
    """Booted desktops kept ready beyond those in use, so a reset takes one from the pool instead of waiting
    for a container to boot. Trades RAM (about one desktop's memory each) for reset latency; 0 = boot on demand."""
    max_concurrent_starts: PositiveInt = 2
    """Desktop containers booting at once per actors process (DesktopFleet's start slots, first come first served;
    more = faster refill, more CPU contention). A desktop's boot deadline counts from its own slot, so starts queued
    behind hundreds of others do not time out (bench_desktops.py --live: 256 asked for at once)."""
    desktop_start_attempts: PositiveInt = 3
    """Tries to start one desktop (exponential backoff between tries) before a DesktopError surfaces."""
    desktop_health_interval_s: PositiveFloat = 10.0
    """Seconds between health checks of the warm spares (a dead spare is removed and replaced)."""
    desktop_max_episodes: PositiveInt = 16
    """Episodes one desktop container serves, reset in place between them (POST /reset: apps killed, /root and
    /tmp put back, ~0.13 s) instead of booting a new container per episode; 1 = a fresh container every episode
    (nothing outside /root and /tmp can leak, at a container boot per trajectory). See DesktopPool."""
    screenshot_format: Literal["png", "jpeg"] = "png"
    """Screenshot encoding from the desktop: "png" (lossless, OSWorld's) or "jpeg" (smaller, faster at 1080p)."""
    screenshot_quality: Annotated[int, Field(ge=1, le=100)] = 85
    """JPEG quality 1..100 when screenshot_format is "jpeg" (ignored for PNG)."""
    download_max_mb: PositiveFloat = 256.0
    """Largest file a task's `download` step (or `cloud_file` getter) fetches from the network, MiB; files go
    to a content-addressed cache under <run_dir>/cache/downloads (actors.osworld.downloads)."""
    download_timeout_s: PositiveFloat = 300.0
    """Deadline for one such network fetch, connect to last byte (seconds; OSWorld's is 300 per try)."""
    action_backend: Literal["xdotool", "pyautogui"] = "xdotool"
    """How actions are performed in the desktop: "xdotool" (one xdotool process per action, ~4 ms a click) or
    "pyautogui" (OSWorld's way: ``python -c "import pyautogui; ..."`` per action, ~0.2 s of Python start-up plus
    pyautogui's pauses; UI-TARS/OSWorld's mapping, actors/uitars/pyautogui.py). Trades speed for fidelity to
    OSWorld-style agents."""
    host_label: str = ""
    """This actor host's name, added to the run id in the Docker label of its desktops (``arpo.run=<run
    id>-<host_label>``), so several arpo-actors of one run can share one Docker engine and each removes only its
    own containers (`arpo launch` sets one per node). Empty = the run id alone."""

    @property
    def screen_size(self) -> tuple[int, int]:
        return (self.screen_width, self.screen_height)

    @property
    def sampling_params(self) -> dict[str, Any]:
        """SGLang sampling_params for rollouts (the regex is added by the actor when `constrained`)."""
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p}


@_config("serve")
class ServeConfig:
    """The embedded inference server started by `arpo run` (arpo-serve on the CPU)."""

    host: str = "127.0.0.1"
    """Listen address."""
    port: int = 30000
    """Listen port."""
    max_batch: PositiveInt = 16
    """Largest batch of concurrent /generate requests decoded together."""
    jump_forward: bool = True
    """Emit text the action grammar forces as its canonical tokens instead of sampling it (arpo_serve.engine)."""
    api_key: str = ""
    """Bearer token the inference servers require (arpo-serve / SGLang --api-key); actors and the learner send it.
    Empty = none (then keep the servers on a private network)."""
    weight_version: str = "0"
    """The weight version arpo-serve reports until the first update (meta_info.weight_version)."""
    seed: int = 0
    """Seed of arpo-serve's server-level sampler (a request may bring its own sampling_seed)."""
    logprob_mode: Literal["model", "sglang"] = "model"
    """"model": unmasked temperature-1 log-probs, the trainer's quantity; "sglang": masked and tempered, SGLang's."""
    weights_root: str = ""
    """When set, /update_weights_from_disk loads only folders under it (`arpo run` passes <run>/weights); empty =
    any folder arpo-serve can read."""
    image_root: str = ""
    """When set, /generate reads an image_data entry that names a local file (absolute path or file:// URI) only
    under this folder; empty = no local files at all (actors send base64 data URIs)."""


@_config("eval")
class EvalConfig:
    """Held-out evaluation during training (learner.evaluation_rounds): rounds of episodes on the run's own
    desktops, at the policy version of the moment, never trained on, never in the replay buffer, never in task
    selection's statistics. A round runs before the first optimizer step (fresh runs), whenever the step count
    crosses a multiple of every_steps, and on the final weights before the learner stops; each round's
    eval_success, eval_task_success and eval_policy_version go into the next metrics.jsonl record."""

    tasks: str = ""
    """What to evaluate on: the name of a built-in split ("grid4-test": arpo_async/splits/<name>.json, cut from
    the built-in suite), a task folder or file (OSWorld format), or a built-in task id or family ("grid4"); with
    `split` also set, the folder the split is cut from. Empty (and no split) = no evaluation. Checked when the
    learner starts: a set that does not load or holds a task that cannot run stops it with an error naming this
    key."""
    split: str = ""
    """A split file ({domain: [task id, ...]}, OSWorld's test_all.json form) or built-in split name that cuts
    `tasks` (empty tasks: learner.tasks, or the built-in suite); empty = every task of `tasks`."""
    every_steps: NonNegativeInt = 0
    """Evaluate whenever the optimizer step count crosses a multiple of this (0 = only before training and on
    the final weights). A round still running when the next one is due is let finish and recorded; the due one
    is skipped (counted in totals as eval_rounds_skipped), except the final round, which always runs (an older
    round still running is then abandoned)."""
    repeats: PositiveInt = 1
    """Episodes per task in each round (round size = repeats x tasks)."""
    max_steps: NonNegativeInt = 0
    """Step budget of an evaluation episode (0 = actors.max_steps)."""
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    """Sampling temperature of evaluation episodes. 0 = greedy, as OSWorld and UI-TARS report a checkpoint's
    score: deterministic, so repeats only measure the desktops' noise; a greedy policy that repeats one action
    ends at the step budget (max_steps bounds it). A small policy trained from scratch (configs/grid4.toml) is
    better read at its training temperature (actors.temperature, 1.0): its greedy answer is one fixed click per
    task."""
    final_timeout_s: NonNegativeFloat = 600.0
    """How long the end of the run waits for the final round (logged; 0 = no final round)."""

    @property
    def enabled(self) -> bool:
        """Whether the run evaluates (tasks or split is set)."""
        return bool(self.tasks or self.split)


@_config("cluster")
class ClusterConfig:
    """`arpo launch`: what it places on a Ray cluster (launch and supervision only; the processes talk ZeroMQ,
    HTTP and torch.distributed as everywhere else). Every other process ignores this section."""

    servers: PositiveInt = 1
    """Inference servers to start; server i listens on serve.port + i of its node."""
    server_gpus: NonNegativeInt = 0
    """GPUs per inference server: > 0 starts SGLang (`python -m sglang.launch_server`, tensor parallel over them) on
    a GPU node; 0 starts arpo-serve on a CPU."""
    server_cpus: NonNegativeFloat = 1.0
    """Ray CPUs reserved per inference server."""
    server_resource: str = ""
    """A custom Ray resource (``ray start --resources '{"NAME": 1}'``) a node must offer to host an inference
    server; empty = any node with the CPUs and GPUs."""
    learner_ranks: PositiveInt = 1
    """Learner ranks (torch.distributed); each rank is a Ray actor placed in one packed placement group and given
    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and MASTER_ADDR/PORT as torchrun gives them."""
    learner_gpus_per_rank: Annotated[int, Field(ge=0, le=1)] = 0
    """GPUs per learner rank: 0 (CPU ranks, gloo) or 1 (one GPU each, as torchrun gives; set learner.device)."""
    learner_cpus_per_rank: PositiveFloat = 1.0
    """Ray CPUs reserved per learner rank."""
    learner_resource: str = ""
    """A custom Ray resource a node must offer, one per rank, to host learner ranks (``ray start --resources
    '{"NAME": 8}'`` on the training nodes), so the ranks never take a GPU node meant for the servers; empty = any
    node with the CPUs and GPUs."""
    desktops_resource: str = "desktops"
    """The custom Ray resource a desktop host offers, as many as the desktops it can run (``ray start --resources
    '{"desktops": 64}'``): one arpo-actors process per such node, with that node's Docker engine and a share of
    actors.actors proportional to its count."""
    max_restarts: NonNegativeInt = 3
    """Times Ray restarts a dead arpo-actors or inference-server process (Ray's ``max_restarts``); their
    rollouts are re-issued by the learner as after any actor death. A dead learner rank stops the job."""
    startup_timeout_s: PositiveFloat = 300.0
    """Deadline for the placement group, every server's /health and every process's start (seconds)."""
    stop_grace_s: PositiveFloat = 60.0
    """Seconds a process gets to exit after SIGTERM (arpo-actors remove their desktops then) before SIGKILL."""


@_config("")
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
    eval: EvalConfig = field(default_factory=EvalConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

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

    @property
    def fleet_label(self) -> str:
        """The ``arpo.run`` label of this actor host's desktops: the run id, plus ``-<actors.host_label>``."""
        label = self.actors.host_label
        safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in label)
        return f"{self.resolved_run_id}-{safe}" if label else self.resolved_run_id


SECTION_TYPES: dict[str, type] = {name: hint for name, hint in typing.get_type_hints(RunConfig).items()
                                  if dataclasses.is_dataclass(hint)}
"""The config sections (TOML tables) in declaration order and their dataclasses, e.g. "learner": LearnerConfig."""


def _config_error(error: ValidationError, section: str, cls: type) -> ConfigError:
    """One ConfigError for the ValidationError raised building ``cls``: each unknown key with the known key it
    probably meant (:func:`suggest_keys`), then every other problem as ``section.key: reason`` (a model validator's
    reason starts with its key)."""
    prefix = f"{section}." if section else ""
    problems = []
    for e in error.errors():
        if e["type"] == "unexpected_keyword_argument":
            problems.append(_unknown_key(prefix + str(e["loc"][0]), is_section=isinstance(e["input"], dict)))
    for e in error.errors():
        if e["type"] != "unexpected_keyword_argument":
            key = ".".join(str(part) for part in e["loc"] if isinstance(part, str))  # without a list index
            problems.append(f"{prefix}{key}: {_reason(e)}" if key else prefix + _reason(e))
    return ConfigError("; ".join(problems))


def dotted_keys() -> list[str]:
    """Every key a run file or ``--set`` may name, in declaration order: the top-level keys (the section names
    among them, e.g. "learner"), then each section's keys as ``section.key`` (e.g. "learner.lr")."""
    keys = [f.name for f in dataclasses.fields(RunConfig)]
    for name, cls in SECTION_TYPES.items():
        keys += [f"{name}.{f.name}" for f in dataclasses.fields(cls)]
    return keys


def suggest_keys(key: str, sections_only: bool = False) -> list[str]:
    """The known dotted keys an unknown ``key`` probably meant, best first (at most 3; [] when none is close).

    A key whose last part is a known key's name in another place is pointed there (``lr`` and ``actors.lr`` ->
    ``learner.lr``, ``learner.run_dir`` -> ``run_dir``); otherwise difflib's close matches (ratio >= 0.6) of the
    last part over the names of the same section's keys (``learner.lrr`` -> ``learner.lr``), then over every
    key's name (``lrr`` -> ``learner.lr``). ``sections_only``: ``key`` is a TOML table, so only section names are
    candidates (``lerner`` -> ``learner``).
    """
    if sections_only:
        return difflib.get_close_matches(key, list(SECTION_TYPES), n=3)
    keys = [k for k in dotted_keys() if k not in SECTION_TYPES and k != key]
    section, _, name = key.rpartition(".")
    same_name = [k for k in keys if k.rpartition(".")[2] == name]
    if same_name:
        return same_name
    here = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == section]
    close = difflib.get_close_matches(name, here, n=3)
    if close:
        return [f"{section}.{k}" if section else k for k in close]
    by_name: dict[str, list[str]] = {}
    for k in keys:
        by_name.setdefault(k.rpartition(".")[2], []).append(k)
    return [k for near in difflib.get_close_matches(name, list(by_name), n=3) for k in by_name[near]][:3]


def _unknown_key(key: str, is_section: bool) -> str:
    """The message for one unknown key or section: what it probably meant, else where the known keys are listed."""
    kind = "section" if is_section else "key"
    near = suggest_keys(key, sections_only=is_section)
    if near:
        return f"unknown config {kind} {key!r}; did you mean {' or '.join(near)}?"
    section = key.rpartition(".")[0]
    where = f"arpo config show --section {section}" if section in SECTION_TYPES else "arpo config show"
    return f"unknown config {kind} {key!r} (`{where}` lists the known keys)"


def _reason(e: ErrorDetails) -> str:
    """Why one value failed, in words like "must be >= 2, got 1" or "must be 'a' or 'b', got 'c'"."""
    kind, ctx, got = e["type"], e.get("ctx", {}), f", got {e['input']!r}"
    if kind in _TYPE_NAMES:
        return f"must be {_TYPE_NAMES[kind]}{got}"
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()))
        return f"must be {_BOUNDS[kind]} {bound:g}{got}"
    if kind == "literal_error":
        return f"must be {ctx['expected']}{got}"
    if kind == "finite_number":
        return f"must be a finite number{got}"
    if kind == "too_short":
        return f"needs at least {ctx['min_length']} item(s)"
    if kind == "value_error":
        return str(ctx["error"])
    return f"{e['msg']}{got}"


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
        _set_dotted(data, key.strip(), _parse_override(key.strip(), raw.strip()))
    known = {f.name for f in dataclasses.fields(RunConfig)}
    problems = [_unknown_key(k, is_section=isinstance(v, dict)) for k, v in data.items() if k not in known]
    for name, cls in SECTION_TYPES.items():  # every section's problems at once, not the first section's only
        if name in data:
            if not isinstance(data[name], dict):
                problems.append(f"{name}: must be a table (section), got {data[name]!r}")
                continue
            try:
                data[name] = cls(**data[name])
            except ConfigError as e:
                problems.append(str(e))
    if problems:
        raise ConfigError("; ".join(problems))
    return RunConfig(**data)


def _parse_scalar(raw: str) -> Any:
    """Parse an override value as TOML (numbers, booleans, lists, quoted strings), else keep the raw string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _parse_override(key: str, raw: str) -> Any:
    """An override's value, parsed by the type of the field ``key`` names: for a str field (a Literal of strs
    included) the text itself, or the string it spells when quoted as TOML (``run_id=2024`` and
    ``run_id="2024"`` both give "2024"); for a list of strs the same, unless the text is a TOML list (one value
    becomes a 1-tuple); for any other field, or a key that names no field, the TOML value (:func:`_parse_scalar`).
    """
    value = _parse_scalar(raw)
    kind = _field_kind(key)
    if kind == "str" or (kind == "strs" and not isinstance(value, list)):
        return value if isinstance(value, str) else raw
    return value


def _field_kind(key: str) -> str:
    """"str" for a str field (or a Literal of strs), "strs" for a tuple of strs, "" for any other type or a key
    that names no field."""
    section, _, name = key.rpartition(".")
    cls = RunConfig if not section else SECTION_TYPES.get(section)
    hint = typing.get_type_hints(cls).get(name) if cls is not None else None
    if hint is str or (typing.get_origin(hint) is Literal and all(isinstance(a, str) for a in typing.get_args(hint))):
        return "str"
    if typing.get_origin(hint) is tuple and typing.get_args(hint)[:1] == (str,):
        return "strs"
    return ""


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key!r}: {part!r} is not a section")
    node[parts[-1]] = value


def to_dict(config: Any) -> dict[str, Any]:
    """The config as plain TOML-compatible data (for the run folder and for child processes)."""
    return dataclasses.asdict(config)


def dump_toml(config: RunConfig) -> str:
    """Serialise a RunConfig as TOML (tomli_w) that `load_config` reads back to an equal config."""
    return tomli_w.dumps(to_dict(config))


def toml_value(value: Any) -> str:
    """One value as a TOML literal (bool, int, float, str, list/tuple of these), as tomli_w writes it.

    Raises:
        ConfigError: another type.
    """
    if isinstance(value, (list, tuple)):  # on one line, as `arpo config show` prints it
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    try:
        return tomli_w.dumps({"v": value}).split("=", 1)[1].strip()
    except TypeError as error:
        raise ConfigError(f"cannot write {value!r} as TOML") from error
