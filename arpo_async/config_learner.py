"""The run config's [learner] section (:class:`LearnerConfig`): groups, batches, optimiser, replay, publishing.

Declared with arpo_async.config_fields.config_section like every section; loaded, overridden and written by
arpo_async.config, which re-exports it. Every field has an attribute docstring (`arpo config show` prints it).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

from arpo_async.config_fields import Fraction, Strings, config_section
from arpo_async.success import DEFAULT_SUCCESS_THRESHOLD

__all__ = ["Correction", "LearnerConfig"]

Correction = Literal["arpo", "decoupled", "tis", "behaviour"]
"""learner.algo.grpo.CORRECTION_MODES. This module imports nothing of learner/ or arpo_serve/, so a choice their code
also lists is spelt out here; tests/unit/test_config.py checks each such Literal against the code's tuple."""


@config_section("learner")
class LearnerConfig:
    """GRPO learner: groups, batches, optimiser, replay, publishing."""

    tasks: str = ""
    """Folder or file of OSWorld-format task JSON; empty = the built-in suite."""
    osworld_files: str = ""
    """Local mirror of OSWorld's task files (its file cache's layout, <domain>/<task id>/<file name>, or files
    named by their Google Drive id), looked up before the network by `download` setup steps and `cloud_file`
    getters, so a user who has them runs OSWorld's tasks offline; empty = none (actors.osworld.downloads)."""
    split: str = ""
    """A split that cuts `tasks`: a split file ({domain: [task id, ...]}, OSWorld's test_all.json form) or a named
    set (arpo-128: ARPO's training tasks, osworld-369, osworld-361; `arpo tasks splits`); every task it lists must
    load. Empty = every task of `tasks`."""
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
    target_kl: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    """Adaptive learning rate: after each rollout batch the policy's KL per token between before and after the
    batch's optimizer steps is measured (one extra forward pass over the batch, two with updates_per_batch = 1),
    and the learning rate is divided by 1.5 when it was above 2 x target_kl and multiplied by 1.5 when below half,
    within [lr / 100, lr] (learner.algo.kl_schedule; rsl_rl's "adaptive" schedule). 0 = the rate stays lr."""
    max_kl: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    """Trust region per rollout batch: an update that moved the policy by more than this KL per trained token
    (measured as for target_kl) is halved until it does not, at most 6 times (TRPO's backtracking line search;
    learner.train.trainer.Trainer.train_batch). Keeps a copy of the parameters (one more model's worth of float32
    memory per rank) and costs one forward pass over the batch per halving. 0 = off."""
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
    publish_dtype: Literal["served", "float32"] = "served"
    """The dtype of the weights the learner publishes: "served" casts them to the dtype each inference server holds
    its weights in (GET /get_server_info "dtype"; "auto" resolved as SGLang does), so a bf16 server gets half the
    bytes of float32; "float32" sends the learner's float32 master weights (the server casts them on load)."""
    advantage_function: str = ""
    """Another advantage rule, as "package.module:function" (importable by the learner), called once per scored
    group with (a copy of the rewards: float64 array of shape (G,), task_id) in a thread of its own, within 60 s,
    and returning G finite real numbers of magnitude at most 1e6 (else the learner stops, naming it); "" = GRPO's
    (reward - mean) / (std + eps). Like slime's --custom-advantage-function-path (learner.algo.advantages). Trusted
    code: it is imported and run in the learner with its rights (any importable callable loads, os:system too), so
    whoever writes the run file or its --set overrides runs code in the learner."""
    replay: bool = True
    """ARPO's success replay: inject a stored success into all-failed groups."""
    replay_capacity: PositiveInt = 8
    """Successes kept per task (ARPO: 8, oldest evicted first)."""
    replay_mode: Literal["arpo", "prioritized", "off"] = "prioritized"
    """"arpo" (ARPO-exact: FIFO per task, uniform draw, all-failed groups only), "prioritized" or "off";
    replay = false forces "off"."""
    replay_demos: str = ""
    """Demonstrations: an `arpo eval --out` folder whose successful episodes are put in the success replay at the
    start (not on resume: the checkpoint holds them), re-tokenized with this run's prompt (arpo_async.demos); they
    are injected into all-failed groups like the policy's own successes. "" = none. Needs the replay on."""
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
    (PPO ratio against the sampler's log-probs); see learner.algo.grpo.corrected_token_loss."""
    decoupled_cap: Annotated[float, Field(gt=1, allow_inf_nan=False)] = 5.0
    """"decoupled": tokens with pi_prox / pi_behav above this are left out of the loss (AReaL examples: 5.0)."""
    tis_cap: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 2.0
    """"tis": pi_prox / pi_behav is truncated at this (slime --tis-clip default: 2.0)."""
    prepass_k: NonNegativeInt = 0
    """Task pre-pass: rollouts per task with the initial policy before training, never trained on, keeping tasks
    with a success (ARPO's valuable tasks); 0 = no pre-pass. Formerly ``baseline_k``: a config file or ``--set``
    with the old name is still read, with a warning."""
    prepass_min_success: PositiveInt = 1
    """Task pre-pass: successes a task needs to be kept (ARPO: 1). Formerly ``baseline_min_success`` (still read,
    with a warning)."""
    prepass_drop_solved: bool = False
    """Task pre-pass: also drop tasks solved in all k rollouts (they give only zero-variance groups). Formerly
    ``baseline_drop_solved`` (still read, with a warning)."""
    task_strategy: Literal["round_robin", "uncertainty"] = "round_robin"
    """Online task choice among active tasks: "round_robin" (shuffled, seeded) or "uncertainty" (weight p(1-p))."""
    task_solved_groups: PositiveInt = 4
    """A task's window: its last this many complete groups. A task is solved when at least task_solved_rate of
    them had every rollout succeed (no reward difference, nothing to learn: DAPO's dynamic sampling drops such
    groups); a solved task is set aside (retired), as ARPO's task filter sets aside tasks always solved."""
    task_solved_rate: Annotated[float, Field(gt=0, le=1)] = 1.0
    """Share of the task_solved_groups groups that must have every rollout succeed for the task to be solved (1.0:
    all of them). Success is the evaluator's score above success_threshold, never the reward."""
    task_retire: bool = True
    """Set aside (retire) solved tasks; false keeps every task in the rotation, and the run is never solved."""
    task_revisit_every: NonNegativeInt = 10
    """Every this many groups one goes to a retired task, to check it is still solved; it is reactivated when
    it is not (0 = never)."""
    task_revisit_prob: Fraction = 0.0
    """Probability that a group goes to a retired task (in addition to task_revisit_every; 0 = never)."""
    stop_when_solved: bool = True
    """End the run when every task is solved in its last task_solved_groups groups (all retired): training
    stops as after learner.steps (checkpoint, weights, curve) and `arpo run` exits 0. False keeps it going,
    cycling through the solved tasks. Needs task_retire."""
    task_error_limit: NonNegativeInt = 3
    """A task whose rollouts end in TASK_ERROR (its setup, getter or metric is broken) this many times in a row is
    set aside for the rest of the run and named in metrics and on the progress line (0 = never)."""
    format_reward_weight: float = 0.5
    """reward = score + weight x format reward (format reward -1 when a reply does not parse; ARPO: 0.5)."""
    success_threshold: Annotated[float, Field(ge=0, lt=1)] = DEFAULT_SUCCESS_THRESHOLD
    """An episode is a success when its evaluator score is strictly above this (arpo_async.success.is_success), for
    every count: the actors' Outcome.SUCCESS, success rates, replay, task selection and the task pre-pass. Default
    ARPO's replay rule, score > 0.1 (github.com/dvlab-research/ARPO); actors read it too, so give them the same file."""
    rollout_retries: NonNegativeInt = 2
    """A rollout that ends in ENV_ERROR or ABORTED is handed out again this many times before its group goes on
    without it."""
    torch_threads: PositiveInt = 1
    """Threads for torch on the learner, per rank (the desktops need the other cores)."""
    device: Literal["auto", "cpu", "cuda"] = "cpu"
    """Where the learner trains: "cpu", "cuda" (each torchrun rank takes cuda:LOCAL_RANK) or "auto" (cuda when
    available). "cuda" on a machine without CUDA stops the learner at start with an error naming this key."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """"float32" or "bfloat16": bf16 parameters and activations in the forward and backward passes, with float32
    master weights, AdamW state, gradient reduction and log-softmax (learner.train.trainer)."""
    gradient_checkpointing: bool = False
    """Recompute decoder-layer activations in the backward pass (less memory for long multi-screenshot prompts,
    about a third more compute)."""
    max_tokens_per_microbatch: NonNegativeInt = 16384
    """Padded tokens per forward/backward pass: each step's samples are packed longest first under this budget and
    gradients accumulated; the step is the same for any value (0 = each rank's share in one pass). A sample longer
    than the budget stops the learner with an error naming this key."""
    logprob_chunk_tokens: PositiveInt = 1024
    """Completion tokens the trainer projects to the vocabulary at once (learner.train.policy_forward): peak extra
    memory chunk x vocab x 4 B of fp32 logits; the log-probs are the same for any value."""
    weight_sync: Literal["disk", "distributed"] = "disk"
    """How new weights reach the inference servers: "disk" (a weights folder per version, then
    /update_weights_from_disk) or "distributed" (broadcast over a process group per server, SGLang's
    /init_weights_update_group + /update_weights_from_distributed; nothing written to disk)."""
    sync_bucket_mb: PositiveFloat = 512.0
    """"distributed": most megabytes of tensors per /update_weights_from_distributed request."""
    sync_host: str = "127.0.0.1"
    """"distributed": the address the inference servers reach the learner's rank 0 at (master_address)."""
    sync_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """"distributed": "gloo", "nccl" or "auto" (nccl when learner.device is cuda, else gloo; arpo-serve takes gloo on
    the CPU, either on CUDA)."""
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
    with the learner's own (0 = never). A server that cannot check (success=false, e.g. one back after being down)
    or whose checksums differ is sent the whole weights again and checked once more; only checksums that still
    differ stop the learner, with an error naming the server; one that still cannot check is checked next time."""
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
    """Published weight folders kept on disk (older ones are deleted), besides weights/v0: the weights the run
    started from, written before the first step and never deleted, so `arpo eval --model RUN/weights/v0` scores the
    untrained policy (learner.weight_sync = "disk" only: "distributed" writes no weights folder)."""
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
    a hash of the trajectory id; 0 = none). Every task's first success is kept besides
    (learner.rollouts.trajectory_sample)."""
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
