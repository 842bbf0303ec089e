"""The report of an evaluation: ``report.json`` and ``report.md`` from its episodes' records.

Every planned episode counts: one that errored (its task did not load, its setup failed, its desktop died, the
server went away) scores 0 in the headline and is listed with its reason and cause under ``errors``; one an
incomplete run has not finished yet scores 0 too; none is dropped.

The headline is OSWorld's number: the **mean score over the planned episodes** (``score_mean`` =
``score_sum / score_total``), partial credit kept, errored and unfinished episodes 0. The OSWorld-Verified
leaderboard reports it as a sum over its task set, e.g. "209.55/361" (https://os-world.github.io/); with K repeats
``score_total`` is K x tasks and ``score_mean`` is the mean of the K runs' means (``mean_of_k``, as OpenCUA
reports the mean of 3 runs: Wang et al., "OpenCUA: Open Foundations for Computer-Use Agents", arXiv:2508.09123,
2025). Beside it: ``ran_mean``, the mean over the episodes that ran (not errored), which is what OSWorld's
``show_result.py`` prints (``get_result`` in https://github.com/xlang-ai/OSWorld/blob/main/show_result.py averages
the ``result.txt`` files, and its runner, ``lib_run_single.run_single_example``, writes none for an example that
raised); and ``success_rate``, the share of episodes scored above the run's ``threshold``
(``learner.success_threshold``), the number earlier reports led with.

``report.json``::

    {"policy": {...}, "command": str, "tasks": str, "split": str | None, "repeats": K, "threshold": float | None,
     "planned": episodes planned, "finished": episodes with a result, "complete": bool,
     "overall": Summary, "domains": {domain: Summary}, "tasks_detail": {"<domain>/<task id>": Summary + instruction},
     "errors": [{"domain", "task_id", "repeat", "outcome", "error", "cause": "harness" | "agent"}], ...}

(``meta`` keys, e.g. ``settings`` and ``throughput``, are copied in.) A Summary is a dict with the keys:

- ``score_sum`` (float): the sum of the episode scores over the planned episodes, errored and unfinished 0;
- ``score_total`` (int): the planned episodes (K x tasks);
- ``score_mean`` (float | None): ``score_sum / score_total`` (None when nothing is planned): the headline;
- ``score_ci95`` ([low, high]): its 95% interval from a cluster bootstrap over tasks (each task's mean over its K
  planned episodes, tasks resampled with replacement, fixed seed:
  :func:`actors.eval.stats.cluster_bootstrap_interval`, after Miller, arXiv:2411.00640): repeats of one task are
  not taken as independent. In a per-task Summary the clusters are its episodes; with one cluster, or all of
  them scoring alike, the Wilson interval of the mean over the clusters (the bootstrap would have zero width);
- ``ran_mean`` (float | None) and ``ran_episodes`` (int): the mean score over the finished episodes that did not
  error, and how many they are (OSWorld's ``show_result.py`` number);
- ``mean_of_k``: ``{"runs": [mean score of run 0, ..., run K-1], "mean": their mean}``, run j being repeat j of
  every planned task (unfinished or errored 0); ``mean`` equals ``score_mean``;
- ``episodes`` (finished episodes), ``planned`` (= ``score_total``), ``successes``, ``success_rate`` (successes
  over finished episodes: the success rate at ``threshold``) and ``ci95`` (its Wilson 95% interval,
  :func:`actors.eval.stats.wilson_interval`, episodes taken as independent draws);
- ``pass_at_k`` ({"1": rate, "K": rate}): pass@k for k = 1 and k = K over the tasks with at least k finished
  episodes, success at ``threshold`` (:func:`actors.eval.stats.pass_at_k`, Chen et al. 2021, mean over tasks);
- ``errors`` (errored episodes), split into ``harness_errors`` and ``agent_errors`` by
  :func:`actors.eval.causes.error_cause`; ``policy_errors``: scored episodes whose reply did not parse
  (POLICY_ERROR, not errors: their score counts in both means);
- ``mean_steps`` (policy steps per finished episode) and ``policy_versions`` (weight versions seen).
"""
from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Iterable

from actors.eval.causes import AGENT, HARNESS, error_cause
from actors.eval.provenance import provenance_lines
from actors.eval.results import EpisodeRecord
from actors.eval.stats import cluster_bootstrap_interval, pass_at_k, wilson_interval
from arpo_async.messages import Outcome


def _score(record: EpisodeRecord) -> float:
    """The episode's score in the headline: 0.0 when it errored."""
    return 0.0 if record.errored else float(record.score)


def _cause(record: EpisodeRecord) -> str:
    """Whose fault an errored record is (:func:`actors.eval.causes.error_cause`); an outcome that names no error
    (a record written by hand) counts as the harness's."""
    try:
        return error_cause(record.outcome) or HARNESS
    except ValueError:
        return HARNESS


def _clusters(records: list[EpisodeRecord], repeats: int, tasks: Iterable[tuple[str, str]] | None,
              planned: int | None) -> list[list[float]]:
    """Per planned task, the scores of its ``repeats`` planned episodes by repeat (errored and unfinished 0.0);
    ``tasks`` adds planned tasks with no record; when ``planned`` exceeds the episodes so counted (no task list
    was given for an incomplete run), unnamed tasks of zeros make up the difference."""
    per_task: dict[tuple[str, str], list[float]] = {}
    for key in tasks or ():
        per_task.setdefault(tuple(key), [0.0] * repeats)
    for r in sorted(records, key=lambda r: r.key):
        scores = per_task.setdefault((r.domain, r.task_id), [0.0] * repeats)
        if 0 <= r.repeat < len(scores):
            scores[r.repeat] = _score(r)
        else:
            scores.append(_score(r))
    clusters = list(per_task.values())
    missing = (planned or 0) - sum(map(len, clusters))
    while missing > 0:
        clusters.append([0.0] * min(repeats, missing))
        missing -= repeats
    return clusters


def summarize(records: Iterable[EpisodeRecord], repeats: int, *, tasks: Iterable[tuple[str, str]] | None = None,
              planned: int | None = None) -> dict:
    """The Summary (module docstring) of ``records``, episodes of the planned ``tasks`` ((domain, task id) pairs,
    each planned ``repeats`` times; default: the tasks of ``records``) or of ``planned`` episodes in all. pass@k
    uses the tasks with ``repeats`` finished episodes (k = 1 over every task with at least one)."""
    records = list(records)
    n = len(records)
    successes = sum(r.success for r in records)
    low, high = wilson_interval(successes, n)
    per_task: dict[tuple[str, str], list[EpisodeRecord]] = defaultdict(list)
    for r in records:
        per_task[(r.domain, r.task_id)].append(r)
    passes: dict[str, float | None] = {}
    for k in sorted({1, repeats}):
        done = [rs for rs in per_task.values() if len(rs) >= k]
        passes[str(k)] = (sum(pass_at_k(len(rs), sum(r.success for r in rs), k) for rs in done) / len(done)
                          if done else None)
    clusters = _clusters(records, repeats, tasks, planned)
    total = sum(map(len, clusters))
    score_sum = sum(map(sum, clusters))
    ran = [r for r in records if not r.errored]
    runs = [sum(c[j] for c in clusters if j < len(c)) / sum(j < len(c) for c in clusters)
            for j in range(repeats) if any(j < len(c) for c in clusters)]
    causes = [_cause(r) for r in records if r.errored]
    return {
        "score_sum": score_sum, "score_total": total, "score_mean": score_sum / total if total else None,
        "score_ci95": list(cluster_bootstrap_interval(clusters)) if total else [0.0, 1.0],
        "ran_mean": sum(r.score for r in ran) / len(ran) if ran else None, "ran_episodes": len(ran),
        "mean_of_k": {"runs": runs, "mean": sum(runs) / len(runs) if runs else None},
        "episodes": n, "planned": total, "successes": successes, "success_rate": successes / n if n else None,
        "ci95": [low, high], "pass_at_k": passes,
        "mean_steps": sum(r.steps for r in records) / n if n else None,
        "errors": len(causes), "harness_errors": causes.count(HARNESS), "agent_errors": causes.count(AGENT),
        "policy_errors": sum(str(r.outcome).upper() == Outcome.POLICY_ERROR for r in records),
        "policy_versions": sorted({r.policy_version for r in records if r.policy_version is not None}),
    }


def build_report(records: Iterable[EpisodeRecord], *, repeats: int, planned: int, meta: dict,
                 tasks: Iterable[tuple[str, str]] | None = None, threshold: float | None = None) -> dict:
    """The report (module docstring) of the finished ``records`` of an evaluation that planned ``planned``
    episodes: ``repeats`` of each of ``tasks`` ((domain, task id) pairs; default: the tasks of ``records``, so
    the tasks of an incomplete run with no record yet count only in the overall Summary). ``threshold`` is the
    success threshold the records' ``success`` was decided at; ``meta`` (policy, command, tasks, split, ...) is
    copied in."""
    records = sorted(records, key=lambda r: r.key)
    plan = sorted({(str(d), str(t)) for d, t in tasks}) if tasks is not None else None
    by_domain: dict[str, list[EpisodeRecord]] = {d: [] for d, _ in plan or ()}
    by_task: dict[tuple[str, str], list[EpisodeRecord]] = {key: [] for key in plan or ()}
    for r in records:
        by_domain.setdefault(r.domain, []).append(r)
        by_task.setdefault((r.domain, r.task_id), []).append(r)
    tasks_detail = {f"{d}/{t}": {**summarize(rs, repeats, tasks=[(d, t)]),
                                 "instruction": next((r.instruction for r in rs if r.instruction), "")}
                    for (d, t), rs in sorted(by_task.items())}
    return {
        **meta, "repeats": repeats, "threshold": threshold, "planned": planned, "finished": len(records),
        "complete": len(records) >= planned,
        "overall": summarize(records, repeats, tasks=plan, planned=planned),
        "domains": {d: summarize(rs, repeats, tasks=[t for t in plan or () if t[0] == d])
                    for d, rs in sorted(by_domain.items())},
        "tasks_detail": tasks_detail,
        "errors": [{"domain": r.domain, "task_id": r.task_id, "repeat": r.repeat, "outcome": r.outcome,
                    "error": r.error, "cause": _cause(r)} for r in records if r.errored],
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: float) -> str:
    """A score sum as the leaderboard writes it: at most 2 decimals, no trailing zeros (1.75, 2, 209.55)."""
    return f"{x:.2f}".rstrip("0").rstrip(".")


def _interval(pair: list[float]) -> str:
    return f"{_pct(pair[0])}-{_pct(pair[1])}"


def score_line(s: dict) -> str:
    """``score 1.75/4 (43.8%), 95% interval 0.0%-62.5%`` of a Summary: the OSWorld headline."""
    return (f"score {_num(s['score_sum'])}/{s['score_total']} ({_pct(s['score_mean'])}), "
            f"95% interval {_interval(s['score_ci95'])}")


def _errors_line(s: dict) -> str:
    parsed = f"; replies that did not parse (scored, not errors): {s['policy_errors']}" if s["policy_errors"] else ""
    return (f"the harness could not run it: {s['harness_errors']} / the agent's episode failed: "
            f"{s['agent_errors']}{parsed}")


def headline(report: dict) -> list[str]:
    """The report's leading lines (plain text; ``report.md`` and ``arpo eval``'s last lines): the OSWorld score
    overall, what stands beside it, clearly labelled, then the score per domain."""
    o, k = report["overall"], report["repeats"]
    threshold = report.get("threshold")
    at = "the run's threshold" if threshold is None else f"threshold {threshold:g}"
    lines = [f"{score_line(o)} (the mean score over all {o['score_total']} planned episodes, errored and unfinished "
             f"ones scoring 0, as OSWorld's leaderboard sums it over the task set; interval: tasks resampled)",
             f"mean over episodes that ran (OSWorld show_result.py): {_pct(o['ran_mean'])} of {o['ran_episodes']}",
             f"success rate at {at}: {_pct(o['success_rate'])} ({o['successes']} of {o['episodes']} finished "
             f"episodes), Wilson 95% interval {_interval(o['ci95'])}",
             f"errored episodes (scored 0 in the score): {_errors_line(o)}"]
    if k > 1:
        runs = ", ".join(_pct(x) for x in o["mean_of_k"]["runs"])
        lines.append(f"mean of {k} runs (as OpenCUA reports): {runs}; mean {_pct(o['mean_of_k']['mean'])}; "
                     f"pass@1 {_pct(o['pass_at_k'].get('1'))}, pass@{k} {_pct(o['pass_at_k'].get(str(k)))}")
    lines += [f"{d}: {score_line(s)}; ran {_pct(s['ran_mean'])} of {s['ran_episodes']}; success "
              f"{_pct(s['success_rate'])}; harness {s['harness_errors']}, agent {s['agent_errors']}"
              for d, s in report["domains"].items()]
    return lines


def _row(name: str, s: dict, repeats: int) -> list[str]:
    passes = [_pct(s["pass_at_k"].get(str(repeats)))] if repeats > 1 else []
    return [name, f"{_num(s['score_sum'])}/{s['score_total']}", _pct(s["score_mean"]), _interval(s["score_ci95"]),
            f"{_pct(s['ran_mean'])} ({s['ran_episodes']})", f"{s['successes']}/{s['episodes']}",
            _pct(s["success_rate"]), _interval(s["ci95"]), _pct(s["pass_at_k"].get("1")), *passes,
            "-" if s["mean_steps"] is None else f"{s['mean_steps']:.1f}",
            f"{s['harness_errors']} / {s['agent_errors']}"]


def _table(rows: list[list[str]], repeats: int) -> list[str]:
    header = ["", "score", "mean score", "95% interval", "mean over ran (n)", "successes", "success rate",
              "Wilson 95%", "pass@1", *([f"pass@{repeats}"] if repeats > 1 else []), "mean steps",
              "errors harness / agent"]
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def task_table(report: dict) -> str:
    """The per-task table (Markdown, also readable as plain text) with the overall row last: score sum/planned,
    mean score and its interval first, then the mean over the episodes that ran, the success rate at the
    threshold with its Wilson interval, pass@k, mean steps and the errors by cause."""
    k = report["repeats"]
    rows = [_row(name, s, k) for name, s in report["tasks_detail"].items()]
    rows.append(_row("**overall**", report["overall"], k))
    return "\n".join(_table(rows, k))


def render_markdown(report: dict) -> str:
    """``report.md``: the headline (:func:`headline`), what was scored and how, then overall, per-domain and
    per-task tables, then every error with its cause."""
    k = report["repeats"]
    policy = report.get("policy", {})
    lines = ["# Evaluation report", "", *(f"- {line}" for line in headline(report)), "",
             "The score is OSWorld's number; the other figures stand beside it (docs/guides/evaluation.md, "
             "\"What each number is\").", "",
             f"- policy: {policy.get('kind', '?')} `{policy.get('name', '')}`, weight version(s) "
             f"{', '.join(map(str, report['overall']['policy_versions'])) or 'not reported'}",
             f"- tasks: `{report.get('tasks')}`" + (f", split `{report['split']}`" if report.get("split") else ""),
             f"- {report['finished']} of {report['planned']} episodes finished ({k} per task)"
             + ("" if report["complete"] else " - INCOMPLETE: unfinished episodes score 0; resume with --resume"),
             f"- command: `{report.get('command', '')}`", *provenance_lines(report), "",
             "## Overall and per domain", "",
             *_table([_row("**overall**", report["overall"], k)]
                     + [_row(d, s, k) for d, s in report["domains"].items()], k), "",
             "## Per task", "", task_table(report), ""]
    lines += ["## Episodes that errored (each scores 0)", ""]
    lines += [f"- {e['domain']}/{e['task_id']} #{e['repeat']}: {e['outcome']} ({_CAUSE_WORDS.get(e.get('cause'), '?')})"
              f": {e['error']}" for e in report["errors"]] or ["none"]
    return "\n".join(lines) + "\n"


_CAUSE_WORDS = {HARNESS: "the harness could not run it", AGENT: "the agent's episode failed"}


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
