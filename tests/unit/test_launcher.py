"""arpo run's watch over its children (arpo_cli.launcher: supervise, Children, wait_healthy), with real child
processes, and its progress line (from a real metrics.jsonl)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
from aiohttp import web

from arpo_cli import launcher
from arpo_async.config import load_config
from arpo_cli.launcher import Children, RunError, progress_line, supervise, wait_healthy
from arpo_async.metrics import MetricsWriter
from tests.support import free_port, local_http_server, until

DEADLINE_S = 30.0  # generous: python start-ups on 2 busy cores


@pytest.fixture
async def child():
    """``child(code)`` starts ``python -c code`` with a stdin pipe; ``exit_on_eof(status)`` is code that exits
    with ``status`` once the test closes that pipe. Every child is killed at the end."""
    procs: list[asyncio.subprocess.Process] = []

    async def start(code: str) -> asyncio.subprocess.Process:
        procs.append(await asyncio.create_subprocess_exec(sys.executable, "-c", code, stdin=asyncio.subprocess.PIPE))
        return procs[-1]

    yield start
    for proc in procs:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


def exit_on_eof(status: int = 0) -> str:
    return f"import sys; sys.stdin.read(); sys.exit({status})"


def release(proc: asyncio.subprocess.Process) -> None:
    proc.stdin.close()


@pytest.fixture
def logs(tmp_path: Path) -> Path:
    for name in ("serve", "actors"):
        (tmp_path / f"{name}.log").write_text(f"last line of {name}\n")
    return tmp_path


class Progress:
    """A progress coroutine that records its start and its cancellation."""

    def __init__(self) -> None:
        self.started, self.cancelled = asyncio.Event(), False

    async def __call__(self) -> None:
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise


async def test_the_learner_exiting_ends_the_run_with_its_code_and_stops_the_watchers(logs, child):
    learner, actors, serve = [await child(exit_on_eof(3)) for _ in range(3)]
    progress = Progress()
    run = asyncio.create_task(supervise(learner, actors, serve, logs, progress))
    async with asyncio.timeout(DEADLINE_S):
        await progress.started.wait()
        release(learner)
        assert await run == 3
    assert progress.cancelled
    assert actors.returncode is None and serve.returncode is None  # watched, never waited for or stopped


async def test_a_dead_server_ends_the_run_at_once_naming_its_log(logs, child):
    learner, actors, serve = [await child(exit_on_eof(1)) for _ in range(3)]
    release(serve)
    with pytest.raises(RunError, match=r"arpo-serve exited with 1; see .*serve.log:\nlast line of serve"):
        async with asyncio.timeout(DEADLINE_S):  # the learner would run forever: the error alone ends the wait
            await supervise(learner, actors, serve, logs, Progress())
    assert learner.returncode is None


async def test_failed_actors_are_an_error_naming_their_log(logs, child):
    learner, actors, serve = await child(exit_on_eof()), await child(exit_on_eof(3)), await child(exit_on_eof())
    release(actors)
    with pytest.raises(RunError, match=r"arpo-actors exited with 3; see .*actors.log:\nlast line of actors"):
        async with asyncio.timeout(DEADLINE_S):
            await supervise(learner, actors, serve, logs, Progress())


async def test_actors_done_waits_for_the_learner_to_finish(logs, child):
    learner, actors, serve = [await child(exit_on_eof(0)) for _ in range(3)]
    run = asyncio.create_task(supervise(learner, actors, serve, logs, Progress()))
    release(actors)  # they exit 0 once the learner said shutdown; the learner is still finishing
    async with asyncio.timeout(DEADLINE_S):
        await actors.wait()
        release(learner)
        assert await run == 0


async def test_actors_done_but_learner_never_finishes_is_an_error(logs, child, monkeypatch):
    monkeypatch.setattr(launcher, "LEARNER_EXIT_GRACE_S", 0.2)
    learner, actors, serve = [await child(exit_on_eof(0)) for _ in range(3)]
    release(actors)
    with pytest.raises(RunError, match=r"arpo-actors exited with 0 and arpo-learner did not finish within 0.2 s"):
        async with asyncio.timeout(DEADLINE_S):
            await supervise(learner, actors, serve, logs, Progress())


async def test_a_cancelled_run_cancels_its_tasks_and_reraises(logs, child):
    learner, actors, serve = [await child(exit_on_eof()) for _ in range(3)]
    progress = Progress()
    run = asyncio.create_task(supervise(learner, actors, serve, logs, progress))
    async with asyncio.timeout(DEADLINE_S):
        await progress.started.wait()
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
    assert progress.cancelled


async def test_the_first_signal_cancels_the_run_and_a_second_never_cuts_its_cleanup_short():
    signals = launcher.RunSignals()
    installed, cleaned_up = asyncio.Event(), asyncio.Event()

    async def run() -> None:
        signals.install()
        installed.set()
        try:
            await asyncio.Event().wait()  # the run, until a signal cancels it
        finally:
            os.kill(os.getpid(), signal.SIGINT)  # an impatient second Ctrl-C while the cleanup runs
            await until(lambda: len(signals.received) == 2, DEADLINE_S, "the second signal to arrive")
            cleaned_up.set()

    task = asyncio.create_task(run())
    async with asyncio.timeout(DEADLINE_S):
        await installed.wait()
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(asyncio.CancelledError):
            await task
    assert cleaned_up.is_set() and signals.received == [signal.SIGTERM, signal.SIGINT]


STUBBORN = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
            "time.sleep(600)")
"""A child that ignores SIGTERM (it says ``ready`` once it does)."""
POLITE = "import time; print('ready', flush=True); time.sleep(600)"


async def started(children: Children, code: str, log: Path, grace_s: float = 0.2) -> asyncio.subprocess.Process:
    proc = await children.start([sys.executable, "-c", code], log, grace_s=grace_s)
    await until(lambda: "ready" in log.read_text(), DEADLINE_S, f"{log.name} to say ready")
    return proc


async def test_children_are_all_stopped_whatever_ends_the_block(tmp_path):
    with pytest.raises(RunError):
        async with asyncio.timeout(DEADLINE_S), Children() as children:
            polite = await started(children, POLITE, tmp_path / "polite.log", grace_s=DEADLINE_S)
            stubborn = await started(children, STUBBORN, tmp_path / "stubborn.log")
            raise RunError("a child died")
    assert stubborn.returncode == -signal.SIGKILL  # ignored SIGTERM: killed after its grace
    assert polite.returncode == -signal.SIGTERM


async def test_a_cancelled_cleanup_still_kills_every_child(tmp_path):
    cleanup_began = asyncio.Event()

    async def run() -> None:
        async with Children() as children:
            procs.extend([await started(children, STUBBORN, tmp_path / f"{i}.log", grace_s=600) for i in range(2)])
            cleanup_began.set()

    procs: list[asyncio.subprocess.Process] = []
    task = asyncio.create_task(run())
    async with asyncio.timeout(DEADLINE_S):
        await cleanup_began.wait()  # we run again once the task waits in its first stop (SIGTERM sent, 600 s grace)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2


async def test_wait_healthy_returns_on_200_and_fails_when_the_server_dies(tmp_path, child):
    log = tmp_path / "serve.log"
    log.write_text("Traceback (most recent call last):\nOSError: address in use\n")
    server = await child(exit_on_eof())

    async def health(request):
        return web.Response(text="ok")

    async with asyncio.timeout(DEADLINE_S), local_http_server({"/health": health}) as port:
        await wait_healthy(f"http://127.0.0.1:{port}", server, log)
    release(server)
    with pytest.raises(RunError, match=r"(?s)arpo-serve exited with 0; see .*serve.log:\n.*address in use"):
        async with asyncio.timeout(DEADLINE_S):  # nothing listens on this port: only the exit can end the wait
            await wait_healthy(f"http://127.0.0.1:{free_port()}", server, log)


async def test_wait_healthy_gives_up_after_its_timeout(tmp_path, child):
    server = await child(exit_on_eof())
    with pytest.raises(RunError, match=r"did not answer http://127.0.0.1:\d+/health within 1 s; see .*serve.log"):
        async with asyncio.timeout(DEADLINE_S):
            await wait_healthy(f"http://127.0.0.1:{free_port()}", server, tmp_path / "serve.log", timeout_s=1)


def write_steps(run: Path, success_rates: list[float]) -> None:
    metrics = MetricsWriter(run / "metrics.jsonl")
    for step, success in enumerate(success_rates, start=1):
        metrics.write({"step": step, "policy_version": step, "trajectories": 4, "success_rate": success,
                       "reward_mean": 0.0, "loss": 0.5, "replay_injections": 0, "staleness_mean": 0.0,
                       "wall_s": float(step)})
    metrics.close()


def test_progress_line_shows_the_trailing_success_rate(tmp_path):
    config = load_config(None, [f'run_dir="{tmp_path}"', "learner.steps=20"])
    write_steps(tmp_path, [1.0] * 2 + [0.5] * 5 + [0.25] * 5)  # the last 10: 5 x 0.5 and 5 x 0.25
    line = progress_line(config, started=0.0)
    assert "step 12/20" in line and "success 0.25 (last 10 steps 0.38) loss 0.5000" in line
    assert "\n" not in line


def test_progress_line_before_the_first_step(tmp_path):
    config = load_config(None, [f'run_dir="{tmp_path}"'])
    assert "success nan (last 10 steps nan)" in progress_line(config, started=0.0)


def test_draw_curve_warns_and_never_raises(tmp_path, caplog):
    assert launcher.draw_curve(tmp_path, quiet_if_empty=True) is None and caplog.text == ""  # early in a run
    assert launcher.draw_curve(tmp_path) is None and "no learning curve: no metrics.jsonl in" in caplog.text
    run = tmp_path / "run"
    write_steps(run, [0.5])
    (run / "curve.png" / "blocked").mkdir(parents=True)  # the picture cannot be written: a warning, no exception
    assert launcher.draw_curve(run) is None and f"could not draw {run / 'curve.png'}" in caplog.text
    assert sorted(p.name for p in run.iterdir()) == ["curve.png", "metrics.jsonl"]  # no temp file left
    (run / "curve.png" / "blocked").rmdir()
    (run / "curve.png").rmdir()
    assert launcher.draw_curve(run) == run / "curve.png"


def test_summary_counts_optimizer_steps_not_records(tmp_path):
    """With 2 optimizer steps per batch, metrics.jsonl holds one record per batch; summary.json's steps counts
    optimizer steps (the last record's step), as learner.steps does."""
    config = load_config(None, [f'run_dir="{tmp_path}"', "learner.updates_per_batch=2"])
    metrics = MetricsWriter(tmp_path / "metrics.jsonl")
    for batch in (1, 2, 3):
        metrics.write({"step": 2 * batch, "policy_version": batch, "trajectories": 4, "success_rate": 0.5,
                       "reward_mean": 0.0, "loss": 0.5, "replay_injections": 0, "staleness_mean": 0.0,
                       "wall_s": float(batch)})
    metrics.close()
    summary = launcher.write_summary(config, 0, "http://127.0.0.1:9", wall_s=1.0)
    assert (summary["steps"], summary["policy_version"], summary["server_weight_version"]) == (6, 3, None)
    (tmp_path / "empty").mkdir()  # a run that failed before its first batch
    assert launcher.write_summary(load_config(None, [f'run_dir="{tmp_path / "empty"}"']), 1, "http://127.0.0.1:9",
                                  wall_s=0.0)["steps"] == 0


GOOD_TASK = {"id": "t-ok", "instruction": "x", "config": [],
             "evaluator": {"func": "exact_match", "result": {"type": "vm_command_line", "command": "echo hi"},
                           "expected": {"type": "rule", "rules": {"expected": "hi"}}}}


@pytest.mark.parametrize("settings,message", [
    (["learner.tasks={tasks}"], "bad.json: invalid JSON"),  # a task file that does not load
    (["learner.tasks={tmp}/absent"], "learner.tasks = '{tmp}/absent': {tmp}/absent: no such task file or folder"),
    (["learner.task_ids=['nope-']"], "learner.task_ids = ['nope-']: no task matches learner.task_ids=['nope-']"),
    (["eval.tasks={tasks}"], "eval.tasks = '{tasks}'"),  # an evaluation set must run whole
    (["eval.tasks=grid4-test", "eval.split=no-such-split"], "eval.split = 'no-such-split'"),
])
def test_arpo_run_checks_its_task_sets_before_it_builds_writes_or_starts_anything(tmp_path, capsys, settings,
                                                                                  message):
    """`arpo run` with a task set that does not load or selects nothing: exit 2 (a config error, as argparse
    exits for a usage error) with the reason, and nothing
    built, written or started: no run folder, no tiny model, and the missing desktop image (which would be an
    error of its own) never looked at."""
    import json

    from arpo_cli.cli import main

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "ok.json").write_text(json.dumps(GOOD_TASK))
    (tasks / "bad.json").write_text("{not json")
    run = tmp_path / "runs" / "demo"
    args = ["run", "--out", str(run), "--set", 'actors.image="arpo-no-such-image:0"']
    for setting in settings:
        args += ["--set", setting.format(tasks=tasks, tmp=tmp_path)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("arpo run: ") and message.format(tasks=tasks, tmp=tmp_path) in err
    assert "arpo-no-such-image" not in err
    assert not run.exists() and not (tmp_path / "runs" / "tiny-model").exists()


def test_check_tasks_counts_what_the_learner_will_train_and_evaluate_on(tmp_path):
    from arpo_async.task_sets import select_tasks

    config = load_config(None, ["learner.task_ids=['grid4-']", "eval.tasks=grid4-test"])
    assert launcher.check_tasks(config) == (len(select_tasks(config.learner)), 4)
    assert launcher.check_tasks(load_config(None, [])) == (len(select_tasks(load_config().learner)), 0)
