"""``arpo eval --compare A B``: two evaluation reports side by side, per task, and what differs in how they came
about.

A and B are results folders of ``arpo eval`` (their ``report.json``) or ``report.json`` files. Printed:

1. a table, one row per task of either report, then the overall row: A's mean, its 95% interval, B's, the
   difference B - A (percentage points) and whether it exceeds the intervals: "yes" when the two 95% intervals do
   not overlap. Non-overlap is a conservative test (two intervals of equal width that just touch differ at about
   p = 0.006, not 0.05: Schenker and Gentleman, "On judging the significance of differences by examining the
   overlap between confidence intervals", The American Statistician 55(3), 2001), so "no" means "not shown to
   differ", not "the same";
2. the measure compared: the mean score (``score_mean``, ``score_ci95``: OSWorld's number, errored episodes
   scoring 0) when both reports have it, else the success rate (``success_rate``, ``ci95``) of a report written
   before the mean score was reported, which the output says;
3. the provenance (:mod:`actors.eval.provenance`) that differs: commit, desktop image id, policy, the tasks whose
   hashes differ or that only one report has, and the settings that differ; or that a report has none.

Every input is read as :func:`actors.eval.results.read_regular` reads: a regular file (never through a symbolic
link, never a FIFO or device, so nothing hangs) of at most :data:`MAX_REPORT_BYTES`, UTF-8 JSON of the report's
shape with numbers where numbers belong. Anything else is refused with one line naming the file and what is wrong,
before anything is printed (:class:`CompareError`, exit 2).
"""
from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path

MAX_REPORT_BYTES = 64 << 20
"""A report.json larger than this is refused (a 369-task report with 10 repeats is about 1 MB)."""
SCORE = ("score_mean", "score_ci95")
RATE = ("success_rate", "ci95")
LIST_AT_MOST = 20
"""Tasks named in one line of the provenance differences; the rest are counted."""


class CompareError(ValueError):
    """A report cannot be compared; the message is one line naming the file and what is wrong (exit 2)."""


def load_report(path: Path) -> tuple[Path, dict]:
    """``(file, report)`` of ``path``: a results folder (its ``report.json``) or a report.json file.

    Raises:
        CompareError: missing, a symbolic link, not a regular file, unreadable, larger than
            :data:`MAX_REPORT_BYTES`, not UTF-8 JSON, or not an ``arpo eval`` report (:func:`check_report`).
    """
    from actors.eval.results import read_regular

    file = path / "report.json" if os.path.isdir(path) and not os.path.islink(path) else path
    try:
        data = json.loads(read_regular(file, MAX_REPORT_BYTES))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CompareError(f"{file} is a symbolic link; --compare reads only a regular file: give the file it "
                               "points to") from None
        raise CompareError(f"{file}: cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise CompareError(f"{file}: not UTF-8 text, so not an arpo eval report.json") from None
    except ValueError as exc:  # not a regular file, too large, not JSON
        raise CompareError(str(exc) if str(file) in str(exc) else f"{file}: not JSON ({exc})") from None
    except RecursionError:
        raise CompareError(f"{file}: JSON nested too deeply, so not an arpo eval report.json") from None
    check_report(file, data)
    return file, data


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_summary(file: Path, where: str, summary, keys: tuple[str, str]) -> None:
    if not isinstance(summary, dict):
        raise CompareError(f"{file}: {where} is not an object, so not an arpo eval report.json")
    mean, ci = summary.get(keys[0]), summary.get(keys[1])
    if mean is not None and not _number(mean):
        raise CompareError(f"{file}: {where}.{keys[0]} is {mean!r}, not a number or null")
    if ci is not None and not (isinstance(ci, list) and len(ci) == 2 and all(_number(x) for x in ci)):
        raise CompareError(f"{file}: {where}.{keys[1]} is {str(ci)[:80]}, not [low, high] numbers or null")


def check_report(file: Path, data, keys: tuple[str, str] | None = None) -> None:
    """Refuse ``data`` (read from ``file``) unless it has a report's shape: an object with ``overall`` and
    ``tasks_detail`` (an object of task summaries), whose ``keys`` (default: ``score_mean``/``score_ci95`` when
    ``overall`` has them, else ``success_rate``/``ci95``) are numbers (or null) and ``[low, high]`` pairs, and a
    ``provenance`` that is an object when present. Raises CompareError."""
    if not isinstance(data, dict) or not isinstance(data.get("overall"), dict) \
            or not isinstance(data.get("tasks_detail"), dict):
        raise CompareError(f"{file}: not an arpo eval report.json (no overall and tasks_detail objects)")
    keys = keys or (SCORE if SCORE[0] in data["overall"] else RATE)
    _check_summary(file, "overall", data["overall"], keys)
    for name, summary in data["tasks_detail"].items():
        _check_summary(file, f"tasks_detail[{name!r}]", summary, keys)
    if data.get("provenance") is not None and not isinstance(data["provenance"], dict):
        raise CompareError(f"{file}: provenance is not an object")


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _interval(ci) -> str:
    return "-" if ci is None else f"{_pct(ci[0])}-{_pct(ci[1])}"


def compare_row(name: str, a: dict | None, b: dict | None, keys: tuple[str, str]) -> list[str]:
    """One row: name, A's mean and interval, B's, B - A in percentage points, and whether the difference
    exceeds the intervals ("yes": the 95% intervals do not overlap; "no"; "-" when a side lacks a number; "only in
    A" / "only in B" when one report lacks the task)."""
    ma, ca = (a.get(keys[0]), a.get(keys[1])) if a is not None else (None, None)
    mb, cb = (b.get(keys[0]), b.get(keys[1])) if b is not None else (None, None)
    diff = f"{100 * (mb - ma):+.1f}" if ma is not None and mb is not None else "-"
    if a is None or b is None:
        beyond = "only in B" if a is None else "only in A"
    elif ca is None or cb is None or ma is None or mb is None:
        beyond = "-"
    else:
        beyond = "yes" if ca[1] < cb[0] or cb[1] < ca[0] else "no"
    return [_cell(name), _pct(ma), _interval(ca), _pct(mb), _interval(cb), diff, beyond]


def _list(value) -> list:
    return value if isinstance(value, list) else []


def _cell(name: str) -> str:
    return (name if name.isprintable() else repr(name)).replace("|", "\\|")


def _words(values: dict) -> str:
    return ", ".join(f"{side} {value}" for side, value in values.items())


def provenance_differences(a: dict, b: dict) -> list[str]:
    """Lines naming what differs between the provenance of reports ``a`` and ``b`` (commit, desktop image id,
    policy, tasks, settings), or saying it is the same; a report without provenance is said to have none."""
    pa, pb = a.get("provenance"), b.get("provenance")
    missing = [side for side, p in (("A", pa), ("B", pb)) if not isinstance(p, dict)]
    if missing:
        return [f"{' and '.join(missing)} {'has' if len(missing) == 1 else 'have'} no provenance (written before "
                "arpo eval recorded it): commit, image and settings cannot be compared"]
    lines = []
    for key, what in (("commit", "commit"), ("image_id", "desktop image id"), ("image", "desktop image")):
        seen = {side: sorted({str(s.get(key)) for s in _list(p.get("sessions")) if isinstance(s, dict)})
                or [str(p.get(key))] for side, p in (("A", pa), ("B", pb))}
        same = seen["A"] == seen["B"] and len(seen["A"]) == 1
        lines.append(f"{what}: " + ("same, " + seen["A"][0] if same
                                    else _words({k: " + ".join(v) for k, v in seen.items()})))
    if a.get("policy") != b.get("policy"):
        lines.append(f"policy: {_words({'A': json.dumps(a.get('policy')), 'B': json.dumps(b.get('policy'))})}")
    ha, hb = pa.get("task_sha256") or {}, pb.get("task_sha256") or {}
    if isinstance(ha, dict) and isinstance(hb, dict):
        changed = sorted(t for t in set(ha) & set(hb) if ha[t] != hb[t])
        for label, names in (("tasks whose task files differ", changed), ("tasks only in A", sorted(set(ha) - set(hb))),
                             ("tasks only in B", sorted(set(hb) - set(ha)))):
            if names:
                more = f" and {len(names) - LIST_AT_MOST} more" if len(names) > LIST_AT_MOST else ""
                lines.append(f"{label} ({len(names)}): {', '.join(names[:LIST_AT_MOST])}{more}")
        if not changed and set(ha) == set(hb):
            lines.append(f"task set: same ({len(ha)} tasks, sha256 {pa.get('task_set_sha256')})")
    sa, sb = pa.get("settings") or {}, pb.get("settings") or {}
    if isinstance(sa, dict) and isinstance(sb, dict):
        differ = [f"{k} A {sa.get(k)!r}, B {sb.get(k)!r}" for k in sorted(set(sa) | set(sb)) if sa.get(k) != sb.get(k)]
        lines.append("settings that differ: " + "; ".join(differ) if differ else "settings: same")
    for side, p in (("A", pa), ("B", pb)):
        lines += [f"{side} warns: {w}" for w in _list(p.get("warnings")) if isinstance(w, str)]
    return lines


def render_comparison(a_file: Path, a: dict, b_file: Path, b: dict) -> str:
    """The text ``arpo eval --compare`` prints (module docstring)."""
    keys = SCORE if SCORE[0] in a["overall"] and SCORE[0] in b["overall"] else RATE
    for file, data in ((a_file, a), (b_file, b)):
        check_report(file, data, keys)
    if keys == SCORE:
        measure = "mean score (OSWorld's: errored episodes score 0), with its 95% interval"
    else:
        older = " and ".join(side for side, d in (("A", a), ("B", b)) if SCORE[0] not in d["overall"])
        measure = (f"success rate, with its 95% interval: {older} has no mean score (a report from before arpo eval "
                   "reported it), so the success rates are compared instead")
    header = ["task", "A", "A 95% interval", "B", "B 95% interval", "B - A (points)", "beyond intervals"]
    ta, tb = a["tasks_detail"], b["tasks_detail"]
    rows = [compare_row(name, ta.get(name), tb.get(name), keys) for name in sorted(set(ta) | set(tb))]
    rows.append(compare_row("**overall**", a["overall"], b["overall"], keys))
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |"
                                                                              for r in rows]
    return "\n".join([f"A: {a_file}", f"B: {b_file}", f"compared: {measure}", "", *table, "",
                      "provenance:", *(f"- {line}" for line in provenance_differences(a, b))]) + "\n"


def compare_main(a: Path, b: Path, out, err) -> int:
    """``arpo eval --compare A B``: print the comparison to ``out``; 0, or 2 with one line on ``err`` when a
    report cannot be read (:func:`load_report`)."""
    try:
        a_file, a_report = load_report(a)
        b_file, b_report = load_report(b)
        text = render_comparison(a_file, a_report, b_file, b_report)
    except CompareError as exc:
        print(f"arpo eval --compare: {exc}", file=err)
        return 2
    out.write(text)
    return 0
