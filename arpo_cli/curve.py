"""The learning curve of a run: ``<run>/curve.png`` drawn from ``<run>/metrics.jsonl``.

Owns: the picture. A 2 x 2 grid: success rate (overall, and one line per task family from ``family_success``) and
``reward_mean``, against the optimizer step (top row) and against training wall time in minutes (bottom row). Lines
are trailing means over ``TRAILING_RECORDS`` records; the raw overall success rate of each record is shown as faint
dots. A run with ``[eval]`` also shows each held-out round once, as large markers joined by a dashed line, at the
step whose weights were evaluated (``eval_step``): its mean score (``eval_score``, errored episodes 0: OSWorld's
number, as ``arpo eval``'s score_mean), or its success rate (``eval_success``) in a run from before eval_score.
Drawn with matplotlib's Agg canvas (no display, no pyplot state), written atomically so a viewer never sees half a
file. ``arpo run`` redraws it while it runs and at the end; ``arpo curve`` on demand.

Also the comparison of several runs (``arpo curve RUN_DIR RUN_DIR ... --to FILE``, :func:`write_comparison`): each
run's overall success against the optimizer step and against minutes, one line per run. A run that never took an
optimizer step (no metrics record: a task nobody solves gives no reward difference) is drawn from its
``status.json`` as a flat line at its episodes' success rate over its wall time, labelled with its episode count.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from arpo_async.metrics import read_metrics

CURVE_FILE = "curve.png"
TRAILING_RECORDS = 5
"""Records in each trailing mean of the curve's lines."""
X_AXES = (("step", "optimizer step", True), ("minutes", "training wall time (min)", False))
"""(Series attribute, axis label, whole-number ticks) of each row of panels."""


class CurveError(ValueError):
    """The run folder has nothing to draw (no metrics.jsonl, or no record in it); the message names the file."""


@dataclass
class Series:
    """One metric over a run: the records where it is a finite number, with their step and wall time."""

    step: list[int] = field(default_factory=list)
    """Optimizer step of each point."""
    minutes: list[float] = field(default_factory=list)
    """Training wall time of each point (the record's ``wall_s`` / 60), in minutes."""
    value: list[float] = field(default_factory=list)


def trailing_means(values: list[float], window: int) -> list[float]:
    """Element i: the mean of ``values[max(0, i - window + 1) : i + 1]`` (same length as ``values``).

    Raises:
        ValueError: ``window`` < 1.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    means = []
    for i in range(len(values)):
        recent = values[max(0, i - window + 1):i + 1]
        means.append(sum(recent) / len(recent))
    return means


def series(records: list[dict[str, Any]], get: Callable[[dict[str, Any]], Any],
           at: Callable[[dict[str, Any]], int] = lambda r: r["step"]) -> Series:
    """The points ``get(record)`` of ``records`` that are finite numbers (others, e.g. None, are skipped), each at
    the step ``at(record)`` (default: the record's ``step``) and the record's wall time."""
    out = Series()
    for record in records:
        value = get(record)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out.step.append(at(record))
            out.minutes.append(record["wall_s"] / 60.0)
            out.value.append(float(value))
    return out


def load_records(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``<run_dir>/metrics.jsonl`` that have a numeric ``step`` and ``wall_s`` (seconds).

    Raises:
        CurveError: the file is missing or holds no such record.
    """
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise CurveError(f"no metrics.jsonl in {run_dir} (not a run folder, or the run has not started)")
    records = [r for r in read_metrics(path) if isinstance(r, dict)
               and all(isinstance(r.get(k), (int, float)) for k in ("step", "wall_s"))]
    if not records:
        raise CurveError(f"{path} has no metrics record yet (the learner writes one per trained batch)")
    return records


def families(records: list[dict[str, Any]]) -> list[str]:
    """Every task family named in the records' ``family_success``, sorted."""
    return sorted({name for r in records for name in (r.get("family_success") or {})})


def plot_line(ax: Axes, points: Series, x: str, label: str, **style: Any) -> None:
    """Draw the trailing mean (``TRAILING_RECORDS``) of ``points`` against their attribute ``x`` (small markers, so a
    family seen at one step only still shows)."""
    if points.value:
        ax.plot(getattr(points, x), trailing_means(points.value, TRAILING_RECORDS), label=label, marker="o",
                markersize=2, **style)


def held_out_value(record: dict[str, Any]) -> Any:
    """A record's held-out point: its round's mean score ``eval_score`` (errored episodes 0), or ``eval_success``
    when it has none (a run written before eval_score existed); None when it carries no round."""
    score = record.get("eval_score")
    return score if isinstance(score, (int, float)) else record.get("eval_success")


def held_out(records: list[dict[str, Any]]) -> Series:
    """Held-out mean score of each evaluation round (:func:`held_out_value`) at ``eval_step`` (the evaluated
    weights' step; a record's own ``step`` when it lacks one) and at the record's wall time."""
    return series(records, held_out_value,
                  at=lambda r: r["eval_step"] if isinstance(r.get("eval_step"), int) else r["step"])


def draw_success(ax: Axes, records: list[dict[str, Any]], x: str) -> None:
    """Success rate in [0, 1]: raw overall as faint dots, overall and per-family trailing means as lines, and
    the held-out mean score (evaluation rounds, :func:`held_out`) as large markers on a dashed line."""
    evaluated = held_out(records)
    if evaluated.value:
        scored = any(isinstance(r.get("eval_score"), (int, float)) for r in records)
        label = "held-out mean score (eval)" if scored else "held-out success (eval)"
        ax.plot(getattr(evaluated, x), evaluated.value, label=label, color="tab:red", marker="D",
                markersize=6, linestyle="--", linewidth=1, zorder=4)
    overall = series(records, lambda r: r.get("success_rate"))
    ax.scatter(getattr(overall, x), overall.value, s=10, color="black", alpha=0.2, label="per record")
    plot_line(ax, overall, x, "overall", color="black", linewidth=2, zorder=3)
    for family in families(records):
        plot_line(ax, series(records, lambda r: (r.get("family_success") or {}).get(family)), x, family,
                  linewidth=1)
    ax.set_ylim(-0.03, 1.03)
    ax.set_ylabel(f"success rate (mean of {TRAILING_RECORDS} records); held-out: mean score")
    ax.legend(fontsize="small", loc="best")


def draw_reward(ax: Axes, records: list[dict[str, Any]], x: str) -> None:
    """Mean reward of the trained batch (trailing mean)."""
    plot_line(ax, series(records, lambda r: r.get("reward_mean")), x, "reward_mean", color="tab:blue")
    ax.set_ylabel(f"reward_mean (mean of {TRAILING_RECORDS} records)")


def write_curve(run_dir: Path) -> Path:
    """Draw ``<run_dir>/curve.png`` from ``<run_dir>/metrics.jsonl`` (replacing it atomically); returns its path.

    Four panels: success rate and reward_mean (columns) against the optimizer step and the training wall time
    in minutes (rows). Safe to call while the run writes metrics (a torn last line is skipped).

    Raises:
        CurveError: metrics.jsonl is missing or has no record.
        OSError: the picture cannot be written.
    """
    run_dir = Path(run_dir)
    records = load_records(run_dir)
    fig = Figure(figsize=(12, 8), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(X_AXES), 2)
    for row, (x, label, whole) in zip(axes, X_AXES):
        draw_success(row[0], records, x)
        draw_reward(row[1], records, x)
        for ax in row:
            ax.set_xlabel(label)
            ax.xaxis.set_major_locator(MaxNLocator(integer=whole))
            ax.grid(alpha=0.3)
    last = records[-1]
    fig.suptitle(f"{run_dir.resolve().name}: {len(records)} records, step {last['step']}, "
                 f"{last['wall_s'] / 60:.1f} min")
    return _save_atomically(fig, run_dir / CURVE_FILE)


def _save_atomically(fig: Figure, path: Path) -> Path:
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        fig.savefig(tmp, format="png")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def untrained_success(run_dir: Path) -> tuple[float, int, float]:
    """``(success rate, episodes, wall minutes)`` of a run with no metrics record, from ``<run_dir>/status.json``
    (``totals``: SUCCESS over ``trajectories``; ``wall_s``).

    Raises:
        CurveError: no status.json, or it has no episode.
    """
    path = run_dir / "status.json"
    try:
        status = json.loads(path.read_text())
        successes, episodes = int(status["totals"].get("SUCCESS", 0)), int(status["trajectories"])
        wall_min = float(status["wall_s"]) / 60.0
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CurveError(f"no metrics record in {run_dir} and no readable status.json ({e!r})") from e
    if episodes <= 0:
        raise CurveError(f"{path}: no episode has come back yet")
    return successes / episodes, episodes, wall_min


def write_comparison(run_dirs: list[Path], out: Path) -> Path:
    """Draw the overall training success of several runs in one picture at ``out`` (replaced atomically); returns
    its path. Two panels: against the optimizer step and against training wall time in minutes; each run is one
    line (trailing mean of ``TRAILING_RECORDS`` records of ``success_rate``) labelled with its folder name. A run
    without a metrics record is a flat line at its success over its wall time (:func:`untrained_success`).

    Raises:
        CurveError: a folder has neither a metrics record nor a status.json with episodes (the message names it).
        OSError: the picture cannot be written.
    """
    fig = Figure(figsize=(12, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(X_AXES))
    for run_dir in map(Path, run_dirs):
        name = run_dir.resolve().name
        try:
            points = series(load_records(run_dir), lambda r: r.get("success_rate"))
        except CurveError:
            rate, episodes, minutes = untrained_success(run_dir)
            label = f"{name}: no optimizer step, success {rate:.2f} in {episodes} episodes"
            axes[0].plot([0, 0], [rate, rate], linestyle="--", marker="x", label=label)
            colour = axes[0].lines[-1].get_color()
            axes[1].plot([0, minutes], [rate, rate], linestyle="--", color=colour, label=label)
            continue
        for ax, (x, _, _) in zip(axes, X_AXES):
            plot_line(ax, points, x, name)
    for ax, (_, label, whole) in zip(axes, X_AXES):
        ax.set_xlabel(label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=whole))
        ax.set_ylim(-0.03, 1.03)
        ax.set_ylabel(f"success rate (mean of {TRAILING_RECORDS} records)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="best")
    return _save_atomically(fig, Path(out))
