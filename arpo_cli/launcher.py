"""`arpo run`: the embedded default on one machine.

Owns: the three child processes of a local run and their logs (``<run>/logs/{serve,learner,actors}.log``).
Order: build the desktop image and the tiny model if missing -> write ``<run>/config.toml`` -> start
arpo-serve and wait for /health -> start arpo-learner and arpo-actors -> show a progress line (arpo_cli.progress:
live in a terminal, plain lines in a pipe) from ``status.json`` and ``metrics.jsonl`` and redraw ``<run>/curve.png`` every ``CURVE_EVERY_S`` -> when the learner
exits, write summary.json and the final curve.png, stop the actors (SIGTERM, they remove their desktops; they may
have exited already, once the learner said shutdown), then the server -> remove any container still labelled with
this run. Exit code: the learner's (a curve that cannot be drawn is a warning, never an error). A child that
died is reported with its log's last lines (from its last traceback: see :func:`crash_excerpt`).
Invariant: whatever ends the run (success, a crashed child, Ctrl-C), no container of this run is left.
A run folder that already holds a run is refused unless ``resume`` is set: then the learner continues from
the newest checkpoint in ``<run>/checkpoints`` (see learner.checkpoint) and metrics.jsonl keeps growing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Callable

from arpo_async.config import RunConfig, dump_toml
from arpo_cli.curve import CurveError, write_curve
from arpo_async.metrics import read_metrics
from arpo_cli.progress import ProgressDisplay, TrajectoryRate, open_display, progress_line

log = logging.getLogger("arpo.run")

STOP_GRACE_S = 60.0
"""Seconds a child gets to exit after SIGTERM before it is killed."""
LEARNER_EXIT_GRACE_S = 60.0
"""Seconds the learner gets to exit after arpo-actors exited 0 (which it does once the learner said shutdown)."""
CURVE_EVERY_S = 60.0
"""While the run goes, ``<run>/curve.png`` is redrawn this often (seconds)."""
CRASH_LINES = 60
"""A dead child's message quotes at most this many last lines of its log."""


class RunError(RuntimeError):
    """The local run could not start or a child process died; the message says which and where its log is."""


def prepare(config: RunConfig, say: Callable[[str], None]) -> RunConfig:
    """Build the desktop image and the tiny model when missing; returns the config with both resolved."""
    from actors.desktop.build import build_image, image_exists, image_tag
    from arpo_async.model.init_model import create_tiny_model

    image = config.actors.image or image_tag(config.actors.image_profile)
    if not image_exists(image):
        if config.actors.image:
            raise RunError(f"desktop image {image} does not exist (build it, or leave actors.image empty)")
        say(f"building the desktop image {image} (first run only, a few minutes)")
        build_image(log=say, profile=config.actors.image_profile)
    model = config.model_path
    if not (model / "config.json").exists():
        if config.model:
            raise RunError(f"no model at {model} (expected a Hugging Face folder with config.json)")
        say(f"creating the tiny random Qwen2.5-VL policy in {model}")
        create_tiny_model(model)
    return replace(config, model=str(model.resolve()), actors=replace(config.actors, image=image))


def spawn(args: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a child process in its own process group with stdout+stderr to ``log_path``; ``env`` adds to this
    process's environment (secrets go there, not on the command line where ``ps`` shows them)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, **env} if env else None)


def wait_healthy(url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float = 300.0) -> None:
    """Poll ``url``/health until it answers 200. Raises RunError if the process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RunError(f"arpo-serve exited with {proc.returncode}; see {log_path}:\n{crash_excerpt(log_path)}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise RunError(f"arpo-serve did not answer {url}/health within {timeout_s:.0f} s; see {log_path}")


def tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of the text file ``path`` ("" when it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def crash_excerpt(path: Path, max_lines: int = CRASH_LINES, context: int = 2) -> str:
    """What a dead child's log says about its death: from ``context`` lines before its last
    ``Traceback (most recent call last):`` to the end (arpo_async.process logs a crash's traceback at ERROR),
    at most the last ``max_lines`` lines; the last 15 lines when it holds no traceback; "" when unreadable."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    starts = [i for i, line in enumerate(lines) if "Traceback (most recent call last):" in line]
    first = max(0, starts[-1] - context) if starts else len(lines) - 15
    return "\n".join(lines[max(first, len(lines) - max_lines, 0):])


def stop(proc: subprocess.Popen | None, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the child's process group, wait ``grace_s``, then SIGKILL it."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def check_children(learner: subprocess.Popen, actors: subprocess.Popen, serve: subprocess.Popen, logs: Path) -> None:
    """Raise RunError when arpo-serve or arpo-actors ended while the learner runs.

    arpo-actors exits 0 by itself only after the learner said shutdown (training is over), so then the learner
    gets LEARNER_EXIT_GRACE_S seconds to exit; any other exit of a child is an error naming its log.
    """
    if serve.poll() is not None:
        raise RunError(f"arpo-serve exited with {serve.returncode}; see {logs / 'serve.log'}:\n"
                       f"{crash_excerpt(logs / 'serve.log')}")
    code = actors.poll()
    if code is None:
        return
    why = f"exited with {code}"
    if code == 0:
        try:
            learner.wait(LEARNER_EXIT_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            why += f" and arpo-learner did not finish within {LEARNER_EXIT_GRACE_S:g} s"
    raise RunError(f"arpo-actors {why}; see {logs / 'actors.log'}:\n{crash_excerpt(logs / 'actors.log')}")


def draw_curve(run: Path, *, quiet_if_empty: bool = False) -> Path | None:
    """Write ``<run>/curve.png`` (arpo_cli.curve.write_curve); returns its path, or None when it could not be
    drawn. Never raises: a failure is logged as a warning (``quiet_if_empty``: not when no step is recorded yet,
    the normal state early in a run)."""
    try:
        return write_curve(run)
    except CurveError as e:
        if not quiet_if_empty:
            log.warning("no learning curve: %s", e)
    except Exception as e:  # noqa: BLE001 -- a picture must never end or fail a run
        log.warning("could not draw %s: %s: %s", run / "curve.png", type(e).__name__, e)
    return None


def server_weight_version(url: str, api_key: str = "") -> str | None:
    """The weight_version an inference server reports in /get_model_info (None if it does not answer)."""
    request = urllib.request.Request(f"{url}/get_model_info",
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return json.loads(reply.read()).get("weight_version")
    except (urllib.error.URLError, OSError, json.JSONDecodeError):
        return None


def write_summary(config: RunConfig, exit_code: int, url: str, wall_s: float) -> dict:
    """Write ``<run>/summary.json``: exit code, optimizer steps (the last metrics record's ``step``; a record is one
    trained batch of ``learner.updates_per_batch`` steps), the last published version and what the server
    reports."""
    records = read_metrics(config.run_path / "metrics.jsonl")
    summary = {"exit_code": exit_code, "steps": records[-1]["step"] if records else 0,
               "policy_version": records[-1]["policy_version"] if records else 0,
               "server_weight_version": server_weight_version(url, config.serve.api_key), "wall_s": round(wall_s, 1)}
    (config.run_path / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_local(config: RunConfig, *, display: ProgressDisplay | None = None, resume: bool = False) -> int:
    """Run serve + learner + actors on this machine until the learner finishes. Returns the exit code.

    ``display``: where the progress line and messages go (default: arpo_cli.progress.open_display(), a live
    line in a terminal, plain lines otherwise).

    ``resume``: continue the run in ``config.run_dir`` from its newest checkpoint (learner.steps counts all
    steps of the run, so raise it to train further). SIGTERM is handled like Ctrl-C: the children are stopped
    and the run's containers removed; further Ctrl-C or SIGTERM during that cleanup are ignored, so it always
    completes (children get SIGTERM, then SIGKILL after a grace period).

    Raises:
        RunError: the folder holds a run and ``resume`` is False, or ``resume`` is set and it has no
            checkpoint; a child process died (the message names its log and quotes its last lines).
    """
    signal.signal(signal.SIGTERM, _interrupt)
    display = open_display() if display is None else display
    try:
        return _run_local(config, display, resume)
    finally:
        display.close()


def _run_local(config: RunConfig, display: ProgressDisplay, resume: bool) -> int:
    from actors.desktop.fleet import remove_run_containers

    say = display.say
    run = config.run_path
    if resume:
        from learner.checkpoint import checkpoint_folders
        if not checkpoint_folders(run / "checkpoints"):
            raise RunError(f"{run} has no checkpoint to resume from ({run / 'checkpoints'} is empty or missing)")
        (run / "status.json").unlink(missing_ok=True)  # the dead learner's; the new one rewrites it
    elif (run / "metrics.jsonl").exists():
        raise RunError(f"{run} already holds a run (metrics.jsonl); pass another --out, remove it, "
                       "or pass --resume to continue it from its last checkpoint")
    config = prepare(config, say)
    (run / "logs").mkdir(parents=True, exist_ok=True)
    config_path = run / "config.toml"
    config_path.write_text(dump_toml(config))
    logs = run / "logs"
    url = config.actors.inference_urls[0]
    py = sys.executable
    serve = learner = actors = None
    started = time.monotonic()
    try:
        say(f"run folder {run}; logs in {logs}")
        # arpo-serve reads model and [serve] from the run file, as the learner and the actors do.
        serve = spawn([py, "-m", "arpo_serve.main", "--config", str(config_path), "--weight-version", "0",
                       "--weights-root", str(run / "weights")], logs / "serve.log")
        wait_healthy(url, serve, logs / "serve.log")
        say(f"arpo-serve ready at {url}")
        learner = spawn([py, "-m", "learner.main", "--config", str(config_path)], logs / "learner.log")
        actors = spawn([py, "-m", "actors.main", "--config", str(config_path), "--actor-id", "local"],
                       logs / "actors.log")
        rate, last_drawn = TrajectoryRate(), time.monotonic()
        while learner.poll() is None:
            check_children(learner, actors, serve, logs)
            display.update(progress_line(config, started, rate), time.monotonic())
            if time.monotonic() - last_drawn >= CURVE_EVERY_S:
                draw_curve(run, quiet_if_empty=True)
                last_drawn = time.monotonic()
            time.sleep(1.0)
        display.update(progress_line(config, started, rate), time.monotonic(), force=True)
        write_summary(config, learner.returncode, url, time.monotonic() - started)
        curve = draw_curve(run)
        if curve is not None:
            say(f"learning curve in {curve}")
        if learner.returncode != 0:
            say(f"arpo-learner exited with {learner.returncode}; see {logs / 'learner.log'}:\n"
                f"{crash_excerpt(logs / 'learner.log')}")
        return learner.returncode
    finally:
        # A second Ctrl-C (or SIGTERM) must not cut the cleanup short and leave children or containers behind.
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            stop(actors)
            stop(learner)
            stop(serve, grace_s=10)
            removed = asyncio.run(remove_run_containers(config.resolved_run_id))
            if removed:
                say(f"removed {removed} leftover desktop container(s)")
            say(f"done in {time.monotonic() - started:.0f} s; metrics in {run / 'metrics.jsonl'}")
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
