"""The run config's sections besides [learner] (arpo_async.config_learner) and the root that holds them all.

Owns :class:`TransportConfig`, :class:`ActorConfig`, :class:`ServeConfig`, :class:`EvalConfig`,
:class:`ClusterConfig` and :class:`RunConfig` (the top-level keys and one field per section), each declared with
arpo_async.config_fields.config_section; arpo_async.config loads them from TOML and re-exports them. Every field
has an attribute docstring (`arpo config show` prints it).
"""

from __future__ import annotations

from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt,
                      model_validator)

from arpo_async.config_fields import Strings, config_section, section_types
from arpo_async.config_learner import LearnerConfig

__all__ = ["SECTION_TYPES", "ActorConfig", "ClusterConfig", "EvalConfig", "RunConfig", "ServeConfig",
           "TransportConfig"]


def _zmq_endpoint(value: str) -> str:
    if not value.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"must be a ZeroMQ endpoint (tcp://, ipc://), got {value!r}")
    return value



@config_section("transport")
class TransportConfig:
    """ZeroMQ link between actors (DEALER) and the learner (ROUTER)."""

    endpoint: Annotated[str, AfterValidator(_zmq_endpoint)] = "tcp://127.0.0.1:0"
    """Learner's ROUTER endpoint; the learner binds it, actors connect to it. Port 0 (or *) = a free one:
    `arpo run` picks it when it starts and writes it into <run>/config.toml (a learner started by hand binds a free
    port and logs it; arpo-actors need the real port); any other port is used as given, and `arpo run` refuses it
    when it is taken. `arpo launch` takes 0 as 5555."""
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
    starve another (learner.rollouts.peers)."""

    @model_validator(mode="after")
    def _peer_timeout_spans_heartbeats(self) -> TransportConfig:
        if not self.peer_timeout_s > 2 * self.heartbeat_s:
            raise ValueError("peer_timeout_s: must be more than 2 heartbeats (transport.heartbeat_s)")
        return self

    @property
    def max_message_bytes(self) -> int:
        return self.max_message_mb * 1024 * 1024


@config_section("actors")
class ActorConfig:
    """Environment actors: desktops, episodes, the policy endpoint."""

    actors: PositiveInt = 8
    """EnvActor coroutines (one desktop each) in this process."""
    inference_urls: Annotated[Strings, Field(min_length=1)] = ("http://127.0.0.1:30000",)
    """SGLang or arpo-serve base URLs; one episode sticks to one server. `arpo run` puts its own arpo-serve here
    when this is left at its default (and refuses a value that does not name that server)."""
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
    reply_retries: Annotated[int, Field(ge=0, le=10)] = 0
    """Times a step asks the policy again when its reply does not parse as a UI-TARS action (OSWorld's UI-TARS
    agent asks 3 times in all, re-asking at temperature 1.0); only the reply kept is the step. When every try fails,
    the episode ends as POLICY_ERROR, scored 0 (never as FAIL: an unreadable reply cannot win an infeasible task).
    0 = ARPO's training rule: the first unparseable reply ends the episode and is trained on with the format
    penalty. `arpo eval` asks 2 more times unless --reply-retries says otherwise (docs/guides/evaluation.md)."""
    policy_attempts: int = 6
    """Tries per /generate before the episode ends as ABORTED (exponential backoff between tries)."""
    policy_max_wait_s: float = 30.0
    """Longest backoff between /generate tries (seconds)."""
    policy_timeout_s: PositiveFloat = 600.0
    """Deadline for one policy call of an episode, all its tries and backoff waits together (seconds): past it
    the episode ends ABORTED with a PolicyTimeout error (not trained on; in `arpo eval` an errored episode), so a
    server that accepts requests and never answers holds a step this long, not policy_attempts x the 600 s
    request timeout. The default lets one long multi-image generation on a busy server finish."""
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
    settle_interval_s: Annotated[float, Field(ge=0, le=10)] = 0.1
    """After an action, the next screenshot is the first of two taken this many seconds apart that are identical:
    the app has drawn what the action did (actors.settle). Costs one more screenshot and at least this long per
    action (3-step episodes on the 2-core machine: about a quarter fewer a minute). 0 = one screenshot right after
    the action (on a busy machine it can show the screen before the action)."""
    settle_timeout_s: Annotated[float, Field(ge=0, le=120)] = 2.0
    """Longest wait for the screen to settle after an action (seconds); past it the latest screenshot is used.
    The episode's last action is settled too, before the evaluator reads the desktop."""
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


@config_section("serve")
class ServeConfig:
    """The embedded inference server started by `arpo run` (arpo-serve on the CPU)."""

    host: str = "127.0.0.1"
    """Listen address."""
    port: Annotated[int, Field(ge=0, le=65535)] = 0
    """Listen port (1-65535), or 0 = a free one: `arpo run` picks it when it starts and writes it into
    <run>/config.toml (arpo-serve started by hand binds a free port and prints it in its ready line); any other
    port is used as given, and `arpo run` refuses it when it is taken. `arpo eval` takes a free port unless
    --set serve.port=N is on its command line. `arpo launch` takes 0 as 30000."""
    max_batch: PositiveInt = 16
    """Largest batch of concurrent /generate requests decoded together."""
    jump_forward: bool = True
    """Emit text the action grammar forces as its canonical tokens instead of sampling it (arpo_serve.engine)."""
    api_key: str = ""
    """Bearer token the inference servers require (arpo-serve / SGLang --api-key); actors and the learner send it.
    Empty = none (then keep the servers on a private network)."""
    admin_api_key: str = ""
    """Bearer token of the weight and control routes (weight updates, weight groups and sessions, weight version,
    pause/continue, flush_cache, abort_request, weights_checker), which then take no other key: SGLang's and
    arpo-serve's --admin-api-key; only the learner sends it. Empty: `arpo run` makes a random one per run for its
    own arpo-serve (passed as $ARPO_ADMIN_API_KEY, never written or logged); elsewhere those routes take api_key."""
    weight_version: str = "0"
    """The weight version arpo-serve reports until the first update (meta_info.weight_version)."""
    seed: int = 0
    """Seed of arpo-serve's server-level sampler (a request may bring its own sampling_seed)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The dtype arpo-serve holds the weights in (SGLang's --dtype). The learner publishes weights in the dtype each
    server reports (learner.publish_dtype)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where arpo-serve runs the policy: "cpu", or "cuda" (the current CUDA device; then it also joins weight groups
    with backend "nccl"). Sampling, grammar masks and log-probs are computed on the CPU either way."""
    logprob_mode: Literal["model", "sglang"] = "model"
    """"model": unmasked temperature-1 log-probs, the trainer's quantity; "sglang": masked and tempered, SGLang's."""
    weights_root: str = ""
    """When set, /update_weights_from_disk loads only folders under it (`arpo run` passes <run>/weights); empty =
    any folder arpo-serve can read."""
    image_root: str = ""
    """When set, /generate reads an image_data entry that names a local file (absolute path or file:// URI) only
    under this folder; empty = no local files at all (actors send base64 data URIs)."""


@config_section("eval")
class EvalConfig:
    """Held-out evaluation during training (learner.rollouts.evaluation_rounds): rounds of episodes on the run's own
    desktops, at the policy version of the moment, never trained on, never in the replay buffer, never in task
    selection's statistics. A round runs before the first optimizer step (fresh runs), whenever the step count
    crosses a multiple of every_steps, and on the final weights before the learner stops (at learner.steps, or
    earlier when every task is solved); each round's eval_success, eval_task_success and eval_policy_version go
    into the next metrics.jsonl record (a solved run's final round: a record of its own after the last batch's)."""

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


@config_section("cluster")
class ClusterConfig:
    """`arpo launch`: what it places on a Ray cluster (launch and supervision only; the processes talk ZeroMQ,
    HTTP and torch.distributed as everywhere else). Every other process ignores this section."""

    servers: PositiveInt = 1
    """Inference servers to start; server i listens on serve.port + i of its node (30000 + i when serve.port is 0)."""
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


@config_section("")
class RunConfig:
    """Everything one run needs. `model` is the policy checkpoint (HF folder) the run starts from."""

    run_dir: str = "runs/default"
    """Run folder: metrics.jsonl, weights/, logs/, checkpoints."""
    model: str = ""
    """Policy checkpoint folder (HF layout); empty = <run_dir>/../tiny-model created by `arpo init-model`."""
    run_id: str = ""
    """Label on every container of this run (for cleanup); empty = derived from run_dir (`arpo run` writes
    <folder name>-<8 hex digits of its absolute path> into <run>/config.toml, so two runs whose folders share a
    name never share a label)."""
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


SECTION_TYPES: dict[str, type] = section_types()
"""The config sections (TOML tables) in declaration order and their dataclasses, e.g. "learner": LearnerConfig."""
