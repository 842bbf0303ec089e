"""`arpo run`: the embedded default on one machine.

Owns: the three child processes of a local run and their logs (``<run>/logs/{serve,learner,actors}.log``).
Order: claim the run's ports and run id (arpo_cli.side_by_side) -> load and check the task sets
(:func:`check_tasks`) -> build the desktop image and the tiny model if missing -> write ``<run>/config.toml`` ->
start arpo-serve and wait for /health and its ready line -> start arpo-learner and arpo-actors -> show a progress
line (arpo_cli.progress) from ``status.json`` and ``metrics.jsonl`` and redraw ``<run>/curve.png`` every
``CURVE_EVERY_S`` -> when the learner exits, write summary.json and the final curve.png, stop the actors
(SIGTERM, they remove their desktops; they may have exited already, once the learner said shutdown), the
learner, then the server -> remove any container still labelled with this run. Exit code: the
learner's (a curve that cannot be drawn is a warning, never an error). A child that died is reported with its
log's last lines (from its last traceback: see :func:`crash_excerpt`).

Concurrency: one ``asyncio.run``. The children are asyncio subprocesses owned by :class:`Children`, which stops
every one still running when its block ends, however it ends. :func:`supervise` runs one task per child in a
TaskGroup: the learner's exit or the first child that dies (a RunError) ends the run at once; no child is polled.
SIGINT and SIGTERM cancel the run's task once (:class:`RunSignals`); the cleanup then always runs to its end.
Invariant: whatever ends the run (success, a crashed child, Ctrl-C), no child process and no container of this
run is left.
A run folder that already holds a run is refused unless ``resume`` is set: then the learner continues from
the newest checkpoint in ``<run>/checkpoints`` (see learner.train.checkpoint) and metrics.jsonl keeps growing.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from asyncio.subprocess import Process
from dataclasses import replace
from pathlib import Path
from typing import Any, Awaitable, Callable, Coroutine, NoReturn

import aiohttp
import tenacity

from arpo_async.config import RunConfig, dump_toml
from arpo_async.inference_client import ADMIN_API_KEY_ENV, admin_api_key
from arpo_async.metrics import read_metrics
from arpo_cli.progress import ProgressDisplay, TrajectoryRate, open_display, progress_line, stop_line
from arpo_cli.side_by_side import claim_host, create_tiny_model_once, log_size, own_server_url, ready_line_seen

log = logging.getLogger("arpo.run")

STOP_GRACE_S = 60.0
"""Seconds a child gets to exit after SIGTERM before it is killed."""
SERVE_STOP_GRACE_S = 10.0
"""The same for arpo-serve, stopped last (nothing it holds needs saving)."""
PROGRESS_EVERY_S = 1.0
"""The progress line is refreshed this often (seconds)."""
LEARNER_EXIT_GRACE_S = 60.0
"""Seconds the learner gets to exit after arpo-actors exited 0 (which it does once the learner said shutdown)."""
CURVE_EVERY_S = 60.0
"""While the run goes, ``<run>/curve.png`` is redrawn this often (seconds)."""
CRASH_LINES = 60
"""A dead child's message quotes at most this many last lines of its log."""


class RunError(RuntimeError):
    """The local run could not start or a child process died; the message says which and where its log is."""


class RunInputError(RunError):
    """The run as asked cannot start: a task set, model, desktop image or run folder the config or flags name does
    not fit; found before anything starts (`arpo run` and `arpo launch` exit 2, as for a bad config)."""


def prepare(config: RunConfig, say: Callable[[str], None], *, desktops: bool = True) -> RunConfig:
    """Build the desktop image (unless ``desktops`` is False: then only its tag is resolved, for desktop hosts
    elsewhere) and the tiny model when missing; returns the config with both resolved."""
    from actors.desktop.build import build_image, image_exists, image_tag

    image = config.actors.image or image_tag(config.actors.image_profile)
    if desktops and not image_exists(image):
        if config.actors.image:
            raise RunInputError(f"desktop image {image} does not exist (build it, or leave actors.image empty)")
        say(f"building the desktop image {image} (first run only, a few minutes)")
        build_image(log=say, profile=config.actors.image_profile)
    model = config.model_path
    if not (model / "config.json").exists():
        if config.model:
            raise RunInputError(f"no model at {model} (expected a Hugging Face folder with config.json)")
        say(f"creating the tiny random Qwen2.5-VL policy in {model}")
        create_tiny_model_once(model)  # another run may be creating it at the same time
    return replace(config, model=str(model.resolve()), actors=replace(config.actors, image=image))


async def spawn(args: list[str], log_path: Path, env: dict[str, str] | None = None) -> Process:
    """Start a child process in its own process group with stdout+stderr to ``log_path``; ``env`` adds to this
    process's environment (secrets go there, not on the command line where ``ps`` shows them)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        return await asyncio.create_subprocess_exec(
            *args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, **env} if env else None)


def _signal_group(proc: Process, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass


async def stop(proc: Process | None, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the child's process group, wait up to ``grace_s`` for it to exit, then SIGKILL the group. A stop
    that is cancelled kills the group at once (and re-raises): no child outlives it."""
    if proc is None or proc.returncode is not None:
        return
    _signal_group(proc, signal.SIGTERM)
    try:
        async with asyncio.timeout(grace_s):
            await proc.wait()
    except TimeoutError:
        pass
    finally:
        if proc.returncode is None:
            _signal_group(proc, signal.SIGKILL)
            await proc.wait()


class Children:
    """The run's child processes, as an async context manager: whatever ends the block (its end, an error, a
    cancellation), every child still running is stopped on exit, the last started first (:func:`stop`: SIGTERM,
    SIGKILL after the grace period given to :meth:`start`)."""

    def __init__(self) -> None:
        self._running: list[tuple[Process, float]] = []

    async def start(self, args: list[str], log_path: Path, *, grace_s: float = STOP_GRACE_S,
                    env: dict[str, str] | None = None) -> Process:
        """:func:`spawn` a child (``env`` added to its environment), to be stopped with ``grace_s`` seconds of grace
        on exit."""
        proc = await spawn(args, log_path, env)
        self._running.append((proc, grace_s))
        return proc

    async def __aenter__(self) -> Children:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            while self._running:
                await stop(*self._running[-1])
                self._running.pop()
        finally:  # a cancelled stop: the others get no grace, but none is left running
            for proc, _ in self._running:
                _signal_group(proc, signal.SIGKILL)
            for proc, _ in self._running:
                await proc.wait()


class _NotReady(Exception):
    """/health answered, but not 200."""


async def answers_health(url: str, log_path: Path, timeout_s: float = 300.0,
                         ours: Callable[[], bool] | None = None) -> None:
    """Return once ``url``/health answers 200 (and ``ours()`` is true: the answer is our server's): tries of 2 s
    each, 0.2 s apart (tenacity). Raises RunError naming ``log_path`` (the server's log) when ``timeout_s`` passes
    first."""
    retrying = tenacity.AsyncRetrying(
        stop=tenacity.stop_after_delay(timeout_s), wait=tenacity.wait_fixed(0.2),
        retry=tenacity.retry_if_exception_type((aiohttp.ClientError, OSError, _NotReady)))
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            async for attempt in retrying:
                with attempt:
                    async with session.get(f"{url}/health") as reply:
                        if reply.status != 200 or (ours is not None and not ours()):
                            raise _NotReady(reply.status)
    except tenacity.RetryError:
        raise RunError(f"arpo-serve did not answer {url}/health within {timeout_s:.0f} s; see {log_path}") from None


async def exit_is_error(proc: Process, name: str, log_path: Path) -> NoReturn:
    """Wait for ``proc`` to exit, then raise RunError naming ``name`` and quoting its log (:func:`crash_excerpt`):
    for a child that must outlive whatever awaits this."""
    code = await proc.wait()
    raise RunError(f"{name} exited with {code}; see {log_path}:\n{crash_excerpt(log_path)}")


async def wait_healthy(url: str, proc: Process, log_path: Path, timeout_s: float = 300.0, *,
                       ready_since: int | None = None) -> None:
    """Wait until arpo-serve (``proc``, logging to ``log_path``) answers ``url``/health with 200; with
    ``ready_since`` (``log_path``'s size before ``proc`` started) also until ``proc`` logged its ready line for
    url's port (arpo_cli.side_by_side.ready_line_seen), so another server on that port is never taken for it.
    Raises RunError as soon as the process exits, or when ``timeout_s`` passes first."""
    port = int(url.rsplit(":", 1)[1].rstrip("/"))
    ours = None if ready_since is None else (lambda: ready_line_seen(log_path, ready_since, port))
    try:
        async with asyncio.TaskGroup() as tg:
            exited = tg.create_task(exit_is_error(proc, "arpo-serve", log_path))
            await answers_health(url, log_path, timeout_s, ours)
            exited.cancel()
    except* RunError as errors:
        raise errors.exceptions[0] from None


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


async def watch_actors(actors: Process, learner: Process, log_path: Path) -> None:
    """Raise RunError when arpo-actors exit while the learner runs.

    arpo-actors exit 0 by themselves only after the learner said shutdown (training is over): then the learner
    gets LEARNER_EXIT_GRACE_S seconds to exit and this returns once it did; any other exit of arpo-actors, or a
    learner that does not follow, is an error naming ``log_path`` (theirs).
    """
    code = await actors.wait()
    why = f"exited with {code}"
    if code == 0:
        try:
            async with asyncio.timeout(LEARNER_EXIT_GRACE_S):
                await learner.wait()
            return
        except TimeoutError:
            why += f" and arpo-learner did not finish within {LEARNER_EXIT_GRACE_S:g} s"
    raise RunError(f"arpo-actors {why}; see {log_path}:\n{crash_excerpt(log_path)}")


async def supervise(learner: Process, actors: Process, serve: Process, logs: Path,
                    progress: Callable[[], Awaitable[None]]) -> int:
    """Wait for the learner to exit and return its exit code, while one task of a TaskGroup waits on each other
    child (:func:`exit_is_error` for arpo-serve, :func:`watch_actors`) and one runs ``progress()``.

    The first of these to raise ends the wait at once (the group cancels the others); when the learner exits,
    the other tasks are cancelled. Stopping the children is the caller's (:class:`Children`).

    Raises:
        RunError: arpo-serve exited, or arpo-actors exited and the learner did not follow (the message names the
            child's log in ``logs`` and quotes its last lines).
    """
    try:
        async with asyncio.TaskGroup() as tg:
            others = [tg.create_task(exit_is_error(serve, "arpo-serve", logs / "serve.log")),
                      tg.create_task(watch_actors(actors, learner, logs / "actors.log")),
                      tg.create_task(progress())]
            code = await learner.wait()
            for task in others:
                task.cancel()
    except* RunError as errors:
        raise errors.exceptions[0] from None
    return code


def draw_curve(run: Path, *, quiet_if_empty: bool = False) -> Path | None:
    """Write ``<run>/curve.png`` (arpo_cli.curve.write_curve); returns its path, or None when it could not be
    drawn. Never raises: a failure is logged as a warning (``quiet_if_empty``: not when no step is recorded yet,
    the normal state early in a run). matplotlib is imported here, not with the module: the process helpers above
    serve scripts that draw nothing (bench/, the GPU check, whose machine may lack matplotlib)."""
    from arpo_cli.curve import CurveError, write_curve

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


def sigterm_as_interrupt(signum: int, frame: object) -> None:
    """A SIGTERM handler (``signal.signal``) that raises KeyboardInterrupt, so SIGTERM stops a run as Ctrl-C does."""
    raise KeyboardInterrupt(f"signal {signum}")


class RunSignals:
    """SIGINT and SIGTERM while the children run (handlers of the event loop): the first one cancels the run's
    task, whose ``finally`` stops the children and removes the containers; a later one, or one that arrives once
    that cleanup has begun, is only recorded, so the cleanup always completes."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.cleaning = False
        self._task: asyncio.Task | None = None

    def install(self) -> None:
        """Take SIGINT and SIGTERM over for the running task (until the event loop closes)."""
        self._task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._received, signum)

    def _received(self, signum: int) -> None:
        if not self.received and not self.cleaning and self._task is not None:
            self._task.cancel()
        self.received.append(signum)


def run_local(config: RunConfig, *, display: ProgressDisplay | None = None, resume: bool = False) -> int:
    """Run serve + learner + actors on this machine until the learner finishes. Returns the exit code.

    ``display``: where the progress line and messages go (default: arpo_cli.progress.open_display(), a live
    line in a terminal, plain lines otherwise).

    ``resume``: continue the run in ``config.run_dir`` from its newest checkpoint (learner.steps counts all
    steps of the run, so raise it to train further). SIGTERM is handled like Ctrl-C (KeyboardInterrupt): the
    children are stopped and the run's containers removed; further Ctrl-C or SIGTERM during that cleanup are
    ignored, so it always completes (children get SIGTERM, then SIGKILL after a grace period).

    Raises:
        RunError: the folder holds a run and ``resume`` is False, or ``resume`` is set and it has no
            checkpoint; a child process died (the message names its log and quotes its last lines).
        KeyboardInterrupt: SIGINT or SIGTERM; everything was stopped and removed first.
    """
    previous = signal.signal(signal.SIGTERM, sigterm_as_interrupt)  # until the event loop takes both signals over
    display = open_display() if display is None else display
    try:
        config = prepare_run(claim_host(config, resume=resume), display.say, resume)  # ports and run id: ours
        return run_interruptible(lambda signals: _run_children(config, display, signals))
    finally:
        display.close()
        signal.signal(signal.SIGTERM, previous)


def run_interruptible(main: Callable[[RunSignals], Coroutine[Any, Any, int]]) -> int:
    """``asyncio.run(main(signals))`` with a fresh :class:`RunSignals` (``main`` installs it); returns its result.

    Raises:
        KeyboardInterrupt: SIGINT or SIGTERM cancelled ``main`` (whose cleanup has run by then).
    """
    signals = RunSignals()
    try:
        return asyncio.run(main(signals))
    except asyncio.CancelledError:
        if signals.received:
            raise KeyboardInterrupt(f"signal {signals.received[0]}") from None
        raise


def check_tasks(config: RunConfig) -> tuple[int, int]:
    """Load the run's task sets as its learner will, before any process starts: the training pool
    (arpo_async.task_sets.select_tasks: ``learner.tasks`` cut by ``learner.task_ids``) and the ``[eval]`` set
    (learner.rollouts.evaluation_rounds.evaluation_tasks, which must run whole). Returns (training tasks, evaluation
    tasks; 0 when the run does not evaluate).

    Raises:
        RunError: a task file that does not load, a path or name that selects nothing, a filter or split that
            leaves no task, or an evaluation task that cannot run; the message names the keys and the file.
    """
    from arpo_async.config import ConfigError
    from arpo_async.task_sets import select_tasks
    from arpo_async.tasks import TaskFormatError
    from learner.rollouts.evaluation_rounds import evaluation_tasks

    lc = config.learner
    try:
        train = select_tasks(lc)
    except TaskFormatError as e:
        where = (f"learner.tasks = {lc.tasks!r}" + (f", learner.split = {lc.split!r}" if lc.split else "")
                 + (f", learner.task_ids = {list(lc.task_ids)}" if lc.task_ids else ""))
        raise RunInputError(f"{where}: {e} (`arpo tasks check PATH` reports every task file)") from e
    try:
        evaluated = evaluation_tasks(config)
    except ConfigError as e:
        raise RunInputError(str(e)) from e
    return len(train), len(evaluated)


def prepare_run(config: RunConfig, say: Callable[[str], None], resume: bool, *, desktops: bool = True) -> RunConfig:
    """Check the run folder (a new run, or ``resume`` with a checkpoint) and the task sets (:func:`check_tasks`),
    :func:`prepare` the image (``desktops``) and model and write ``<run>/config.toml``; returns the resolved
    config. Nothing is built, written or started when a check fails.

    Raises:
        RunError: the folder holds a run and ``resume`` is False, or ``resume`` is set and it has no checkpoint;
            a task set that does not load or selects no runnable task.
    """
    run = config.run_path
    if resume:
        from learner.train.checkpoint import checkpoint_folders
        if not checkpoint_folders(run / "checkpoints"):
            raise RunInputError(f"{run} has no checkpoint to resume from ({run / 'checkpoints'} is empty or missing)")
        (run / "status.json").unlink(missing_ok=True)  # the dead learner's; the new one rewrites it
    elif (run / "metrics.jsonl").exists():
        raise RunInputError(f"{run} already holds a run (metrics.jsonl); pass another --out, remove it, "
                       "or pass --resume to continue it from its last checkpoint")
    train, evaluated = check_tasks(config)
    say(f"tasks: {train} to train on" + (f", {evaluated} to evaluate on" if evaluated else ""))
    config = prepare(config, say, desktops=desktops)
    (run / "logs").mkdir(parents=True, exist_ok=True)
    (run / "config.toml").write_text(dump_toml(config))
    return config


async def _run_children(config: RunConfig, display: ProgressDisplay, signals: RunSignals) -> int:
    """Start arpo-serve, wait for /health, start the learner and the actors, :func:`supervise` them; then write
    summary.json and the curve. In ``finally``: stop every child and remove the run's containers."""
    from actors.desktop.fleet import remove_run_containers

    signals.install()
    say, run = display.say, config.run_path
    started = time.monotonic()
    try:
        say(f"run folder {run}; logs in {run / 'logs'}")
        async with Children() as children:
            try:
                return await _train(config, display, children, started)
            finally:
                signals.cleaning = True  # a Ctrl-C from now on must not cut short stopping the children
    finally:
        signals.cleaning = True
        removed = await remove_run_containers(config.resolved_run_id)
        if removed:
            say(f"removed {removed} leftover desktop container(s)")
        say(f"done in {time.monotonic() - started:.0f} s; metrics in {run / 'metrics.jsonl'}")


async def _train(config: RunConfig, display: ProgressDisplay, children: Children, started: float) -> int:
    """Start arpo-serve and wait for /health, start the learner and the actors, :func:`supervise` them until the
    learner exits; then write summary.json and the curve. Returns the learner's exit code."""
    say, run = display.say, config.run_path
    logs, config_path = run / "logs", run / "config.toml"
    url, since, py = own_server_url(config), log_size(logs / "serve.log"), sys.executable
    # arpo-serve reads model and [serve] from the run file, as the learner and the actors do; the admin key (the
    # run file's, else a random one per run) reaches arpo-serve and the learner alone, in their environment
    admin = {ADMIN_API_KEY_ENV: admin_api_key(config.serve.admin_api_key) or secrets.token_urlsafe(32)}
    serve = await children.start([py, "-m", "arpo_serve.main", "--config", str(config_path),
                                  "--weight-version", "0", "--weights-root", str(run / "weights")],
                                 logs / "serve.log", grace_s=SERVE_STOP_GRACE_S, env=admin)
    await wait_healthy(url, serve, logs / "serve.log", ready_since=since)
    say(f"arpo-serve ready at {url}; the learner listens on {config.transport.endpoint}; run id {config.run_id}")
    learner = await children.start([py, "-m", "learner.main", "--config", str(config_path)],
                                   logs / "learner.log", env=admin)
    actors = await children.start([py, "-m", "actors.main", "--config", str(config_path),
                                   "--actor-id", "local"], logs / "actors.log")
    rate = TrajectoryRate()
    code = await supervise(learner, actors, serve, logs, lambda: show_progress(config, display, started, rate))
    display.update(progress_line(config, started, rate), time.monotonic(), force=True)
    if code == 0 and (stopped := stop_line(config)):
        say(stopped)  # the learner ended the run early: every task solved (learner.stop_when_solved)
    await asyncio.to_thread(write_summary, config, code, url, time.monotonic() - started)
    curve = await asyncio.to_thread(draw_curve, run)
    if curve is not None:
        say(f"learning curve in {curve}")
    if code != 0:
        say(f"arpo-learner exited with {code}; see {logs / 'learner.log'}:\n"
            f"{crash_excerpt(logs / 'learner.log')}")
    return code


async def show_progress(config: RunConfig, display: ProgressDisplay, started: float, rate: TrajectoryRate) -> None:
    """Forever: refresh the progress line every PROGRESS_EVERY_S and redraw curve.png every CURVE_EVERY_S."""
    last_drawn = time.monotonic()
    while True:
        display.update(progress_line(config, started, rate), time.monotonic())
        if time.monotonic() - last_drawn >= CURVE_EVERY_S:
            await asyncio.to_thread(draw_curve, config.run_path, quiet_if_empty=True)
            last_drawn = time.monotonic()
        await asyncio.sleep(PROGRESS_EVERY_S)
