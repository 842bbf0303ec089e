"""The fields of a metrics.jsonl record: each top-level key with a one-line description (type, units, nested keys).

Role: the one list of the record's keys, for people and for docs/reference/metrics.md (arpo_cli.reference_docs
renders it). arpo_async imports nothing of learner/, so the list is written out here; the code that builds the
record is learner.train.records.step_record (every record), learner.train.loop.TrainingLoop.train (the schedule
counters passed to step_record, ``resumed_from``, ``checkpoint_s``) and learner.rollouts.evaluation_rounds (the
``eval_*`` fields, EvaluationRounds.result_of). tests/unit/test_reference_docs.py checks this list against a record that
step_record builds and against the keys those callers add (read from their source).
Invariant: every key a record can carry is in :data:`METRIC_FIELDS`, and every key in it can be carried.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MetricField:
    """One top-level key of a metrics.jsonl record: what it holds (``description``, one line: meaning, type,
    units, and the keys of a nested dict) and which records carry it (``when``, one of :data:`WHEN`)."""

    description: str
    when: str = "every"


WHEN: dict[str, str] = {
    "every": "every record of a trained batch (learner.train.records.step_record); the evaluation record a run "
             "that stops as solved ends with has step, policy_version and wall_s of them, and nothing else but "
             "the eval fields (learner.train.records.evaluation_record)",
    "pump": "every record of a learner serving actors over ZeroMQ (`arpo-learner`, `arpo run`): step_record adds "
            "it when the learner service knows its socket pump",
    "loop": "every record the training loop writes (learner.train.loop.TrainingLoop.train passes them to "
            "step_record)",
    "checkpoint": "the record of a batch after which a checkpoint was written (learner.checkpoint_every)",
    "resume": "the first record after a resumed run restarts (`arpo run --resume`)",
    "eval": "the next record after each complete held-out evaluation round (a run with an [eval] section; "
            "learner.rollouts.evaluation_rounds); the round on the final weights of a run that stops before "
            "learner.steps because every task is solved comes in a record of its own after the last batch's, "
            "the evaluation record (learner.train.records.evaluation_record)",
}
"""When a field is present, by :attr:`MetricField.when` (the text says which code adds it)."""


METRIC_FIELDS: dict[str, MetricField] = {
    # learner.train.records.step_record: every record
    "step": MetricField("Optimizer steps in all after this batch (int); the x axis of curves and TensorBoard "
                        "(`global_step`)."),
    "policy_version": MetricField("The policy version the batch's new weights were published as (int)."),
    "trajectories": MetricField("Trajectories in the trained batch (int; replayed successes included)."),
    "success_rate": MetricField("SUCCESS trajectories over trainable trajectories received since the previous "
                                "record (float in [0, 1]; ENV_ERROR, TASK_ERROR and ABORTED never count; 0.0 when "
                                "none)."),
    "task_success": MetricField("{task id: success rate in [0, 1]} over that task's trainable trajectories of the "
                                "same window; tasks with none are left out."),
    "task_trajectories": MetricField("{task id: trainable trajectories in the window} (ints), for the same tasks as "
                                     "task_success."),
    "family_success": MetricField("{task family: success rate in [0, 1]} over its tasks' trainable trajectories of "
                                  "the window (families as in arpo_async.tasks.Task.family)."),
    "task_errors": MetricField("{task id: TASK_ERROR trajectories in the window} (ints), for the tasks with any."),
    "batch_success_rate": MetricField("Mean over the batch's groups of their success rate as sampled, before replay "
                                       "injection (float in [0, 1])."),
    "reward_mean": MetricField("Mean reward of the batch's trajectories (float)."),
    "loss": MetricField("The trainer's loss on the batch (float; learner.train.trainer.Trainer.train_batch)."),
    "grad_norm": MetricField("Gradient norm before clipping (float; null when the trainer reports none or it is "
                             "not finite)."),
    "clip_frac": MetricField("Fraction of tokens where PPO's clipped term was taken (float in [0, 1]; null when "
                             "not reported)."),
    "entropy": MetricField("Mean entropy (nats) of the policy's next-token distribution over the batch's trained "
                           "tokens, before the update and before any grammar mask (float; null when not reported; "
                           "learner.train.policy_forward.CompletionLogprobs). A fall toward 0 is a policy "
                           "collapsing onto one reply; a rise, one spreading out."),
    "lr": MetricField("The learning rate of the batch's optimizer steps (float; learner.lr, or where "
                      "learner.target_kl has moved it; null when not reported)."),
    "policy_kl": MetricField("KL per trained token between the policy before and after the batch's optimizer "
                             "steps (float, nats; null unless learner.target_kl > 0; learner.algo.kl_schedule)."),
    "step_scale": MetricField("The share of the batch's optimizer update kept by learner.max_kl's line search "
                              "(float: 1, 0.5, 0.25, ...; null unless learner.target_kl or max_kl > 0)."),
    "tokens": MetricField("Output tokens trained on in the batch (number; null when not reported)."),
    "train_s": MetricField("Seconds the optimizer step(s) on the batch took (float; null when not reported)."),
    "publish_s": MetricField("Seconds publishing the new weights to the inference servers took (float)."),
    "dropped_samples": MetricField("Samples of the batch the trainer could not use and dropped (number; 0 when "
                                   "none)."),
    "replay_injections": MetricField("Groups of the batch that got a replayed success injected (int)."),
    "demo_injections": MetricField("Of those, the groups whose injected success was a demonstration "
                                   "(learner.replay_demos; int)."),
    "staleness_mean": MetricField("Mean policy lag of the batch's fresh rollouts: the version at scoring minus "
                                  "the oldest token's version (float, versions; replayed successes left out)."),
    "staleness_min": MetricField("Smallest policy lag of the batch's fresh rollouts (int, versions)."),
    "staleness_max": MetricField("Largest policy lag of the batch's fresh rollouts (int, versions)."),
    "correction": MetricField("Off-policy correction statistics of the batch, those the trainer reported of "
                              "is_weight_mean, is_weight_max, is_capped_frac, behaviour_kl, replayed_tokens, "
                              "replayed_is_weight_mean, ratio_mean, approx_kl "
                              "(learner.algo.grpo.corrected_token_loss)."),
    "replay": MetricField("Replay buffer statistics: tasks (with a stored success), stored, injections; the "
                          "prioritized buffer adds low_success_injections, evicted, age_mean (versions), "
                          "length_mean (steps)."),
    "task_selection": MetricField("Task selector statistics: active, retired, picks, revisits, retirements, "
                                  "reactivations, unknown_groups (counts) and set_aside (task ids); {} without a "
                                  "selector."),
    "outcomes": MetricField("{outcome: trajectories received in the window} (SUCCESS, FAILURE, TRUNCATED, "
                            "ENV_ERROR, TASK_ERROR, ABORTED; absent outcomes left out)."),
    "drops": MetricField("Trajectories or groups not trained on since the run started, by reason (ints): stale, "
                         "zero_variance, group_too_small, unscorable (a group whose stages raised), and the lower-cased "
                         "non-trainable outcomes (env_error, task_error, aborted)."),
    "totals": MetricField("The run's counters (numbers): trajectories, from_desktop, acked, duplicates, late, "
                          "silent_peers, unusable_batches, eval_* counts and others, plus trajectories by outcome "
                          "(SUCCESS, FAILURE, ...)."),
    "rejections": MetricField("Messages refused since the run started, by reason (ints): the wire and content "
                              "checks' reasons (arpo_async.validation.InvalidMessage) and duplicate, owner, hello, "
                              "run, slots, task."),
    "stage_s": MetricField("Per-stage rollout timings of the window, {stage: {p50: s, p95: s, count: n}} for "
                           "reset, setup, screenshot, generate, execute, settle, evaluate, episode (stages with no "
                           "sample left out; arpo_async.stage_timings); settle (the wait for the screen to settle "
                           "after an action) adds timeout_share, the share of actions whose wait hit "
                           "actors.settle_timeout_s."),
    "queues": MetricField("Queue depths when the record was written (ints): inbox, waiting_requests, "
                          "waiting_max_peer, running, ready_groups, outbox, outbox_full_waits, and from the actors' "
                          "last heartbeats actor_running, actor_waiting, actor_unacked, actor_outbox (summed), "
                          "actor_outbox_max."),
    "queues_max": MetricField("Each of those queues' peak depth since the previous record (ints; sampled every "
                              "50 ms)."),
    "loop_lag_ms": MetricField("The learner's event-loop lag since the previous record: p50, p99, max (ms) and "
                               "samples (arpo_async.loop_lag)."),
    "wall_s": MetricField("Training wall time in all (float, seconds, rounded to ms)."),
    "messages": MetricField("Messages counted by the learner's ZeroMQ pump, {received: {type: n}, sent: {type: n}}.",
                            "pump"),
    # learner.train.loop.TrainingLoop.train: step_record's **extra
    "schedule": MetricField("The learner's schedule, \"async\" or \"lockstep\" (learner.schedule).", "loop"),
    "updates": MetricField("Optimizer steps this batch took (int; learner.updates_per_batch, fewer at the run's "
                           "end).", "loop"),
    "optimizer_steps": MetricField("The trainer's optimizer steps in all (int).", "loop"),
    "rollout_batches": MetricField("Rollout batches taken by the training loop so far (int).", "loop"),
    "skipped_batches": MetricField("Rollout batches that led to no optimizer step so far (int: no group with "
                                   "reward variance, or no usable sample).", "loop"),
    "checkpoint_s": MetricField("Seconds writing the checkpoint after this batch took (float).", "checkpoint"),
    "resumed_from": MetricField("What was resumed: {checkpoint (folder name), step, policy_version, trainer_steps, "
                                "replay (buffer statistics), rolled_back_records}.", "resume"),
    # learner.rollouts.evaluation_rounds.EvaluationRounds.result_of
    "eval_score": MetricField("The round's mean score: the mean of the episode scores over all its episodes, "
                              "errored ones 0 (float in [0, 1]; OSWorld's number, as arpo eval's score_mean; the "
                              "curve's held-out points).", "eval"),
    "eval_task_score": MetricField("{task id: mean score in [0, 1] over its episodes, errored ones 0} of the "
                                   "round.", "eval"),
    "eval_score_ran": MetricField("The mean score over the round's episodes that did not error (float in [0, 1], "
                                  "as OSWorld's show_result.py; null when every one errored).", "eval"),
    "eval_success": MetricField("SUCCESS episodes (score above learner.success_threshold) over all episodes of the "
                                "round (float in [0, 1]; errors count as failures): the success rate at the "
                                "threshold, kept beside eval_score.", "eval"),
    "eval_task_success": MetricField("{task id: success rate in [0, 1]} of the round.", "eval"),
    "eval_policy_version": MetricField("The policy version the round was handed out at (int).", "eval"),
    "eval_step": MetricField("The optimizer step whose weights were evaluated (int; the record's own step is "
                             "that step or later).", "eval"),
    "eval_episodes": MetricField("Episodes in the round (int).", "eval"),
    "eval_errors": MetricField("Episodes of the round that ended ENV_ERROR, TASK_ERROR or ABORTED (int).", "eval"),
    "eval_version_max": MetricField("The newest policy version among the round's tokens (int; later than "
                                    "eval_policy_version when weights were published during the round).", "eval"),
    "eval_s": MetricField("The round's wall time (float, seconds).", "eval"),
}
"""Every top-level key of a metrics.jsonl record, in the order the record is built."""
