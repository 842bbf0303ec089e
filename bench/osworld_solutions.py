"""OSWorld's reference solutions, proven: every stored solution (actors/osworld/reference_solutions/) and the untouched
desktop, through the real episode loop and OSWorld's own evaluators, in real osworld desktops.

    python -m bench.osworld_solutions OSWorld/evaluation_examples/examples                   # every solution
    python -m bench.osworld_solutions OSWorld/evaluation_examples/examples --domains os,vlc --desktops 2
    python -m bench.osworld_solutions --smoke        # SAMPLE: 3 of OSWorld's task files copied into tests/data
    python -m bench.osworld_solutions OSWorld/evaluation_examples/examples --osworld-files MIRROR  # tasks that download

Each task runs twice with ``actors.eval.evaluate`` (what ``arpo eval`` runs): with the oracle answering from the
task's solution (``arpo eval --oracle``), and with a policy that answers ``finished`` at once (the untouched desktop:
OSWorld's evaluator must give 0, infeasible tasks included). Prints a line per task (solved and untouched score,
actions, seconds of each episode, errors), then the key=value figures line: ``tasks``, ``domains``, ``proven``
(solved 1 and untouched 0), ``solved``, ``untouched_zero``, ``errors``, ``median_solved_s``, ``median_untouched_s``
(wall time of an episode: setup, steps, evaluation) and ``minutes``. Exit status 1 when a task is not proven.
``--out DIR`` keeps both results folders (OSWorld's layout; the solved one is demonstrations for
``learner.replay_demos``). The task folder is OSWorld's ``evaluation_examples/examples`` (a clone of
https://github.com/xlang-ai/OSWorld).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from bench._common import median, result_line

SMOKE_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "tasks" / "osworld_solved"
SAMPLE = ("28cc3b7e-b194-4bc9-8353-d04c0f4d56d2", "9195653c-f4aa-453d-aa95-787f6ccfaae9",
          "fbb548ca-c2a6-4601-9204-e39a2efc507b")
"""The smoke mode's tasks (and the CI test's): os (a terminal command), vlc (its config, with VLC restarted by the
evaluator) and gimp (an infeasible task: call_user), each under a minute."""


async def finished_at_once(**_kw):
    """The untouched desktop's policy: ``finished`` on the first step."""
    return "Thought: done\nAction: finished(content='done')"


def osworld_config(overrides: list[str] = ()):
    """The run config the proofs use: the osworld image, 2048 MiB desktops, the default screen and grammar."""
    from arpo_async.config import load_config
    from arpo_cli.launcher import prepare

    config = load_config(None, ['actors.image_profile="osworld"', "actors.desktop_memory_mb=2048", *overrides])
    return prepare(config, lambda line: print(line, file=sys.stderr, flush=True))


def mirror_overrides(mirror: Path | None) -> list[str]:
    """The config overrides that give a run ``mirror`` as ``learner.osworld_files`` (none for None): the folder of
    OSWorld's files (fetched, or a stand-in mirror from ``actors.osworld.stand_in_mirror``) that tasks' download
    steps read."""
    return [] if mirror is None else [f"learner.osworld_files={json.dumps(str(mirror.resolve()))}"]


def write_split(solutions, path: Path) -> Path:
    """``{domain: [task ids]}`` of ``solutions`` (for ``arpo eval --split``)."""
    split: dict[str, list[str]] = {}
    for sol in solutions:
        split.setdefault(sol.domain, []).append(sol.task_id)
    path.write_text(json.dumps(split, indent=1))
    return path


async def prove(folder: Path, solutions, out: Path, *, desktops: int = 1, config=None) -> dict[str, dict]:
    """Run ``solutions`` solved (the oracle) and untouched (``finished`` at once) on the tasks of ``folder``;
    returns {task id: {"domain", "actions", "solved", "untouched", "solved_s", "untouched_s", "error"}}
    (scores and seconds None when the episode did not finish). Results folders: ``out/solved``, ``out/untouched``."""
    from actors.eval import evaluate
    from actors.eval.results import read_records
    from actors.oracle import OraclePolicy
    from arpo_async.model.inputs import PromptEncoder
    from arpo_async.task_sets import load_task_set

    config = config or osworld_config()
    encoder = PromptEncoder(config.model_path)
    split = write_split(solutions, out / "split.json")
    steps = max(sol.actions for sol in solutions)
    tasks = [e.task for e in load_task_set(folder, split) if e.task is not None]
    runs = {"solved": OraclePolicy(tasks, encoder, config.actors), "untouched": finished_at_once}
    for name, policy in runs.items():
        await evaluate(policy, folder, split=split, desktops=desktops, max_steps=steps, out=out / name,
                       config=config, encoder=encoder, reply_retries=0)
    rows = {sol.task_id: {"domain": sol.domain, "actions": sol.actions, "solved": None, "untouched": None,
                          "solved_s": None, "untouched_s": None, "error": ""} for sol in solutions}
    for name in runs:
        for (_, task_id, _), rec in read_records(out / name).items():
            if task_id in rows:
                rows[task_id][name], rows[task_id][f"{name}_s"] = rec.score, rec.seconds
                if rec.error:
                    rows[task_id]["error"] += f"{name}: {rec.error} "
    return rows


def proven(row: dict) -> bool:
    """Solved scores 1 and the untouched desktop 0, with no error."""
    return row["solved"] == 1.0 and row["untouched"] == 0.0 and not row["error"]


def main(argv: list[str] | None = None) -> int:
    from actors.osworld.solutions import load_solutions

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, nargs="?", help="OSWorld's evaluation_examples/examples (a clone of "
                        "https://github.com/xlang-ai/OSWorld); with --smoke, default tests/data/tasks/osworld_solved")
    parser.add_argument("--domains", default="", help="comma-separated domains to keep, e.g. os,vlc")
    parser.add_argument("--tasks", default="", help="comma-separated task ids (or their first 8 characters)")
    parser.add_argument("--desktops", type=int, default=1, help="desktops at a time (default 1)")
    parser.add_argument("--smoke", action="store_true", help=f"smoke mode: the {len(SAMPLE)} SAMPLE tasks only")
    parser.add_argument("--out", type=Path, help="keep the results folders here (a new or empty folder)")
    parser.add_argument("--osworld-files", type=Path, help="a mirror of OSWorld's files (learner.osworld_files; "
                        "e.g. a stand-in mirror from actors.osworld.stand_in_mirror) for tasks that download files")
    args = parser.parse_args(argv)
    if args.folder is None and args.smoke:
        args.folder = SMOKE_DIR
    if args.folder is None:
        parser.error("give the task folder: OSWorld's evaluation_examples/examples (or --smoke)")
    if not args.folder.is_dir():
        parser.error(f"{args.folder} is not a folder")
    if args.osworld_files is not None and not args.osworld_files.is_dir():
        parser.error(f"--osworld-files {args.osworld_files} is not a folder")
    domains = {d for d in args.domains.split(",") if d}
    wanted = set(SAMPLE) if args.smoke else {t for t in args.tasks.split(",") if t}
    solutions = [s for s in load_solutions().values()
                 if (not domains or s.domain in domains)
                 and (not wanted or any(s.task_id.startswith(w) for w in wanted))]
    if not solutions:
        parser.error("no stored solution matches --domains/--tasks")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="osworld-solutions-") as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        rows = asyncio.run(prove(args.folder, solutions, out, desktops=args.desktops,
                                 config=osworld_config(mirror_overrides(args.osworld_files))))
    for task_id, r in sorted(rows.items(), key=lambda kv: (kv[1]["domain"], kv[0])):
        print(f"{r['domain']:<20} {task_id}  actions={r['actions']:<2} solved={r['solved']} "
              f"untouched={r['untouched']} solved_s={r['solved_s'] and round(r['solved_s'], 1)} "
              f"untouched_s={r['untouched_s'] and round(r['untouched_s'], 1)} "
              f"{'ok' if proven(r) else 'NOT PROVEN'} {r['error']}".rstrip())
    rs = list(rows.values())
    solved_s = [r["solved_s"] for r in rs if r["solved_s"] is not None]
    untouched_s = [r["untouched_s"] for r in rs if r["untouched_s"] is not None]
    print(result_line({
        "tasks": len(rs), "domains": len({r["domain"] for r in rs}), "proven": sum(map(proven, rs)),
        "solved": sum(r["solved"] == 1.0 for r in rs), "untouched_zero": sum(r["untouched"] == 0.0 for r in rs),
        "errors": sum(bool(r["error"]) for r in rs),
        "median_solved_s": median(solved_s) if solved_s else 0.0,
        "median_untouched_s": median(untouched_s) if untouched_s else 0.0,
        "minutes": (time.perf_counter() - started) / 60}))
    return 0 if all(map(proven, rs)) else 1


if __name__ == "__main__":
    sys.exit(main())
