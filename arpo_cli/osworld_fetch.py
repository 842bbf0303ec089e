"""`arpo osworld fetch`: download every file a task set's setup steps and evaluators name into a mirror of OSWorld's
files (the folder ``learner.osworld_files`` names), resumable, each file's size and sha256 in the mirror's
``arpo-mirror.json``, and a list of what failed.

Role: the command line over :mod:`actors.osworld.task_files` (what to fetch) and :mod:`actors.osworld.fetch` (how):
parses the flags, loads the task set, shows progress (rich, on stderr) and prints the failures. Exit status: 0 every
file is in the mirror; 1 some failed (each listed with its reason, also in the manifest's ``failed``) or a task's
file reference is malformed; 2 a usage error, a task folder or split that cannot be read, or a mirror that cannot be
used (not a folder, a manifest that is not arpo's) - one line, nothing written.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

EPILOG = ("Exit status: 0 every file is in the mirror; 1 some files failed (listed, with the reason, and in "
          "MIRROR/arpo-mirror.json's 'failed'); 2 a usage error, a task folder or split that cannot be read, or "
          "a MIRROR that cannot be used; 130 interrupted (a re-run resumes).")


def add_osworld_parser(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """Add the ``arpo osworld`` command group with ``fetch``; returns the group's subparsers (for more commands)."""
    from arpo_async.config import ActorConfig

    actors = ActorConfig()
    group = sub.add_parser("osworld", help="OSWorld's task files: fetch the files they name into a mirror")
    osub = group.add_subparsers(dest="osworld_command", required=True)
    p = osub.add_parser(
        "fetch", help="download every file a task set's setup steps and evaluators name into MIRROR "
                      "(learner.osworld_files), resumable",
        description="Download every file the tasks' `download` setup steps (in config and evaluator.postconfig) "
                    "and `cloud_file` getters name into MIRROR/<domain>/<task id>/<file name>, the layout "
                    "learner.osworld_files reads. Each URL is fetched once (files that share it get copies); each "
                    "file's URL, size and sha256 go to MIRROR/arpo-mirror.json, and a re-run keeps the files "
                    "whose size and sha256 still match and fetches the rest. Downloads go to MIRROR/.arpo-partial "
                    "and are renamed into place once complete. Nothing outside MIRROR is written, nothing is "
                    "written through a symlink, and a file in MIRROR that arpo-mirror.json does not list is left "
                    "alone and reported. Google Drive: the direct-download links OSWorld's tasks use are fetched "
                    "as OSWorld does (one GET); a web page instead of the file (Drive's virus-scan confirmation, "
                    "a quota or sign-in page) is listed as failed.",
        epilog=EPILOG)
    p.add_argument("--tasks", required=True, type=Path, metavar="DIR",
                   help="a folder of OSWorld task files (<domain>/<id>.json), e.g. OSWorld's "
                        "evaluation_examples/examples")
    p.add_argument("--split", help="only the tasks of this split: a file {domain: [task id, ...]} (OSWorld's "
                                   "test_all.json form) or a named set (osworld-369, osworld-361, arpo-128)")
    p.add_argument("--to", required=True, type=Path, metavar="MIRROR",
                   help="the mirror folder (created if missing); give it to runs as learner.osworld_files")
    p.add_argument("--max-mb", type=float, default=actors.download_max_mb,
                   help=f"largest file, MiB (default {actors.download_max_mb:g}, actors.download_max_mb's)")
    p.add_argument("--timeout-s", type=float, default=actors.download_timeout_s,
                   help="deadline of one try of one file, connect to last byte, seconds (default "
                        f"{actors.download_timeout_s:g}, actors.download_timeout_s's)")
    p.add_argument("--concurrency", type=int, default=4, help="downloads at a time (default 4)")
    p.add_argument("--retries", type=int, default=2,
                   help="further tries of a file after no connection, a missed deadline or HTTP 408/429/5xx, with "
                        "exponential backoff (default 2: 3 tries, OSWorld's)")
    return osub


def _human(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover


def fetch_main(args: argparse.Namespace) -> int:
    """Run `arpo osworld fetch` (module docstring: exit status)."""
    from actors.osworld.fetch import FetchOptions, Outcome, fetch_mirror
    from actors.osworld.mirror_fs import MANIFEST, MirrorError
    from actors.osworld.task_files import scan_task_files
    from arpo_async.task_sets import load_task_set
    from arpo_async.tasks import TaskFormatError

    def usage(message: str) -> int:
        print(f"arpo osworld fetch: {message}", file=sys.stderr)
        return 2

    if not args.tasks.is_dir():
        return usage(f"--tasks {args.tasks}: not a folder of task files")
    try:
        options = FetchOptions(max_bytes=int(args.max_mb * 2**20), timeout_s=args.timeout_s,
                               concurrency=args.concurrency, retries=args.retries)
    except ValueError:
        return usage("--max-mb, --timeout-s and --concurrency must be > 0, --retries >= 0")
    try:
        entries = load_task_set(args.tasks, args.split)
    except TaskFormatError as exc:
        return usage(str(exc))
    files, problems = scan_task_files(entries)
    print(f"{len(entries)} tasks name {len(files)} files ({len({f.url for f in files})} distinct URLs); "
          f"mirror {args.to}", file=sys.stderr)
    try:
        report = asyncio.run(_fetch_with_progress(files, args.to, options, fetch_mirror, Outcome))
    except MirrorError as exc:
        return usage(str(exc))
    except KeyboardInterrupt:
        print("arpo osworld fetch: interrupted; the files fetched so far are recorded, a re-run resumes",
              file=sys.stderr)
        return 130
    counts = {o: sum(r.outcome is o for r in report.results) for o in Outcome}
    size = sum(r.size for r in report.results if r.outcome is not Outcome.FAILED)
    print(f"{counts[Outcome.FETCHED]} fetched, {counts[Outcome.PRESENT]} already present, "
          f"{counts[Outcome.FAILED]} failed of {len(files)} files; {_human(size)} in the mirror for these tasks; "
          f"sizes and sha256 in {args.to / MANIFEST}")
    if report.left_alone:
        shown = report.left_alone[:20]
        print(f"{len(report.left_alone)} paths in the mirror that arpo did not write, left alone: "
              + ", ".join(shown) + (" ..." if len(report.left_alone) > len(shown) else ""))
    for line in problems:
        print(f"skipped (task file): {line}")
    for r in report.failed:
        print(f"FAILED {r.file.relpath} [{r.kind}] {r.error}")
    return 1 if report.failed or problems else 0


async def _fetch_with_progress(files, mirror: Path, options, fetch_mirror, outcome_type):
    """fetch_mirror with a rich progress bar on stderr in a terminal (files done of all, bytes received) and one
    short line per failure as it happens (the reasons follow on stdout at the end)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    columns = (TextColumn("files"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[received]}"),
               TimeElapsedColumn())
    received = [0]
    with Progress(*columns, console=console, disable=not console.is_terminal) as progress:
        count = progress.add_task("files", total=len(files), received="0 B")

        def on_progress(n: int) -> None:
            received[0] += n
            progress.update(count, received=_human(received[0]))

        def on_result(result) -> None:
            progress.advance(count)
            if result.outcome is outcome_type.FAILED:
                print(f"failed: {result.file.relpath} [{result.kind}]", file=sys.stderr, flush=True)

        return await fetch_mirror(files, mirror, options, on_progress=on_progress,
                                  on_result=on_result)
