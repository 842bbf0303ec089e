"""Per-stage timing aggregates of the trajectories received in one optimizer-step window.

Owns: the stage names of metrics.jsonl's ``stage_s`` and how a trajectory's timings map onto them:

============  ==============================================  ==============================
stage         what it times                                   from
============  ==============================================  ==============================
reset         a fresh desktop for the episode                 Trajectory.timings["reset_s"]
setup         the task's OSWorld setup steps                  Trajectory.timings["setup_s"]
screenshot    one observation (screenshot) per policy step,   Step.observe_s
              the wait for the screen to settle included
generate      one policy reply per step (inference latency)   Step.generate_s
execute       one action executed on the desktop per step     Step.act_s
settle        the wait for the screen to settle after one     Step.settle_s
              action (actors.settle); with ``timeout_share``  (Step.settle_timed_out)
evaluate      the evaluator on the final desktop state        Trajectory.timings["evaluate_s"]
episode       the whole rollout, setup to evaluation          Trajectory.timings["episode_s"]
============  ==============================================  ==============================

Per-trajectory stages count once per trajectory that has the timing; per-step stages once per step whose field
is above 0 (0.0 is Step's default: not measured, e.g. no action executed after "finished" or an unparsable
reply). A stage with no sample in the window is left out. ``settle`` also has ``timeout_share``: the share of its
samples (actions) whose wait ended at ``actors.settle_timeout_s`` with the screen still changing, so a run shows
what settling costs (a screen that never settles costs the whole timeout on every step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from arpo_async.messages import Trajectory

TRAJECTORY_STAGES = {"reset": "reset_s", "setup": "setup_s", "evaluate": "evaluate_s", "episode": "episode_s"}
"""Stage name -> key of Trajectory.timings (seconds)."""
STEP_STAGES = {"screenshot": "observe_s", "generate": "generate_s", "execute": "act_s", "settle": "settle_s"}
"""Stage name -> attribute of arpo_async.messages.Step (seconds)."""


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0 <= q <= 100) of ``values``: ``numpy.percentile`` (its default "linear" method,
    position (n - 1) * q / 100 of the sorted values), as a float.

    Raises:
        ValueError: ``values`` is empty or ``q`` is outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q} is outside [0, 100]")
    return float(np.percentile(values, q))


@dataclass
class StageTimings:
    """Seconds per stage of the trajectories added since this window began."""

    samples: dict[str, list[float]] = field(default_factory=dict)
    """Stage name -> every duration seen, in seconds."""
    settle_timeouts: int = 0
    """Of the ``settle`` samples, those whose wait hit the timeout (Step.settle_timed_out)."""

    def add(self, traj: Trajectory) -> None:
        """Add the stage timings of one received trajectory (non-finite, negative or unmeasured ones are skipped)."""
        for stage, key in TRAJECTORY_STAGES.items():
            self._add(stage, traj.timings.get(key), minimum=0.0)
        for step in traj.steps:
            for stage, attr in STEP_STAGES.items():
                if self._add(stage, getattr(step, attr, None), minimum=math.ulp(0.0)) and stage == "settle":
                    self.settle_timeouts += getattr(step, "settle_timed_out", False) is True

    def _add(self, stage: str, seconds: object, minimum: float) -> bool:
        """Add one sample when it is a finite number of seconds >= ``minimum``; returns whether it was added."""
        if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and math.isfinite(seconds) \
                and seconds >= minimum:
            self.samples.setdefault(stage, []).append(float(seconds))
            return True
        return False

    def summary(self) -> dict[str, dict[str, float | int]]:
        """``{stage: {"p50": s, "p95": s, "count": n}}`` for every stage with samples (seconds, rounded to us);
        ``settle`` adds ``"timeout_share"``: ``settle_timeouts / count`` (in [0, 1], rounded to 1e-6)."""
        summary = {stage: {"p50": round(percentile(values, 50), 6), "p95": round(percentile(values, 95), 6),
                           "count": len(values)}
                   for stage, values in sorted(self.samples.items())}
        if "settle" in summary:
            summary["settle"]["timeout_share"] = round(self.settle_timeouts / summary["settle"]["count"], 6)
        return summary
