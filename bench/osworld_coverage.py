"""OSWorld coverage: how many tasks of a folder load, set up in a real desktop, and evaluate untouched.

    python -m bench.osworld_coverage OSWorld/evaluation_examples/examples          # loading only
    python -m bench.osworld_coverage OSWorld/evaluation_examples/examples --desktops 2 --domains os,vlc --offline-only
    python -m bench.osworld_coverage OSWorld/evaluation_examples/examples --offline-split offline.json
    python -m bench.osworld_coverage OSWorld/evaluation_examples/examples --split arpo-128 --desktops 2 \
        --osworld-files MIRROR                           # with a (stand-in) mirror of OSWorld's files
    python -m bench.osworld_coverage --quick                 # smoke: our own OSWorld-format tasks, 1 desktop

Prints the per-domain table and one line per task that did not pass (the reason: needs network, app missing,
getter or metric not implemented, setup failed with its error), then the key=value figures line:
``tasks``, ``load``, ``setup``, ``evaluate`` (counts), ``load_frac``, ``evaluate_frac_offline`` (of the tasks
that need no download), ``download_ok`` (tasks with a download that set up and evaluated untouched: they need
the mirror), ``stand_in_files`` (written by ``--stand-in``, else 0) and ``minutes``. The folder is OSWorld's
``evaluation_examples/examples`` from a clone of https://github.com/xlang-ai/OSWorld (369 Ubuntu tasks in 10
domain folders); without ``--quick`` it is required. ``--json FILE`` keeps every task's report. Built on
:mod:`actors.task_check` (the same code as ``arpo tasks check``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from actors.osworld.downloads import run_download_cache
from actors.task_check import TaskReport, check_folder, format_report, task_files, write_json
from bench._common import result_line

QUICK_DIR = ROOT / "tests" / "data" / "tasks" / "osworld"


def needs_download(path: str) -> bool:
    """True when the task file has a ``download`` step (setup or postconfig) or a ``cloud_file`` getter:
    it cannot be set up on a machine without network unless ``learner.osworld_files`` mirrors its files."""
    try:
        task = json.loads(Path(path).read_text(encoding="utf-8"))
        steps = list(task.get("config", [])) + list(task.get("evaluator", {}).get("postconfig", []))
        getters = []
        for key in ("result", "expected"):
            value = task.get("evaluator", {}).get(key) or []
            getters += value if isinstance(value, list) else [value]
    except (OSError, ValueError, AttributeError, TypeError):
        return False
    return any(isinstance(s, dict) and s.get("type") == "download" for s in steps) or \
        any(isinstance(g, dict) and g.get("type") == "cloud_file" for g in getters)


def _split_pairs(split: str) -> set[tuple[str, str]]:
    """The (domain, task id) pairs a split lists (arpo_async.task_sets.load_split: a file or a named split)."""
    from arpo_async.task_sets import load_split
    return {(domain, task_id) for domain, ids in load_split(split).items() for task_id in ids}


def _stand_in(folder: Path, split: str | None, args: argparse.Namespace) -> int:
    """Write the stand-in mirror of the task set's files (runs/osworld-coverage/stand-in, this generator's own
    folder: a rerun replaces its files), point ``args.osworld_files`` at it; the number of files written."""
    from actors.osworld.stand_in_mirror import write_mirror
    from actors.osworld.task_files import scan_task_files
    from arpo_async.task_sets import load_task_set
    mirror = ROOT / "runs" / "osworld-coverage" / "stand-in"
    mirror.parent.mkdir(parents=True, exist_ok=True)
    files, _ = scan_task_files(load_task_set(folder, split))
    manifest = write_mirror(files, mirror, source={"tasks": str(folder), "split": split})
    args.osworld_files = str(mirror)
    print(f"stand-in mirror: {len(manifest['files'])} files in {mirror} ({len(manifest['left_out'])} left out)")
    return len(manifest["files"])


def _image(profile: str) -> str:
    from actors.desktop.build import build_image
    return build_image(profile=profile) if profile != "default" else build_image()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", type=Path,
                        help="task folder, e.g. OSWorld/evaluation_examples/examples from a clone of "
                             "https://github.com/xlang-ai/OSWorld (required unless --quick)")
    parser.add_argument("--desktops", type=int, default=0, help="desktops at a time for setup+evaluate (0: load only)")
    parser.add_argument("--domains", default="", help="comma-separated domains (sub-folders) to keep, e.g. os,vlc")
    parser.add_argument("--offline-only", action="store_true", help="only tasks that need no download")
    parser.add_argument("--profile", default="osworld", help="desktop image profile (default osworld)")
    parser.add_argument("--json", type=Path, help="write every task's report here")
    parser.add_argument("--offline-split", type=Path, metavar="FILE",
                        help="write the tasks that need no download as a split {domain: [task ids]} (for "
                             "`arpo eval --split FILE`) and exit")
    parser.add_argument("--split", default="",
                        help="keep only the tasks of this split (a file {domain: [task id, ...]} or a named split: "
                             "arpo-128, osworld-369, osworld-361)")
    parser.add_argument("--osworld-files", default="",
                        help="local mirror of OSWorld's files (learner.osworld_files), e.g. a stand-in mirror "
                             "from python -m actors.osworld.stand_in_mirror")
    parser.add_argument("--stand-in", action="store_true",
                        help="write a stand-in mirror of the tasks' files (actors.osworld.stand_in_mirror: valid "
                             "files of the right type, not OSWorld's) under runs/osworld-coverage/stand-in and use "
                             "it as --osworld-files")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke mode: {QUICK_DIR.relative_to(ROOT)} in 1 desktop of the default image")
    args = parser.parse_args(argv)
    if args.quick:
        args.folder, args.desktops, args.profile = args.folder or QUICK_DIR, max(1, args.desktops), "default"
    if args.folder is None:
        parser.error("give the task folder: OSWorld's evaluation_examples/examples from a clone of "
                     "https://github.com/xlang-ai/OSWorld (or --quick for this repository's OSWorld-format tasks)")
    if not args.folder.is_dir():
        parser.error(f"{args.folder} is not a folder")
    folder = args.folder
    files = task_files(folder)
    domains = {d for d in args.domains.split(",") if d}
    listed = _split_pairs(args.split) if args.split else None
    keep = {str(f) for f in files if (not domains or f.parent.name in domains)
            and (listed is None or (f.parent.name, f.stem) in listed)
            and not (args.offline_only and needs_download(str(f)))}
    if args.offline_split:
        split: dict[str, list[str]] = {}
        for f in sorted(files, key=str):
            if str(f) in keep and not needs_download(str(f)):
                split.setdefault(f.parent.name, []).append(f.stem)
        args.offline_split.write_text(json.dumps(split, indent=1) + "\n", encoding="utf-8")
        print(f"{sum(map(len, split.values()))} tasks need no download: {args.offline_split}")
        return 0
    stand_in_files = _stand_in(folder, args.split or None, args) if args.stand_in else 0
    image = _image(args.profile) if args.desktops > 0 else None

    def progress(r: TaskReport) -> None:
        print(r.progress_line(), flush=True)

    t0 = time.monotonic()
    memory_mb = 2048 if args.profile == "osworld" else 512
    downloads = run_download_cache(ROOT / "runs" / "osworld-coverage", args.osworld_files)
    reports = asyncio.run(check_folder(folder, desktops=args.desktops, image=image, memory_mb=memory_mb,
                                       run_id=f"osworld-coverage-{secrets.token_hex(3)}", progress=progress, keep=keep,
                                       downloads=downloads))
    minutes = (time.monotonic() - t0) / 60
    print(format_report(reports, ran_desktops=args.desktops > 0))
    if args.json:
        write_json(reports, args.json)
    offline = [r for r in reports if not needs_download(r.path)]
    figures: dict[str, float | int | str] = {
        "tasks": len(reports), "load": sum(r.loaded for r in reports),
        "setup": sum(r.stage in ("evaluate", "ok") for r in reports),
        "evaluate": sum(r.stage == "ok" for r in reports),
        "load_frac": sum(r.loaded for r in reports) / max(1, len(reports)),
        "evaluate_frac_offline": sum(r.stage == "ok" for r in offline) / max(1, len(offline)),
        "download_ok": sum(r.stage == "ok" and needs_download(r.path) for r in reports),
        "stand_in_files": stand_in_files, "minutes": minutes}
    print(result_line(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
