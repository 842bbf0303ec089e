"""Metrics records: what one training batch writes to metrics.jsonl (and TensorBoard, arpo_async.metrics), and the
evaluation record of a run that stops as solved (:func:`evaluation_record`).

Role: pure functions from values to a record; they read no component. Owns the record's keys (documented in
:func:`step_record`; every key a record can carry, those its callers add included, is described in
arpo_async.metric_fields, which tests/unit/test_reference_docs.py checks against a record built here) and the
success-rate rule: SUCCESS trajectories over trainable trajectories (ENV_ERROR, TASK_ERROR and ABORTED never
count). SUCCESS is the actor's outcome for a score above ``learner.success_threshold``
(:func:`arpo_async.success.is_success`, as for the batch, replay and task-selection counts).
"""

from __future__ import annotations

import collections
from typing import Any, Mapping

from arpo_async.demos import is_demonstration
from arpo_async.messages import Outcome
from learner.algo.batcher import ScoredGroup
from learner.rollouts.run_stats import WindowStats

CORRECTION_STATS = ("is_weight_mean", "is_weight_max", "is_capped_frac", "behaviour_kl", "replayed_tokens",
                    "replayed_is_weight_mean", "ratio_mean", "approx_kl")
"""Trainer statistics copied into each metrics record (see learner.algo.grpo.corrected_token_loss)."""


def success_rate(outcomes: Mapping[str, int]) -> tuple[float, int]:
    """(SUCCESS count / trainable count, trainable count) of outcome counts (Outcome value -> trajectories);
    (0.0, 0) when none is trainable (ENV_ERROR, TASK_ERROR and ABORTED never are)."""
    trainable = sum(n for outcome, n in outcomes.items() if Outcome(outcome).trainable)
    return (outcomes.get(Outcome.SUCCESS.value, 0) / trainable if trainable else 0.0), trainable


def per_task_success(window: WindowStats) -> dict[str, dict[str, float | int]]:
    """Per-task and per-family success of a window, as metrics.jsonl keys.

    Returns:
        ``task_success`` {task id: success rate in [0, 1]}, ``task_trajectories`` {task id: trainable
        trajectories} and ``family_success`` {family: success rate over its tasks' trainable trajectories}; tasks
        and families with no trainable trajectory in the window are left out. ``task_errors`` {task id: its
        TASK_ERROR trajectories in the window}, for the tasks with any.
    """
    by_family: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for task_id, outcomes in window.task_outcomes.items():
        by_family[window.families[task_id]].update(outcomes)
    per_task = {task_id: success_rate(outcomes) for task_id, outcomes in sorted(window.task_outcomes.items())}
    per_family = {family: success_rate(outcomes) for family, outcomes in sorted(by_family.items())}
    return {"task_success": {k: rate for k, (rate, n) in per_task.items() if n},
            "task_trajectories": {k: n for k, (rate, n) in per_task.items() if n},
            "family_success": {k: rate for k, (rate, n) in per_family.items() if n},
            "task_errors": {k: n for k, outcomes in sorted(window.task_outcomes.items())
                            if (n := outcomes.get(Outcome.TASK_ERROR.value, 0))}}


def step_record(step: int, version: int, batch: list[ScoredGroup], stats: Mapping[str, Any],
                window: WindowStats, counters: Mapping[str, Any], publish_s: float, wall_s: float,
                **extra: Any) -> dict[str, Any]:
    """One metrics.jsonl record.

    Args:
        step: optimizer steps in all after this batch; version: the policy version it published.
        batch: the scored groups trained on (non-empty).
        stats: the trainer's statistics of the batch (``loss`` required; learner.train.trainer.Trainer.train_batch).
        window: what arrived since the last batch: success_rate (and task_success, family_success) is over its
            trainable trajectories, stage_s is p50/p95 of its per-stage timings (arpo_async.stage_timings).
        counters: the learner's counters now (learner.rollouts.status.StatusReport.counters): ``replay``,
            ``task_selection``, ``drops``, ``totals``, ``rejections``, ``queues`` (queue depths now),
            ``queues_max`` (each queue's peak since the previous record), ``loop_lag_ms`` (the event loop's lag
            since the previous record: p50, p99, max in ms, samples; arpo_async.loop_lag) and, when the
            service knows its pump, ``messages`` (received and sent, by type).
        publish_s, wall_s: seconds the publication took; training wall time in all.
        extra: schedule-level counters, added as they are.

    staleness_* is the policy lag of the batch's fresh rollouts (replayed successes are old by design and left
    out).
    """
    rewards = [r for g in batch for r in g.rewards]
    lags = [lag for g in batch for lag in g.fresh_policy_lag] or [0]
    return {
        "step": step, "policy_version": version,
        "trajectories": sum(len(g.trajectories) for g in batch),
        "success_rate": success_rate(window.outcomes)[0], **per_task_success(window),
        "batch_success_rate": sum(g.sampled_success for g in batch) / len(batch),
        "reward_mean": sum(rewards) / len(rewards),
        "loss": stats["loss"], "grad_norm": stats.get("grad_norm"), "clip_frac": stats.get("clip_frac"),
        "entropy": stats.get("entropy"), "lr": stats.get("lr"), "policy_kl": stats.get("policy_kl"),
        "step_scale": stats.get("step_scale"),
        "tokens": stats.get("tokens"), "train_s": stats.get("seconds"), "publish_s": publish_s,
        "dropped_samples": stats.get("dropped_samples", 0.0),
        "replay_injections": sum(g.injected for g in batch),
        "demo_injections": sum(flag and is_demonstration(t) for g in batch
                               for t, flag in zip(g.trajectories, g.replayed)),
        "staleness_mean": sum(lags) / len(lags), "staleness_max": max(lags), "staleness_min": min(lags),
        "correction": {k: stats[k] for k in CORRECTION_STATS if k in stats},
        "replay": counters["replay"], "task_selection": counters["task_selection"],
        "outcomes": dict(window.outcomes), "drops": counters["drops"], "totals": counters["totals"],
        "rejections": counters["rejections"],
        "stage_s": window.stages.summary(), "queues": counters["queues"],
        "queues_max": counters["queues_max"], "loop_lag_ms": counters["loop_lag_ms"],
        **({"messages": counters["messages"]} if "messages" in counters else {}),
        "wall_s": round(wall_s, 3), **extra,
    }


def evaluation_record(step: int, version: int, result: Mapping[str, Any], wall_s: float) -> dict[str, Any]:
    """The evaluation record: the one metrics.jsonl record that is not a trained batch's. A run that stops before
    ``learner.steps`` because every task is solved (learner.train.loop.TrainingLoop.stop_solved) has written its
    last batch's record before it knew it was the last, so the final held-out round's result follows it in a
    record of its own: ``step`` and ``policy_version`` of the last batch (the final weights), ``wall_s`` (training
    wall time in all, seconds, now) and the round's fields (``result``: learner.rollouts.evaluation_rounds.RESULT_KEYS,
    ``eval_success`` required); no training field (arpo_async.metrics.EVALUATION_RECORD_KEYS,
    :func:`arpo_async.metrics.is_training_record`).

    Raises:
        ValueError: ``result`` has no ``eval_success`` (not a complete round's fields).
    """
    if "eval_success" not in result:
        raise ValueError(f"an evaluation record needs a complete round's fields, got {sorted(result)}")
    return {"step": step, "policy_version": version, **result, "wall_s": round(wall_s, 3)}
