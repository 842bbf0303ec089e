"""The report of an evaluation: ``report.json`` and ``report.md`` from its episodes' records.

Every episode counts: one that errored (its task did not load, its setup failed, its desktop died, the server went
away) is a failure in the denominator and is listed with its reason under ``errors``; none is dropped.

``report.json``::

    {"policy": {...}, "command": str, "tasks": str, "split": str | None, "repeats": K,
     "planned": episodes planned, "finished": episodes with a result, "complete": bool,
     "overall": Summary, "domains": {domain: Summary}, "tasks_detail": {"<domain>/<task id>": Summary},
     "errors": [{"domain", "task_id", "repeat", "outcome", "error"}]}

where a Summary is ``{"episodes", "successes", "success_rate", "ci95": [low, high], "pass_at_k": {k: rate},
"mean_steps", "errors", "policy_versions"}``: the success rate over episodes with its Wilson 95% interval
(:func:`actors.eval.stats.wilson_interval`; episodes are treated as independent draws, so with few tasks and many
repeats the interval is too narrow for the task population), pass@k for k = 1 and k = K over the tasks whose
episodes all finished (:func:`actors.eval.stats.pass_at_k`, averaged over tasks), mean policy steps per episode.
"""
from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Iterable

from actors.eval.results import EpisodeRecord
from actors.eval.stats import pass_at_k, wilson_interval


def summarize(records: Iterable[EpisodeRecord], repeats: int) -> dict:
    """The Summary (module docstring) of ``records``; pass@k uses the tasks with ``repeats`` finished episodes
    (k = 1 over every task with at least one)."""
    records = list(records)
    n = len(records)
    successes = sum(r.success for r in records)
    low, high = wilson_interval(successes, n)
    per_task: dict[tuple[str, str], list[EpisodeRecord]] = defaultdict(list)
    for r in records:
        per_task[(r.domain, r.task_id)].append(r)
    passes: dict[str, float | None] = {}
    for k in sorted({1, repeats}):
        tasks = [rs for rs in per_task.values() if len(rs) >= k]
        passes[str(k)] = (sum(pass_at_k(len(rs), sum(r.success for r in rs), k) for rs in tasks) / len(tasks)
                          if tasks else None)
    return {
        "episodes": n, "successes": successes, "success_rate": successes / n if n else None,
        "ci95": [low, high], "pass_at_k": passes,
        "mean_steps": sum(r.steps for r in records) / n if n else None,
        "errors": sum(r.errored for r in records),
        "policy_versions": sorted({r.policy_version for r in records if r.policy_version is not None}),
    }


def build_report(records: Iterable[EpisodeRecord], *, repeats: int, planned: int, meta: dict) -> dict:
    """The report (module docstring) of the finished ``records`` of an evaluation that planned ``planned``
    episodes; ``meta`` (policy, command, tasks, split) is copied in."""
    records = sorted(records, key=lambda r: r.key)
    by_domain: dict[str, list[EpisodeRecord]] = defaultdict(list)
    by_task: dict[str, list[EpisodeRecord]] = defaultdict(list)
    for r in records:
        by_domain[r.domain].append(r)
        by_task[f"{r.domain}/{r.task_id}"].append(r)
    tasks_detail = {}
    for name, rs in by_task.items():
        tasks_detail[name] = {**summarize(rs, repeats), "instruction": next((r.instruction for r in rs if r.instruction), "")}
    return {
        **meta, "repeats": repeats, "planned": planned, "finished": len(records), "complete": len(records) >= planned,
        "overall": summarize(records, repeats),
        "domains": {d: summarize(rs, repeats) for d, rs in sorted(by_domain.items())},
        "tasks_detail": tasks_detail,
        "errors": [{"domain": r.domain, "task_id": r.task_id, "repeat": r.repeat, "outcome": r.outcome,
                    "error": r.error} for r in records if r.errored],
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _row(name: str, s: dict, repeats: int) -> list[str]:
    passes = [_pct(s["pass_at_k"].get(str(repeats)))] if repeats > 1 else []
    return [name, str(s["episodes"]), str(s["successes"]), _pct(s["success_rate"]),
            f"{_pct(s['ci95'][0])}-{_pct(s['ci95'][1])}", _pct(s["pass_at_k"].get("1")), *passes,
            "-" if s["mean_steps"] is None else f"{s['mean_steps']:.1f}", str(s["errors"])]


def _table(rows: list[list[str]], repeats: int) -> list[str]:
    header = ["", "episodes", "successes", "success", "95% interval", "pass@1",
              *([f"pass@{repeats}"] if repeats > 1 else []), "mean steps", "errors"]
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def task_table(report: dict) -> str:
    """The per-task table (Markdown, also readable as plain text) with the overall row last."""
    k = report["repeats"]
    rows = [_row(name, s, k) for name, s in report["tasks_detail"].items()]
    rows.append(_row("**overall**", report["overall"], k))
    return "\n".join(_table(rows, k))


def render_markdown(report: dict) -> str:
    """``report.md``: what was scored and how, then overall, per-domain and per-task tables, then every error."""
    k = report["repeats"]
    policy = report.get("policy", {})
    lines = ["# Evaluation report", "",
             f"- policy: {policy.get('kind', '?')} `{policy.get('name', '')}`, weight version(s) "
             f"{', '.join(map(str, report['overall']['policy_versions'])) or 'not reported'}",
             f"- tasks: `{report.get('tasks')}`" + (f", split `{report['split']}`" if report.get("split") else ""),
             f"- {report['finished']} of {report['planned']} episodes finished ({k} per task)"
             + ("" if report["complete"] else " - INCOMPLETE: resume with --resume"),
             f"- command: `{report.get('command', '')}`", "",
             "## Overall and per domain", "",
             *_table([_row("**overall**", report["overall"], k)]
                     + [_row(d, s, k) for d, s in report["domains"].items()], k), "",
             "## Per task", "", task_table(report), ""]
    lines += ["## Episodes that errored (counted as failures)", ""]
    lines += [f"- {e['domain']}/{e['task_id']} #{e['repeat']}: {e['outcome']}: {e['error']}" for e in report["errors"]] \
        or ["none"]
    return "\n".join(lines) + "\n"


def write_report(out: Path, report: dict) -> tuple[Path, Path]:
    """Write ``out/report.json`` and ``out/report.md``; returns both paths. Each is replaced atomically (a
    temporary file, then ``os.replace``), so a symbolic link in its place is replaced, never written through.
    Raises OSError."""
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / "report.json", out / "report.md"
    for path, text in ((js, json.dumps(report, indent=1) + "\n"), (md, render_markdown(report))):
        fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return js, md
