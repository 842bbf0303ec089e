"""`arpo run`'s progress display: one live status line in a terminal, plain lines in a pipe or CI.

Owns: what the progress line says and how often it is shown. The line is built from the learner's
``<run>/status.json`` (rewritten every second) and ``<run>/metrics.jsonl``: step, policy version, trajectories
(total and per minute over the last ``RATE_WINDOW_S``), success rate (last step and trailing mean), loss, policy
lag (the last step's staleness_mean), desktops busy (rollouts the actors report running, of
``actors.actors``), the share of groups dropped for having no reward difference (:func:`flat_text`; DAPO's dynamic
sampling, arXiv:2503.14476, drops them and waits for more) and whether the next step waits for groups that have
one, and the tasks set aside as solved. :func:`stop_line` is the learner's reason for ending early, if any. In a
terminal the line is redrawn in place (rich.live); otherwise a plain line is printed when it changed, at most every
``PLAIN_EVERY_S`` and at least every ``PLAIN_HEARTBEAT_S`` seconds.
"""

from __future__ import annotations

import collections
import json
import sys
import time
from typing import Any, Protocol, TextIO

from arpo_async.config import RunConfig
from arpo_async.metrics import read_metrics, training_records

TRAILING_SUCCESS_STEPS = 10
"""The progress line's trailing success rate is the mean over this many last metrics records."""
RATE_WINDOW_S = 60.0
"""Trajectories per minute are measured over this many last seconds."""
PLAIN_EVERY_S = 5.0
"""Not a terminal: a changed progress line is printed at most this often (seconds)."""
PLAIN_HEARTBEAT_S = 30.0
"""Not a terminal: the progress line is printed at least this often, changed or not (seconds)."""


class TrajectoryRate:
    """Trajectories per minute over the last ``window_s`` seconds, from a running total sampled over time."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._samples: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, now: float, total: int) -> float:
        """Record the running total ``total`` at monotonic time ``now`` (seconds); returns trajectories/min over
        the samples of the last ``window_s`` (0.0 until two samples are 1 s or more apart)."""
        self._samples.append((now, total))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        (t0, n0), (t1, n1) = self._samples[0], self._samples[-1]
        return max(0, n1 - n0) * 60.0 / (t1 - t0) if t1 - t0 >= 1.0 else 0.0


def success_text(records: list[dict]) -> str:
    """The progress line's success part: the last record's success rate and the mean over the last
    ``TRAILING_SUCCESS_STEPS`` records, e.g. ``success 0.45 (last 10 steps 0.38)``; nan before the first step."""
    rates = [r["success_rate"] for r in records[-TRAILING_SUCCESS_STEPS:] if r.get("success_rate") is not None]
    last = records[-1].get("success_rate") if records else None
    trailing = sum(rates) / len(rates) if rates else float("nan")
    return (f"success {last if last is not None else float('nan'):.2f} "
            f"(last {TRAILING_SUCCESS_STEPS} steps {trailing:.2f})")


def flat_text(status: dict[str, Any], groups_per_step: int) -> str:
    """The progress line's part on groups without a reward difference (all rewards equal: no gradient, dropped),
    from status.json: `` | no reward difference: 120 of 200 groups (60%)`` once any group was scored, plus
    `` | the next step waits for groups with a reward difference (12 since step 40 had none)`` while at least
    ``groups_per_step`` of them came back since the last step (a step needs that many with one); "" before any."""
    groups = int(status.get("totals", {}).get("groups", 0))
    flat = int(status.get("drops", {}).get("zero_variance", 0))
    if not groups:
        return ""
    text = f" | no reward difference: {flat} of {groups} groups ({100 * flat / groups:.0f}%)"
    since = int(status.get("zero_variance_since_step", 0))
    if since >= groups_per_step:
        step = int(status.get("step", 0))
        text += (f" | the next step waits for groups with a reward difference ({since} since "
                 f"{f'step {step}' if step else 'the start'} had none)")
    return text


def stop_line(config: RunConfig) -> str:
    """Why the learner ended the run early (status.json ``stopped``, e.g. ``every task is solved in its last 4
    groups: training stops (learner.stop_when_solved = false keeps it going)``); "" when it did not."""
    try:
        status = json.loads((config.run_path / "status.json").read_text())
    except (OSError, json.JSONDecodeError):
        return ""
    stopped = status.get("stopped") if isinstance(status, dict) else None
    return stopped if isinstance(stopped, str) else ""


def _number(record: dict[str, Any], key: str) -> float:
    value = record.get(key)
    return float(value) if isinstance(value, (int, float)) else float("nan")


def progress_line(config: RunConfig, started: float, rate: TrajectoryRate | None = None,
                  now: float | None = None) -> str:
    """One line, e.g. ``[  42s] step 3/10 version 3 | trajectories 48 (21.0/min) | success 0.25 (last 10 steps
    0.20) loss 0.0123 lag 0.50 | held-out 0.38 (step 20) | evaluating step 40: 3/8 | desktops 6/8 busy |
    failure=30 success=18``, plus the groups without a reward difference (:func:`flat_text`), the tasks set aside as
    solved or after task errors, and the stall reason, if any. The held-out
    part shows the last evaluation round recorded ([eval]) and the round in progress, when there are.

    ``started`` and ``now``: monotonic seconds (``now`` defaults to the clock); ``rate`` measures trajectories
    per minute across calls (None: the rate is left out).
    """
    now = time.monotonic() if now is None else now
    everything = read_metrics(config.run_path / "metrics.jsonl")
    records = training_records(everything)  # the evaluation record of a solved run has no training field
    try:
        status = json.loads((config.run_path / "status.json").read_text())
    except (OSError, json.JSONDecodeError):
        status = {}
    steps = config.learner.steps or "inf"
    last = records[-1] if records else {}
    trajectories = int(status.get("trajectories", 0))
    version = max(int(status.get("policy_version", 0)), int(last.get("policy_version") or 0))  # either may lag
    per_min = f" ({rate.add(now, trajectories):.1f}/min)" if rate is not None else ""
    busy = status.get("queues", {}).get("actor_running", status.get("running", 0))
    outcomes = " ".join(f"{k.lower()}={v}" for k, v in sorted(status.get("outcomes", {}).items()))
    prepass = status.get("prepass") or status.get("baseline")  # "baseline": a status.json of a run before issue 52
    phase = (f"task pre-pass {prepass['groups_recorded']}/{prepass['groups_planned']} groups | "
             if prepass else "")
    step = int(last.get("step") or len(records))  # optimizer steps: a record covers updates_per_batch of them
    evaluating = status.get("evaluation") or {}
    newest = everything[-1] if everything else {}  # the last record, the evaluation record of a solved run too
    held_out = (f" | held-out {newest['eval_success']:.2f} (step {newest.get('eval_step', '?')})"
                if isinstance(newest.get("eval_success"), (int, float)) else "")
    if held_out and isinstance(newest.get("eval_score"), (int, float)):  # the mean score first (OSWorld's number)
        held_out = (f" | held-out score {newest['eval_score']:.2f}, success {newest['eval_success']:.2f} "
                    f"(step {newest.get('eval_step', '?')})")
    if "episodes" in evaluating:
        held_out += f" | evaluating step {evaluating['step']}: {evaluating['episodes_back']}/{evaluating['episodes']}"
    return (f"[{now - started:6.0f}s] {phase}step {step}/{steps} "
            f"version {version} | trajectories {trajectories}{per_min} | "
            f"{success_text(records)} loss {_number(last, 'loss'):.4f} lag {_number(last, 'staleness_mean'):.2f}"
            f"{held_out} | desktops {busy}/{config.actors.actors} busy | {outcomes}"
            + flat_text(status, config.learner.groups_per_step)
            + (f" | solved (set aside): {', '.join(map(str, status['solved']))[:200]}" if status.get("solved") else "")
            + (f" | SET ASIDE (task errors): {', '.join(map(str, status['set_aside']))[:200]}"
               if status.get("set_aside") else "")
            + (f" | STALLED: {status['stall']}" if status.get("stall") else ""))


class ProgressDisplay(Protocol):
    """Where `arpo run` shows its progress line and its messages."""

    def update(self, line: str, now: float, *, force: bool = False) -> None:
        """Show the current progress line (``now``: monotonic seconds; ``force``: the final line, shown even
        where lines are rate-limited)."""

    def say(self, text: str) -> None:
        """Show a message (kept on screen, above a live line)."""

    def close(self) -> None:
        """Leave the last line on screen and stop redrawing."""


class PlainLines:
    """Progress for pipes, files and CI logs: whole lines, a changed line at most every ``every_s`` seconds and
    any line at least every ``heartbeat_s`` seconds (the elapsed-time prefix does not count as a change)."""

    def __init__(self, stream: TextIO, every_s: float = PLAIN_EVERY_S,
                 heartbeat_s: float = PLAIN_HEARTBEAT_S) -> None:
        self.stream, self.every_s, self.heartbeat_s = stream, every_s, heartbeat_s
        self._state, self._said_at = "", float("-inf")

    def update(self, line: str, now: float, *, force: bool = False) -> None:
        state = line.split("]", 1)[-1]
        since = now - self._said_at
        if force or (state != self._state and since >= self.every_s) or since >= self.heartbeat_s:
            self.say(line)
            self._state, self._said_at = state, now

    def say(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def close(self) -> None:
        pass


class LiveLine:
    """Progress for a terminal: one status line redrawn in place (rich.live.Live); messages print above it."""

    def __init__(self, stream: TextIO) -> None:
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text

        self._text = Text
        self.console = Console(file=stream)
        self.live = Live(Text(""), console=self.console, auto_refresh=False, transient=False)
        self.live.start()

    def update(self, line: str, now: float, *, force: bool = False) -> None:
        self.live.update(self._text(line), refresh=True)  # wraps on a narrow terminal; redrawn whole

    def say(self, text: str) -> None:
        self.console.print(self._text(text))

    def close(self) -> None:
        self.live.stop()


def open_display(stream: TextIO | None = None) -> ProgressDisplay:
    """A LiveLine when ``stream`` (default: stdout) is a terminal, else PlainLines."""
    stream = sys.stdout if stream is None else stream
    return LiveLine(stream) if stream.isatty() else PlainLines(stream)
