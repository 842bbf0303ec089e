"""The `arpo` command: `arpo run`, `arpo launch`, `arpo config show`, `arpo curve`, `arpo view`, `arpo desktop build`,
`arpo desktop clean`, `arpo tasks check`, `arpo osworld fetch`, `arpo init-model`,
`arpo keys`.

Role: the command-line layer on top of arpo_async, actors and learner (none of them imports it)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from arpo_async.config import ConfigError, RunConfig, load_config
from arpo_async.config_doc import SECTIONS, add_config_arguments, render_toml
from arpo_async.model import init_model
from arpo_cli.arg_parser import ArpoParser

EXIT_STATUS = ("Exit status, every command: 0 done; 2 a usage or config error, reported in one line before anything "
               "starts (an unknown command or flag, a bad value, a config key or run file that is wrong, a folder "
               "or file a command refuses); 1 the command could not finish (a process it started failed, Docker or "
               "the disk failed); 130 interrupted (Ctrl-C or SIGTERM: what was started is stopped). Besides: `arpo "
               "eval` 3 when every episode errored; `arpo tasks check` 1 when a task file does not load.")
"""The exit statuses every `arpo` command keeps (its own description adds its particular ones)."""


def build_parser() -> argparse.ArgumentParser:
    parser = ArpoParser(
        prog="arpo", description="arpo-async: asynchronous ARPO (GRPO + success replay) for GUI agents on docker "
                                 "desktops", epilog="Every key of the run file, with its value, default and meaning: "
                                                    "`arpo config show`. Help of a command: `arpo COMMAND --help`. "
                                                    + EXIT_STATUS)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run serve + learner + actors on this machine (the embedded default)",
                         description="Start arpo-serve, arpo-learner and arpo-actors on this machine with one run "
                                     "file and watch them until the learner finishes.")
    add_config_arguments(run, ("", "transport", "learner", "actors", "serve", "eval"))
    _add_run_arguments(run)

    launch = sub.add_parser("launch", help="run serve + learner ranks + actors on a Ray cluster (needs ray: "
                                           "pip install -e '.[cluster]')",
                            description="Place the inference servers, the learner's ranks and one arpo-actors per "
                                        "node offering the desktops resource on a running Ray cluster, as the run "
                                        "file's [cluster] section says; show the progress line, gather every log "
                                        "into RUN/logs, and stop everything (every container removed) when the "
                                        "learner finishes or on Ctrl-C. Guide: docs/guides/ray-cluster.md.")
    launch.add_argument("--address", required=True, help="the Ray head's GCS address HOST:PORT (what `ray start "
                                                          "--head` printed; port 6379 by default)")
    add_config_arguments(launch, ("", "cluster", "transport", "learner", "actors", "serve", "eval"))
    _add_run_arguments(launch)

    config = sub.add_parser("config", help="the run config: `arpo config show` lists every key")
    csub = config.add_subparsers(dest="config_command", required=True)
    show = csub.add_parser("show", help="print every config key with its value, default and docstring",
                           description="Print the run config as commented TOML: every key with its docstring, its "
                                       "value (after --config and --set) and its default. The output is itself a "
                                       "run file: `arpo config show > run.toml`.")
    add_config_arguments(show, ("", *SECTIONS))
    show.add_argument("--section", action="append", choices=("top", *SECTIONS), metavar="SECTION",
                      help=f"only these sections (repeatable; top = the top-level keys; one of top, "
                           f"{', '.join(SECTIONS)})")

    curve = sub.add_parser("curve", help="draw RUN_DIR/curve.png from its metrics.jsonl (running or finished run), "
                                         "or compare runs: RUN_DIR RUN_DIR ... --to FILE",
                           usage="%(prog)s [-h] RUN_DIR [RUN_DIR ...] [--to FILE]",  # RUN_DIR is optional to
                           # argparse only for the old --out
                           description="Draw RUN_DIR/curve.png from RUN_DIR/metrics.jsonl and print its path: "
                                       "success rate and reward against the optimizer step and against wall time. "
                                       "With several run folders (or --to), draw their training success in one "
                                       "picture at FILE instead, one line per run; a run that took no optimizer "
                                       "step is a flat line at its episodes' success (from its status.json). "
                                       "Exit status: 0 drawn, 2 nothing to draw (no metrics.jsonl or no record in "
                                       "it), 1 the picture could not be written.")
    curve.add_argument("run_dir", type=Path, nargs="*", metavar="RUN_DIR", help="the run folder, e.g. runs/demo")
    curve.add_argument("--to", type=Path, metavar="FILE", help="the comparison picture (PNG) of several runs")
    curve.add_argument("--out", type=Path, dest="old_out", help=argparse.SUPPRESS)  # the old spelling of RUN_DIR

    view = sub.add_parser("view", help="write RUN_DIR/view.html: sampled episodes with screenshots and action marks",
                          description="Write a static page (works offline) of the trajectories the learner sampled "
                                      "into RUN_DIR/trajectories (learner.sample_trajectories, sample_disk_mb): per "
                                      "episode the instruction, each step's screenshot with its click or drag drawn "
                                      "on it, thought, action, reward, outcome, policy version and timings; and "
                                      "success-rate and reward curves from metrics.jsonl. RUN_DIR may also be an "
                                      "`arpo eval` results folder (its episodes). Exit status: 0 written, 2 not a "
                                      "folder or no episode in it (nothing written), 1 the page or the port "
                                      "failed.")
    view.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run folder, e.g. runs/demo")
    view.add_argument("--out", type=Path, help="the page file (default RUN_DIR/view.html)")
    view.add_argument("--serve", action="store_true",
                      help="also serve the page on http://127.0.0.1:PORT/ (re-rendered on each load) until Ctrl-C")
    view.add_argument("--port", type=int, default=8765, help="port for --serve (default 8765; 0 = any free one)")

    desktop = sub.add_parser("desktop", help="the desktop image and containers")
    dsub = desktop.add_subparsers(dest="desktop_command", required=True)
    build = dsub.add_parser("build", help="build arpo-desktop:<version> locally (no registry needed)")
    build.add_argument("--force", action="store_true", help="rebuild even if the image exists")
    build.add_argument("--profile", choices=("default", "osworld"), default="default",
                       help="default: the small image `arpo run` uses; osworld: OSWorld's apps and session "
                            "(arpo-desktop-osworld, ~2 GB; use with actors.image_profile=\"osworld\")")
    clean = dsub.add_parser("clean", help="remove arpo desktop containers: one run's (--run-id) or all (--all)",
                            description="Remove the desktop containers of one run (--run-id RUN_ID, the run's "
                                        "run_id) or, with --all, every arpo desktop container on this host, other "
                                        "users' runs included; one of the two is required (without either, nothing "
                                        "is removed and the exit status is 2).")
    which = clean.add_mutually_exclusive_group()
    which.add_argument("--run-id", help="only this run's containers (its run_id: `arpo run` prints it)")
    which.add_argument("--all", action="store_true",
                       help="every arpo desktop container on this host, other users' runs included")

    tasks = sub.add_parser("tasks", help="task files: check which load, set up and evaluate")
    tsub = tasks.add_subparsers(dest="tasks_command", required=True)
    check = tsub.add_parser("check", help="load one task file or every task of a folder (OSWorld layout "
                                          "<domain>/<id>.json) and, with --desktops N, set each up in a real "
                                          "desktop and evaluate it untouched",
                            description="Load one task file, or every *.json under a folder (OSWorld's layout "
                                        "<domain>/<id>.json), as the learner would; with --desktops N also set "
                                        "each up in a fresh desktop and evaluate it untouched. Prints a per-domain "
                                        "table and every failed task's reason. Exit status: 0 when every task "
                                        "loaded, 1 when any task failed to load or the check could not run, 2 for "
                                        "a bad config or a PATH that does not exist.")
    check.add_argument("path", type=Path, metavar="PATH",
                       help="a task file or a folder of them, e.g. arpo_async/tasks_builtin or OSWorld's "
                            "evaluation_examples/examples")
    check.add_argument("--desktops", type=int, default=0, help="desktops at a time (default 0: only load)")
    check.add_argument("--profile", choices=("default", "osworld"), default="osworld",
                       help="desktop image profile for --desktops (default osworld; built if missing)")
    check.add_argument("--json", type=Path, help="also write every task's report as JSON here")
    add_config_arguments(check, ("", "learner", "actors"))  # learner.osworld_files, actors.download_*, memory
    tsub.add_parser("splits", help="list the splits --split and eval.split take by name, with their task counts",
                    description="List the splits that `arpo eval --split` and eval.split take by name: the "
                                "built-in families' train and test splits, and the named sets of OSWorld's tasks "
                                "(osworld-369, osworld-361, arpo-128: give OSWorld's evaluation_examples/examples "
                                "as --tasks), with where each list comes from and its licence.")

    from arpo_cli.eval_command import add_eval_parser
    add_eval_parser(sub)
    from arpo_cli.export_command import add_export_parser
    add_export_parser(sub)
    from arpo_cli.osworld_fetch import add_osworld_parser
    add_osworld_parser(sub)

    init_model.add_arguments(sub.add_parser("init-model", help="create a tiny random Qwen2.5-VL policy offline"))
    keys = sub.add_parser("keys", help="write a ZeroMQ CURVE key pair (the learner's, or an actor host's)")
    keys.add_argument("--out", type=Path, required=True, help="folder for NAME.key (public) and NAME.key_secret")
    keys.add_argument("--name", required=True, help="e.g. learner, or the actor host's name")
    return parser


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `arpo run` and `arpo launch` share: --out, --steps, --actors, --model, --resume."""
    parser.add_argument("--out", type=Path, help="run folder (sets run_dir; default runs/default)")
    parser.add_argument("--steps", type=int, help="optimizer steps before stopping (sets learner.steps; default 3)")
    parser.add_argument("--actors", type=int, help="desktops / EnvActors (sets actors.actors; default 8)")
    parser.add_argument("--model", type=Path, help="policy checkpoint (sets model; default: a tiny random model, "
                                                    "created if missing)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out from its last checkpoint (its config.toml is the base config)")


def write_keys(folder: Path, name: str) -> tuple[Path, Path]:
    """Write a CURVE certificate pair with zmq.auth: ``<folder>/<name>.key`` (public: give it to the peers) and
    ``<name>.key_secret`` (secret, mode 0600: keep it on this host). Returns (public, secret).

    Raises:
        FileExistsError: either file exists already (keys are never overwritten).
    """
    import zmq.auth

    folder.mkdir(parents=True, exist_ok=True)
    public, secret = folder / f"{name}.key", folder / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise FileExistsError(f"{path} exists; remove it first or choose another --name")
    made_public, made_secret = zmq.auth.create_certificates(str(folder), name)
    Path(made_secret).chmod(0o600)
    return Path(made_public), Path(made_secret)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "run":
        return _run(args)
    if args.command == "launch":
        return _launch(args)
    if args.command == "config":
        return _config_show(args)
    if args.command == "curve":
        from arpo_cli.curve import CurveError, write_comparison, write_curve
        if args.old_out is not None:
            print("arpo curve: --out RUN_DIR is deprecated; write `arpo curve RUN_DIR`", file=sys.stderr)
        run_dirs = args.run_dir or ([args.old_out] if args.old_out else [])
        if not run_dirs or (args.run_dir and args.old_out and args.run_dir != [args.old_out]):
            print("arpo curve: give a run folder: arpo curve RUN_DIR (or several, with --to FILE)", file=sys.stderr)
            return 2
        if len(run_dirs) > 1 and args.to is None:
            print("arpo curve: several run folders draw one comparison: add --to FILE", file=sys.stderr)
            return 2
        try:
            print(write_comparison(run_dirs, args.to) if args.to else write_curve(run_dirs[0]))
        except CurveError as e:  # nothing to draw
            print(f"arpo curve: {e}", file=sys.stderr)
            return 2
        except OSError as e:  # the picture cannot be written
            print(f"arpo curve: {e}", file=sys.stderr)
            return 1
        return 0
    if args.command == "view":
        from arpo_cli.viewer import view_main
        return view_main(args.run_dir, out=args.out, serve=args.serve, port=args.port)
    if args.command == "desktop" and args.desktop_command == "build":
        from actors.desktop.build import DesktopBuildError, build_image
        try:
            print(build_image(force=args.force, profile=args.profile))
            return 0
        except DesktopBuildError as e:
            print(f"arpo desktop build: {e}", file=sys.stderr)
            return 1
    if args.command == "desktop" and args.desktop_command == "clean":
        return _desktop_clean(args)
    if args.command == "tasks" and args.tasks_command == "check":
        return _tasks_check(args)
    if args.command == "tasks" and args.tasks_command == "splits":
        print(_splits_table())
        return 0
    if args.command == "keys":
        try:
            public, secret = write_keys(args.out, args.name)
        except (FileExistsError, OSError) as e:
            print(f"arpo keys: {e}", file=sys.stderr)
            return 2
        print(f"public key {public} (give it to the peers)\nsecret key {secret} (keep it here)")
        return 0
    if args.command == "eval":
        from arpo_cli.eval_command import eval_main
        return eval_main(args, list(sys.argv[1:] if argv is None else argv))
    if args.command == "export":
        from arpo_cli.export_command import export_main
        return export_main(args)
    if args.command == "osworld" and args.osworld_command == "fetch":
        from arpo_cli.osworld_fetch import fetch_main
        return fetch_main(args)
    if args.command == "init-model":
        return init_model.run_from_args(args)
    return 2


def _desktop_clean(args: argparse.Namespace) -> int:
    """`arpo desktop clean`: remove one run's desktop containers (--run-id) or every arpo desktop (--all); 2 with
    one line and nothing removed when neither is given or the run id is empty, 1 when Docker fails."""
    from actors.desktop.controller_client import DesktopError
    from actors.desktop.fleet import remove_run_containers

    if not args.all and not (args.run_id or "").strip():
        print("arpo desktop clean: give --run-id RUN_ID (that run's desktops) or --all (every arpo desktop on this "
              "host, other users' runs included); nothing removed", file=sys.stderr)
        return 2
    try:
        print(f"removed {asyncio.run(remove_run_containers(None if args.all else args.run_id))} container(s)")
    except (DesktopError, OSError) as e:
        print(f"arpo desktop clean: {e}", file=sys.stderr)
        return 1
    return 0


def _config_show(args: argparse.Namespace) -> int:
    """`arpo config show`: the config after --config and --set as commented TOML on stdout; 0, or 2 for a bad
    config (the reason on stderr)."""
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"arpo config show: {e}", file=sys.stderr)
        return 2
    sections = None if args.section is None else ["" if s == "top" else s for s in args.section]
    print(render_toml(config, sections=sections), end="")
    return 0


def _splits_table() -> str:
    """`arpo tasks splits`: each split name, its task count and what it is (arpo_async.benchmark_sets)."""
    from arpo_async.benchmark_sets import NAMED_SPLITS
    from arpo_async.task_sets import builtin_split_names, load_split

    rows = [(name, sum(map(len, load_split(name).values())), "built-in tasks") for name in builtin_split_names()]
    rows += [(s.name, s.tasks, f"{s.title}; of OSWorld's task files (--tasks); {s.source} ({s.licence})")
             for s in NAMED_SPLITS.values()]
    width = max(len(name) for name, _, _ in rows)
    return "\n".join(f"{name:<{width}}  {count:>4}  {what}" for name, count, what in rows)


def _tasks_check(args: argparse.Namespace) -> int:
    """`arpo tasks check`: print the per-domain table and every task's reason; 0 when every task loaded (a
    setup or evaluation failure with --desktops is reported, not an error), 1 when any task failed to load or the
    check could not run (the image cannot be built), 2 for a bad config or a path that does not exist."""
    from actors.desktop.build import DesktopBuildError, build_image
    from actors.osworld.downloads import run_download_cache
    from actors.task_check import check_folder, format_report, write_json

    if not args.path.exists():
        print(f"arpo tasks check: {args.path}: no such task file or folder", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config, args.overrides)
        downloads = run_download_cache(config.run_dir, config.learner.osworld_files,
                                       config.actors.download_max_mb, config.actors.download_timeout_s)
    except (ConfigError, ValueError) as e:
        print(f"arpo tasks check: {e}", file=sys.stderr)
        return 2
    memory_mb = max(config.actors.desktop_memory_mb, 2048 if args.profile == "osworld" else 0)
    try:
        image = build_image(profile=args.profile) if args.desktops > 0 else None
        reports = asyncio.run(check_folder(
            args.path, desktops=args.desktops, image=image, memory_mb=memory_mb, downloads=downloads,
            progress=lambda r: print(r.progress_line(), flush=True)))
    except (FileNotFoundError, ValueError, DesktopBuildError) as e:
        print(f"arpo tasks check: {e}", file=sys.stderr)
        return 1
    print(format_report(reports, ran_desktops=args.desktops > 0))
    if args.json:
        write_json(reports, args.json)
    failed = sum(not r.loaded for r in reports)
    if failed:
        print(f"arpo tasks check: {failed} of {len(reports)} task(s) failed to load", file=sys.stderr)
        return 1
    return 0


def _run_config(args: argparse.Namespace) -> RunConfig:
    """The config of `arpo run` / `arpo launch`: --config (or, with --resume, the run folder's config.toml), then
    --set, then --out, --steps, --actors and --model. Raises ConfigError."""
    overrides = list(args.overrides)
    if args.out is not None:
        overrides.append(f"run_dir={args.out}")  # a str key takes the text as written (no TOML quoting)
    if args.steps is not None:
        overrides.append(f"learner.steps={args.steps}")
    if args.actors is not None:
        overrides.append(f"actors.actors={args.actors}")
    if args.model is not None:
        overrides.append(f"model={args.model}")
    config_file = args.config
    if args.resume and config_file is None and args.out is not None and (args.out / "config.toml").exists():
        config_file = args.out / "config.toml"
    return load_config(config_file, overrides)


def _run(args: argparse.Namespace) -> int:
    """`arpo run`: the learner's exit status; 2 with one line for a bad config, task set, model or run folder
    (found before anything starts), 1 when the run could not start or a process failed, 130 after Ctrl-C."""
    from actors.desktop.build import DesktopBuildError
    from arpo_cli.launcher import RunError, RunInputError, run_local

    try:
        return run_local(_run_config(args), resume=args.resume)
    except (ConfigError, RunInputError) as e:
        print(f"arpo run: {e}", file=sys.stderr)
        return 2
    except (RunError, DesktopBuildError) as e:
        print(f"arpo run: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("arpo run: interrupted; containers removed", file=sys.stderr)
        return 130


def _launch(args: argparse.Namespace) -> int:
    """`arpo launch`: 0 when the learner finished, 2 with one message for a bad config, task set, model or run
    folder, 1 for a failed run (or no ray), 130 after Ctrl-C (everything stopped and removed)."""
    from arpo_cli.launcher import RunError, RunInputError

    try:
        config = _run_config(args)
        from arpo_cli.cluster import launch
    except ConfigError as e:
        print(f"arpo launch: {e}", file=sys.stderr)
        return 2
    except ImportError as e:  # ray is the optional extra
        print(f"arpo launch: {e}; install it from the clone with pip install -e '.[cluster]'", file=sys.stderr)
        return 1
    from arpo_cli.cluster_plan import ClusterError
    try:
        return launch(args.address, config, resume=args.resume)
    except (ConfigError, RunInputError) as e:
        print(f"arpo launch: {e}", file=sys.stderr)
        return 2
    except (ClusterError, RunError) as e:
        print(f"arpo launch: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("arpo launch: interrupted; every process stopped and every container removed", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
