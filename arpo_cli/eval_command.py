"""``arpo eval``: score a policy on a task set with real desktops (actors.eval.evaluate), from one command.

The policy is one of:

- ``--model DIR``: a Hugging Face folder, a run's ``weights/vN``, or a run folder (its newest ``weights/vN``);
  arpo-serve is started for it (``OUT/logs/serve.log``) on a free port of 127.0.0.1 (``--set serve.port=N``: N,
  refused when taken) and stopped after. A run's own ``config.toml`` (the run folder's, or the one above
  ``weights/``) is the base config, less its run_id (the desktops get a label of their own), so the episodes use
  the run's screen, prompt, grammar and step budget unless flags say otherwise;
- ``--url URL``: an SGLang or arpo-serve server already running (its ``/generate``);
- ``--openai-url URL --openai-model NAME``: any OpenAI-compatible chat-completions server (actors.openai_policy);
- ``--oracle``: the scripted oracle (actors.oracle), which solves the built-in tasks from the app's layout: its
  successful episodes are demonstrations for ``learner.replay_demos``.

With ``--url``, ``--openai-url`` and ``--oracle`` the prompt is built with the tokenizer of ``--tokenizer DIR``
(default: the tiny policy's, created if missing). Exit status (:data:`EXIT_STATUS`): 0 when the evaluation ran
(whatever the score, some episodes errored or not), 1 when it could not (the server did not start, Docker
failed), 2 for a bad flag (a --model or --tokenizer that is no model folder, a URL that is not one), config, task
folder or split or a refused results folder (actors.eval.folder), all found before anything is built, started or
written (:func:`check_arguments`), 3 when every episode of the report errored (the report is written; e.g. the
inference server is down), 130 after Ctrl-C or SIGTERM (the report of what finished is written, every desktop
removed; ``--resume`` finishes it).

``--compare A B`` runs nothing: it prints two reports side by side (:mod:`arpo_cli.eval_compare`).
"""
from __future__ import annotations

import argparse
import math
import re
import shlex
import signal
import sys
from pathlib import Path
from urllib.parse import urlsplit

from arpo_async.config import ConfigError, RunConfig, load_config
from arpo_async.config_doc import add_config_arguments

WEIGHTS_DIR = re.compile(r"^v(\d+)$")
EXIT_ALL_ERRORED = 3
"""Exit status when every episode of the report errored: no episode was scored, so the score means nothing."""
EXIT_STATUS = ("exit status: 0 the evaluation ran (whatever the score; some episodes may have errored); 1 it could "
               "not start (the server did not start, Docker failed); 2 a bad flag (e.g. a --model that is no model "
               "folder), config, task folder or split, or an --out refused (not arpo eval's, evaluated with other "
               "settings, a link inside, cannot be made), found before anything starts; "
               f"{EXIT_ALL_ERRORED} every episode errored (e.g. the inference server is down; the report lists "
               "why); 130 Ctrl-C or SIGTERM (the report of what finished is written, every desktop removed)")


class EvalArgumentError(ValueError):
    """A flag of ``arpo eval`` names nothing usable (exit 2, before anything is built or started); the message
    names the flag."""


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``arpo eval`` to the CLI's subcommands."""
    from actors.eval.runner import DEFAULT_REPLY_RETRIES, DEFAULT_TEMPERATURE

    p = sub.add_parser(
        "eval", help="score a policy on a task set with real desktops (report.md, OSWorld-layout results)",
        description="Run every task of a task set (x --repeats) with a policy on real desktops, write each "
                    "episode as OSWorld's runner does (OUT/<domain>/<task id>/result.txt, traj.jsonl, screenshots; "
                    "OUT/repeat-<k>/<domain>/<task id>/ with --repeats K > 1), which OSWorld's show_result.py "
                    "reads, and report.json / report.md led by OSWorld's score (the mean score over the planned "
                    "episodes, as sum/total and a percentage, with a 95% interval over tasks), then the mean over "
                    "the episodes that ran (show_result.py's), the success rate at the threshold, pass@k and mean "
                    "steps, overall, per domain and per task. Errored episodes score 0 and are listed, by cause "
                    "(the harness could not run it / the agent's episode failed). "
                    + EXIT_STATUS + ".")
    policy = p.add_argument_group("policy (one of --model, --url, --openai-url, --oracle)")
    policy.add_argument("--model", type=Path, help="a Hugging Face folder, a run's weights/vN, or a run folder "
                                                   "(its newest weights); arpo-serve is started for it")
    policy.add_argument("--url", help="a running SGLang or arpo-serve server, e.g. http://127.0.0.1:30000")
    policy.add_argument("--openai-url", help="an OpenAI-compatible server's base URL, e.g. http://127.0.0.1:8000/v1")
    policy.add_argument("--openai-model", help="the model name to ask the OpenAI-compatible server for")
    policy.add_argument("--oracle", action="store_true",
                        help="the scripted oracle, which solves the built-in tasks from the app's layout: its "
                             "successes are demonstrations for learner.replay_demos")
    policy.add_argument("--openai-regex", action="store_true",
                        help="also send the action grammar as SGLang's `regex` field (SGLang's /v1 and arpo-serve "
                             "take it; most other servers refuse unknown fields)")
    policy.add_argument("--api-key", help="key for --url / --openai-url (default: $ARPO_API_KEY / $OPENAI_API_KEY)")
    policy.add_argument("--tokenizer", type=Path, help="model folder whose tokenizer builds the prompt for --url "
                                                       "and --openai-url (default: the tiny policy's)")
    p.add_argument("--tasks", help="a folder of OSWorld-format task files (<domain>/<id>.json), a task file, or "
                                   "a built-in task or family name (default: every built-in task)")
    p.add_argument("--split", help="a split file {domain: [task ids]} (OSWorld's test_all.json form), a "
                                   "built-in split name, e.g. grid4-test, or a named set of OSWorld's tasks "
                                   "(with --tasks OSWorld's evaluation_examples/examples): osworld-369, "
                                   "osworld-361 (no Google Drive tasks), arpo-128 (ARPO's training tasks)")
    p.add_argument("--desktops", type=int, default=8, help="desktops at once (default 8)")
    p.add_argument("--repeats", type=int, default=1, help="episodes per task (default 1; pass@k uses them)")
    p.add_argument("--max-steps", type=int, help="policy steps per episode (default: actors.max_steps of the "
                                                  "config, which a run folder's config.toml sets); 15, 50 and 100 "
                                                  "are the budgets OSWorld's leaderboard and OpenCUA report at, "
                                                  "recorded in report.json's step_budget")
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE,
                   help=f"sampling temperature (default {DEFAULT_TEMPERATURE}: greedy, as OSWorld's UI-TARS agent "
                        "samples, so a score does not move with the seed; use > 0 with --repeats for pass@k)")
    p.add_argument("--reply-retries", type=int, default=DEFAULT_REPLY_RETRIES,
                   help=f"times a step asks the policy again when its reply does not parse (default "
                        f"{DEFAULT_REPLY_RETRIES}: 3 tries in all, as OSWorld's UI-TARS agent; re-asks sample at "
                        "temperature 1.0); replaces actors.reply_retries. When no try parses the episode is a "
                        "POLICY_ERROR scored 0, never FAIL")
    p.add_argument("--seed", type=int, default=0, help="seeds the episode order and arpo-serve's sampler (default 0)")
    p.add_argument("--out", type=Path, help="results folder (default evals/<policy>: --model runs/demo gives "
                                            "evals/runs-demo-v<N> for its weights/vN)")
    p.add_argument("--resume", action="store_true",
                   help="finish an --out that arpo eval created (its arpo-eval.json) with the same policy, step "
                        "budget, temperature and tasks: keep its finished episodes whose files agree, run the rest")
    p.add_argument("--osworld-prefix", metavar="ACTION_SPACE/OBSERVATION_TYPE/MODEL", default="",
                   help="write each repeat's episodes under OSWorld's results/<action_space>/<observation_type>/"
                        "<model>/ prefix, e.g. pyautogui/screenshot/ui-tars-1.5-7b, so the folder sits beside "
                        "OSWorld's own results (three plain folder names)")
    p.add_argument("--retry-errors", action="store_true",
                   help="with --resume, also run again the episodes that ended in an error (ENV_ERROR, TASK_ERROR, "
                        "ABORTED: e.g. the server was down)")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"),
                   help="run nothing: print two reports (results folders or report.json files) side by side, per "
                        "task, with B - A and whether it exceeds the 95%% intervals, and the provenance that "
                        "differs (commit, desktop image, task files, settings); exit 2 for a file that is not a "
                        "readable arpo eval report")
    add_config_arguments(p, ("", "learner", "actors", "serve"))  # learner.osworld_files, learner.success_threshold


def resolve_model(path: Path) -> tuple[Path, int, Path | None]:
    """The weights folder, its weight version and the run's config.toml (or None) of ``--model PATH``.

    Raises:
        EvalArgumentError: neither a Hugging Face folder (config.json) nor a run folder with weights/vN.
    """
    if (path / "config.json").is_file():
        match = WEIGHTS_DIR.match(path.name)
        if match and path.parent.name == "weights":
            run_config = path.parent.parent / "config.toml"
            return path, int(match[1]), run_config if run_config.is_file() else None
        return path, 0, None
    versions = sorted((int(m[1]), d) for d in (path / "weights").glob("v*")
                      if (m := WEIGHTS_DIR.match(d.name)) and (d / "config.json").is_file())
    if versions:
        run_config = path / "config.toml"
        return versions[-1][1], versions[-1][0], run_config if run_config.is_file() else None
    raise EvalArgumentError(f"--model {path}: not a Hugging Face folder (no config.json) nor a run folder with "
                    "weights/vN")


def eval_config(args: argparse.Namespace, run_config: Path | None, model: Path | None) -> RunConfig:
    """The base config: --config, else the run's config.toml (less its run_id: the evaluation's desktops get their
    own label, never those of a run that may still be going); then --set; ``model`` is the prompt's tokenizer.
    Raises ConfigError."""
    overrides = (["run_id="] if args.config is None and run_config is not None else []) + list(args.overrides)
    if model is not None:
        overrides.append(f"model={model}")  # a str key takes the text as written
    return load_config(args.config or run_config, overrides)


async def _evaluate(args: argparse.Namespace, say) -> dict:
    from actors.eval import evaluate
    from actors.eval.folder import check_owned
    from actors.eval.runner import EvalSettings, claim_results
    from arpo_async.inference_client import PolicyClient, RetryPolicy
    from arpo_async.model.inputs import PromptEncoder
    from arpo_cli.launcher import Children, prepare, wait_healthy
    from arpo_cli.side_by_side import claim_port, log_size

    run_config: Path | None = None
    version: int | None = None
    if args.model is not None:
        weights, version, run_config = resolve_model(args.model)
        tokenizer = weights
        name = f"{args.model}" if weights == args.model else f"{args.model} (weights/v{version})"
        folder = f"{args.model}" if weights == args.model else f"{args.model}-v{version}"
    else:
        tokenizer = args.tokenizer
        name = folder = args.openai_model if args.openai_url else ("oracle" if args.oracle else args.url)
    out = args.out or Path("evals") / (re.sub(r"[^A-Za-z0-9_.-]+", "-", str(folder)).strip("-.") or "policy")
    check_owned(out, args.resume)  # a folder that is not ours is refused before anything is built or written
    config = eval_config(args, run_config, tokenizer)
    check_arguments(args, out, config, {"kind": policy_kind(args), "name": str(name), "weight_version": version})
    # arpo-serve's port: a free one, unless --set serve.port=N asks for N (refused when taken: ConfigError, exit 2)
    asked = any(o.partition("=")[0].strip() == "serve.port" for o in args.overrides) and config.serve.port
    port = claim_port("serve.port", "127.0.0.1", config.serve.port if asked else 0) if args.model is not None else 0
    config = prepare(config, say)  # builds the desktop image and the tiny policy (the default tokenizer) if missing
    encoder = PromptEncoder(config.model_path)
    meta = {"policy": {"kind": policy_kind(args),
                       "name": str(name), "weight_version": version, **policy_location(args, tokenizer)},
            "command": "arpo " + shlex.join(args.argv)}
    claim_results(out, meta["policy"], EvalSettings(args.tasks, args.split, args.desktops, args.repeats,
                                                    args.max_steps, args.temperature, args.seed,
                                                    args.reply_retries, args.osworld_prefix),
                  config, resume=args.resume)  # before arpo-serve writes its log into OUT
    progress = ProgressPrinter()
    async with Children() as children:
        if args.model is not None:
            url, log = f"http://127.0.0.1:{port}", out / "logs" / "serve.log"
            since = log_size(log)  # its ready line must come after this: the server on that port is ours
            serve = await children.start([sys.executable, "-m", "arpo_serve.main", "--model", str(weights),
                                          "--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1],
                                          "--weight-version", str(version), "--seed", str(args.seed)], log)
            await wait_healthy(url, serve, log, ready_since=since)
            say(f"arpo-serve ready at {url} with {weights} (weight version {version}); log {log}")
        if args.oracle:
            from actors.oracle import OraclePolicy
            from arpo_async.task_sets import load_task_set

            policy = OraclePolicy([e.task for e in load_task_set(args.tasks, args.split) if e.task is not None],
                                  encoder, config.actors)
        elif args.openai_url:
            from actors.openai_policy import OpenAIChatPolicy
            policy = OpenAIChatPolicy(args.openai_url, args.openai_model, encoder, api_key=args.api_key or "",
                                      send_regex=args.openai_regex, extra_body={"seed": args.seed},
                                      retry=RetryPolicy(attempts=config.actors.policy_attempts,
                                                        max_delay_s=config.actors.policy_max_wait_s))
        else:
            ac = config.actors
            policy = PolicyClient([url if args.model is not None else args.url], api_key=args.api_key or "",
                                  retry=RetryPolicy(attempts=ac.policy_attempts, max_delay_s=ac.policy_max_wait_s))
        try:
            return await evaluate(policy, args.tasks, split=args.split, desktops=args.desktops,
                                  repeats=args.repeats, max_steps=args.max_steps, temperature=args.temperature,
                                  reply_retries=args.reply_retries,
                                  seed=args.seed, out=out, resume=args.resume, config=config, encoder=encoder,
                                  meta={**meta, "out": str(out)}, progress=progress,
                                  retry_errors=args.retry_errors, results_prefix=args.osworld_prefix)
        finally:
            await policy.aclose()
            progress.close()


def policy_location(args: argparse.Namespace, weights: Path | None) -> dict:
    """Where the policy is, for the report's provenance: ``{"weights": absolute folder}`` for ``--model``,
    ``{"url": base URL}`` for ``--openai-url`` (its ``name`` is the model's), ``{}`` otherwise (the ``name`` of
    ``--url`` is its URL; the oracle has none)."""
    if args.model is not None and weights is not None:
        return {"weights": str(Path(weights).resolve())}
    return {"url": args.openai_url} if args.openai_url else {}


def policy_kind(args: argparse.Namespace) -> str:
    """The kind of policy the flags name: "model", "openai", "oracle" or "url"."""
    return "model" if args.model else ("openai" if args.openai_url else ("oracle" if args.oracle else "url"))


def check_arguments(args: argparse.Namespace, out: Path, config: RunConfig, policy: dict) -> None:
    """Refuse what the flags name but cannot be used, before anything is built, started or written (no arpo-serve,
    no desktop image, no tiny model, nothing in ``out``): the prompt's model folder (``--tokenizer`` or the
    config's ``model``), the task set and split, and the results folder ``out`` as :func:`claim_results
    <actors.eval.runner.claim_results>` would claim it for ``policy`` (kind, name, weight_version) and ``config``.

    Raises (exit 2): EvalArgumentError; TaskFormatError (tasks or split); ResultsFolderError, FileExistsError (the
    results folder, actors.eval.folder)."""
    from dataclasses import replace

    from actors.desktop.build import image_tag
    from actors.eval.runner import EvalSettings, claim_results
    from arpo_async.task_sets import load_task_set

    if config.model and not (config.model_path / "config.json").is_file():
        flag = "--tokenizer" if args.tokenizer is not None else "model (the config's key)"
        raise EvalArgumentError(f"{flag} {config.model_path}: not a Hugging Face folder (no config.json)")
    settings = EvalSettings(args.tasks, args.split, args.desktops, args.repeats, args.max_steps, args.temperature,
                            args.seed, args.reply_retries, args.osworld_prefix)
    entries = load_task_set(args.tasks, args.split)
    resolved = replace(config, model=str(config.model_path.resolve()), actors=replace(  # as prepare() resolves it
        config.actors, image=config.actors.image or image_tag(config.actors.image_profile)))
    claim_results(out, policy, settings, resolved, resume=args.resume, entries=entries, check_only=True)


class ProgressPrinter:
    """Shows ``Progress.line()`` (a live line on a terminal, plain lines elsewhere)."""

    def __init__(self) -> None:
        from arpo_cli.progress import open_display

        self.display = open_display(sys.stderr)

    def __call__(self, counts) -> None:
        import time

        self.display.update(counts.line(), time.monotonic(), force=counts.done == counts.planned)

    def close(self) -> None:
        self.display.close()


def check_policy_args(args: argparse.Namespace) -> str | None:
    """Why the policy flags are unusable, or None."""
    from actors.eval.results import parse_prefix

    given = [f for f in ("model", "url", "openai_url") if getattr(args, f) is not None] + (["oracle"] if args.oracle
                                                                                         else [])
    if len(given) != 1:
        return "give exactly one of --model, --url, --openai-url, --oracle"
    if args.openai_url and not args.openai_model:
        return "--openai-url needs --openai-model NAME"
    if args.desktops < 1 or args.repeats < 1 or (args.max_steps is not None and args.max_steps < 1):
        return "--desktops, --repeats and --max-steps must be >= 1"
    if not 0 <= args.temperature < math.inf:
        return "--temperature must be a number >= 0"
    if not 0 <= args.reply_retries <= 10:
        return f"--reply-retries {args.reply_retries}: must be 0..10"
    if args.seed < 0:
        return "--seed must be >= 0"
    try:
        parse_prefix(args.osworld_prefix)
    except ValueError as e:
        return str(e)
    for flag, url in (("--url", args.url), ("--openai-url", args.openai_url)):
        if url is not None and not _http_url(url):
            return f"{flag} {url}: not an http:// or https:// URL with a host (and a port in 1-65535, if any)"
    if args.retry_errors and not args.resume:
        return "--retry-errors needs --resume (it re-runs the errored episodes of an earlier evaluation)"
    return None


def _http_url(url: str) -> bool:
    try:
        parts = urlsplit(url)
        return parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:  # a port that is not a number in 0-65535
        return False


def eval_main(args: argparse.Namespace, argv: list[str]) -> int:
    """Run ``arpo eval`` (``argv``: its command line after ``arpo``, recorded in the report); print the per-task
    table, the headline (actors.eval.report.headline: OSWorld's score first) and where the report is. Returns the
    exit status (module docstring)."""
    import os

    from actors.desktop.build import DesktopBuildError
    from actors.eval.report import headline, task_table
    from arpo_async.tasks import TaskFormatError
    from arpo_cli.launcher import RunError, RunInputError, run_interruptible, sigterm_as_interrupt

    args.argv = argv
    if args.compare is not None:
        return compare_reports(args)
    problem = check_policy_args(args)
    if problem:
        print(f"arpo eval: {problem}", file=sys.stderr)
        return 2
    if args.api_key is None:
        args.api_key = os.environ.get("OPENAI_API_KEY" if args.openai_url else "ARPO_API_KEY")

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGTERM, sigterm_as_interrupt)  # until the event loop takes both signals over
    try:
        report = run_interruptible(lambda signals: _until_signal(signals, _evaluate(args, say)))
    except (ConfigError, TaskFormatError, FileExistsError, ValueError, RunInputError) as e:
        print(f"arpo eval: {e}", file=sys.stderr)
        return 2
    except (RunError, DesktopBuildError, OSError) as e:
        print(f"arpo eval: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("arpo eval: interrupted; the report of the finished episodes is written; --resume finishes it",
              file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(task_table(report))
    out = Path(report["out"])
    print("", *headline(report), f"report: {out / 'report.md'}", sep="\n")
    if report["errors"] and len(report["errors"]) == report["overall"]["episodes"]:
        print(f"arpo eval: every one of the {len(report['errors'])} episodes errored, so nothing was scored (the "
              f"first: {report['errors'][0]['error'][:300]}); exit status {EXIT_ALL_ERRORED}", file=sys.stderr)
        return EXIT_ALL_ERRORED
    return 0


def compare_reports(args: argparse.Namespace) -> int:
    """``arpo eval --compare A B`` (:mod:`arpo_cli.eval_compare`): 0, or 2 with one line when a report cannot be
    read or a policy flag is given too (--compare runs nothing)."""
    from arpo_cli.eval_compare import compare_main

    if args.model or args.url or args.openai_url or args.oracle or args.resume:
        print("arpo eval: --compare compares two reports and runs nothing; give it without --model, --url, "
              "--openai-url, --oracle or --resume", file=sys.stderr)
        return 2
    return compare_main(*args.compare, sys.stdout, sys.stderr)


async def _until_signal(signals, evaluation):
    """Await ``evaluation`` with SIGINT and SIGTERM taken over by ``signals`` (arpo_cli.launcher.RunSignals): the
    first one cancels it, so the report of what finished is written and every desktop and arpo-serve stopped
    before the command exits 130; a later one cannot cut that cleanup short (as `arpo run` does)."""
    signals.install()
    return await evaluation
