"""Per OSWorld domain, what a training run's episodes did: how many ran, how many ended in an error (by cause) and how
many were scored (and of those, how many succeeded), from the run's kept trajectories.

    python -m bench.osworld_run_domains RUN --tasks OSWorld/evaluation_examples/examples [--split arpo-128]

Reads ``RUN/trajectories/*/record.json`` (learner.rollouts.trajectory_sample: one per kept training trajectory,
task pre-pass rollouts included, evaluation rounds not), so run with ``--set learner.sample_trajectories=1.0`` (and a
``learner.sample_disk_mb`` large enough that none is deleted) for a count of every episode; the figures line says how
many records it read. A task's domain is the folder its file sits in under ``--tasks`` (``--split`` cuts it as
``learner.split`` did; arpo_async.task_sets.load_task_set names each task as the run did). An episode is scored when
its evaluator gave a score (SUCCESS, FAILURE, TRUNCATED, POLICY_ERROR: an outcome the learner trains on, or scores 0);
it errored when it ended ENV_ERROR, TASK_ERROR or ABORTED, and its cause is the error's type (the text before the
first ':' of the record's ``error``) with, for setup errors, the failing step's kind (``TaskSetupError: setup step 0
(download)``). Prints a table per domain, each cause with its count and one example, then the key=value line:
``records``, ``domains``, ``ran``, ``errored``, ``scored``, ``succeeded``, ``domains_scored`` (domains with at least
one scored episode).
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

from bench._common import result_line

ERRORED = {"ENV_ERROR", "TASK_ERROR", "ABORTED"}
CAUSE = re.compile(r"^([A-Za-z_.]+)(: setup step \d+ \(\w+\))?")


def cause(error: str) -> str:
    """The cause of an errored episode from its record's ``error`` ("Type: message"): the type, and for a setup step
    the step and its kind; "unknown" for an empty error."""
    found = CAUSE.match(error or "")
    return (found.group(1) + (found.group(2) or "")) if found else "unknown"


def domain_counts(records: list[dict], domains: dict[str, str]) -> dict[str, dict]:
    """{domain: {"ran", "errored", "scored", "succeeded", "causes": {cause: [count, example error]}}} over
    ``records`` (record.json dicts); ``domains`` maps a task id to its domain (a task not in it: "?")."""
    table: dict[str, dict] = collections.defaultdict(lambda: {"ran": 0, "errored": 0, "scored": 0, "succeeded": 0,
                                                              "causes": {}})
    for record in records:
        row = table[domains.get(str(record.get("task_id")), "?")]
        row["ran"] += 1
        if record.get("outcome") in ERRORED:
            row["errored"] += 1
            entry = row["causes"].setdefault(f"{record['outcome']} {cause(record.get('error', ''))}", [0, ""])
            entry[0] += 1
            entry[1] = entry[1] or str(record.get("error", ""))[:200]
        else:
            row["scored"] += 1
            row["succeeded"] += record.get("outcome") == "SUCCESS"
    return dict(sorted(table.items()))


def main(argv: list[str] | None = None) -> int:
    """Print the per-domain table and the figures line (module docstring); 2 when RUN has no trajectories folder."""
    from arpo_async.task_sets import load_task_set

    parser = argparse.ArgumentParser(prog="python -m bench.osworld_run_domains", description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path, help="the run folder (arpo run --out)")
    parser.add_argument("--tasks", required=True, help="the task folder the run trained on (learner.tasks)")
    parser.add_argument("--split", default=None, help="the run's learner.split, if any")
    args = parser.parse_args(argv)
    folder = args.run / "trajectories"
    if not folder.is_dir():
        print(f"{folder}: no such folder (a run with learner.sample_trajectories > 0 writes it)", file=sys.stderr)
        return 2
    domains = {e.task.id: e.domain for e in load_task_set(args.tasks, args.split) if e.task is not None}
    records = []
    for path in sorted(folder.glob("*/record.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError) as error:
            print(f"{path}: skipped ({error})", file=sys.stderr)
    table = domain_counts(records, domains)
    print(f"{'domain':22} {'ran':>5} {'errored':>8} {'scored':>7} {'succeeded':>9}")
    for name, row in table.items():
        print(f"{name:22} {row['ran']:5} {row['errored']:8} {row['scored']:7} {row['succeeded']:9}")
        for why, (count, example) in sorted(row["causes"].items(), key=lambda kv: -kv[1][0]):
            print(f"    {count:4}  {why}   e.g. {example}")
    total = {k: sum(r[k] for r in table.values()) for k in ("ran", "errored", "scored", "succeeded")}
    print(result_line({"records": len(records), "domains": len(table), **total,
                       "domains_scored": sum(r["scored"] > 0 for r in table.values())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
