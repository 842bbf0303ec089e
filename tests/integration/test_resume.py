"""Resume and lockstep with real processes: arpo-serve, arpo-learner and arpo-actors on real desktops.

- A learner killed with SIGKILL mid-run is restarted on the same run folder: it continues from its checkpoint
  (step numbers, policy version, optimizer and replay state), republishes its weights, and the same actors
  process reconnects by itself; every trajectory the actors held while no learner ran is acked by the new
  learner (counted as late, since its group belonged to the dead learner).
- The lockstep schedule runs a short job end to end: no trajectory is trained with policy lag.
- Checkpoint files on their own: keep-last-N, fallback to an older checkpoint, metrics.jsonl repair.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import zmq.asyncio

from arpo_async.config import LearnerConfig, dump_toml, load_config
from arpo_async.messages import Step, Trajectory
from arpo_async.metrics import REQUIRED_KEYS, MetricsWriter, read_metrics
from arpo_async.tasks import Task
from arpo_async.transport import Outbox
from learner.algo.batcher import Batcher
from learner.algo.replay import ReplayBuffer, make_replay
from learner.rollouts.scheduler import GroupScheduler
from learner.rollouts.service import LearnerService
from learner.rollouts.staleness import StalenessManager
from learner.train.checkpoint import (Checkpointer, CheckpointError, capture, checkpoint_folders, reconcile_metrics,
                                      restore)
from learner.train.trainer import Trainer
from tests.support import ADVANTAGE_LOG_ENV, free_port, healthy, until_sync

PY = sys.executable
EPISODE_LINE = re.compile(r"actor \S+ (\S+)/(\S+) #(\d+): ([A-Z_]+) ")
"""An EnvActor's log line for one finished episode: task id, group id, rollout index, outcome."""



def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class Processes:
    """Child processes of one test, each in its own process group with its log in ``logs``."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen] = {}
        logs.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        with (self.logs / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def check_alive(self, *names: str, clean_exit_ok: bool = False) -> None:
        """Fail the test if one of ``names`` exited (unless with 0 and ``clean_exit_ok``)."""
        for name in names:
            code = self.procs[name].poll()
            if code is not None and not (clean_exit_ok and code == 0):
                pytest.fail(f"{name} exited with {code}:\n{tail(self.log(name))}", pytrace=False)

    def stop_all(self) -> None:
        for name, proc in reversed(list(self.procs.items())):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                except ProcessLookupError:
                    pass


def server_weight_version(url: str) -> str | None:
    with urllib.request.urlopen(f"{url}/get_model_info", timeout=10) as reply:
        return json.loads(reply.read()).get("weight_version")


def learner_version_held(status: Path, seconds: float, timeout_s: float = 120.0) -> int:
    """Wait until the learner's policy version in ``status`` (<run>/status.json) has not changed for ``seconds``
    and no group waits to be trained; returns that version."""
    seen: tuple[int, float] | None = None

    def held() -> int | None:
        nonlocal seen
        now, current = time.monotonic(), read_json(status)
        version = current.get("policy_version")
        if seen is None or seen[0] != version or current.get("ready_groups"):
            seen = (version, now)
        return version if now - seen[1] >= seconds else None

    return until_sync(held, timeout_s, f"the learner's version to hold for {seconds:g} s", every_s=1.0)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def remove_containers(run_id: str) -> list[str]:
    ids = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=arpo.run={run_id}"],
                         capture_output=True, text=True).stdout.split()
    if ids:
        subprocess.run(["docker", "rm", "-f", *ids], capture_output=True)
    return ids


def write_config(tmp_path: Path, model: Path, image: str, run_id: str, *overrides: str) -> tuple[Path, str]:
    """A run config on free ports, restricted to the 4-button tasks; returns (path, inference URL)."""
    serve_port = free_port()
    url = f"http://127.0.0.1:{serve_port}"
    config = load_config(None, [
        f'run_dir="{tmp_path / "run"}"', f'model="{model}"', f'run_id="{run_id}"',
        f'transport.endpoint="tcp://127.0.0.1:{free_port()}"', "transport.heartbeat_s=0.5",
        "transport.resend_after_s=5.0",
        'learner.task_ids=["grid4-"]', "learner.group_size=2", "learner.groups_per_step=1", "learner.steps=3",
        "learner.max_staleness=1",
        "actors.max_steps=2", f'actors.inference_urls=["{url}"]', f'actors.image="{image}"',
        f"serve.port={serve_port}", *overrides])
    path = tmp_path / "config.toml"
    path.write_text(dump_toml(config))
    return path, url


def start_server(procs: Processes, model: Path, url: str) -> None:
    """arpo-serve as ``procs``' "serve" on ``url``'s port with the base weights (version 0), once healthy."""
    procs.start("serve", [PY, "-m", "arpo_serve.main", "--model", str(model), "--port", url.rsplit(":", 1)[1],
                          "--weight-version", "0"])
    until_sync(lambda: healthy(url), 180, "arpo-serve /health", check=lambda: procs.check_alive("serve"))


@contextmanager
def running_job(tmp_path: Path, config: Path, url: str, model: Path, run_id: str, learner: list[str] | None = None):
    """arpo-serve (healthy), arpo-learner and arpo-actors started; everything stopped and removed after.
    ``learner``: the learner's command line (default: one process, ``python -m learner.main``)."""
    procs = Processes(tmp_path / "logs")
    try:
        start_server(procs, model, url)
        procs.start("learner", learner or [PY, "-m", "learner.main", "--config", str(config)])
        procs.start("actors", [PY, "-m", "actors.main", "--config", str(config), "--actor-id", "test-actors"])
        yield procs
    finally:
        procs.stop_all()
        remove_containers(run_id)


def episodes(log: Path, start: int = 0) -> list[tuple[str, str, int, str]]:
    """(task id, group id, rollout index, outcome) of every episode the actors logged after byte ``start``."""
    with log.open("rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    return [(m[1], m[2], int(m[3]), m[4]) for m in EPISODE_LINE.finditer(text)]


@pytest.mark.docker
def test_a_restarted_server_is_caught_up_and_the_run_trains_on(tmp_path, desktop_image, tiny_model):
    """The run's only arpo-serve, killed right after a publication and started again with the base weights
    (version 0), as Ray restarts it under `arpo launch`: within learner.resync_interval_s the learner sends it the
    current weights, so its rollouts are fresh again and the run reaches its steps. Without the catch-up every
    later rollout is sampled by version 0, too stale for learner.max_staleness=1, and no step follows."""
    run_id = f"resync-{uuid.uuid4().hex[:8]}"
    config, url = write_config(tmp_path, tiny_model, desktop_image, run_id, "learner.steps=5",
                               "learner.resync_interval_s=1.0", "learner.stall_timeout_s=240")
    metrics, status = tmp_path / "run" / "metrics.jsonl", tmp_path / "run" / "status.json"
    with running_job(tmp_path, config, url, tiny_model, run_id) as procs:
        until_sync(lambda: len(read_metrics(metrics)) >= 2, 300, "2 optimizer steps",
                   check=lambda: procs.check_alive("serve", "learner", "actors"))
        serve = procs.procs["serve"]
        os.killpg(serve.pid, signal.SIGKILL)
        serve.wait()
        # groups already back may still make a step, whose publication retries (up to ~8 s) and could reach the
        # restarted server by itself; once the learner's version has held for longer than that, nothing but the
        # catch-up can bring a server that restarts at version 0 to it (no rollout of version 0 is fresh enough)
        held = learner_version_held(status, 12.0)
        done_before = len(read_metrics(metrics))
        start_server(procs, tiny_model, url)
        until_sync(lambda: server_weight_version(url) == str(held), 120, f"the catch-up to version {held}",
                   check=lambda: procs.check_alive("serve", "learner", "actors"))
        learner = procs.procs["learner"]
        until_sync(lambda: learner.poll() is not None, 400, "the learner to reach its steps",
                   check=lambda: procs.check_alive("serve") or procs.check_alive("actors", clean_exit_ok=True))
        assert learner.returncode == 0, tail(procs.log("learner"))
        final_version = server_weight_version(url)
    records = read_metrics(metrics)
    assert records[-1]["step"] == 5 and len(records) > done_before
    assert "served an older version than" in procs.log("learner").read_text(errors="replace")
    assert final_version == str(records[-1]["policy_version"])


@pytest.mark.docker
def test_killed_learner_resumes_and_actors_reconnect(tmp_path, desktop_image, tiny_model):
    run_id = f"resume-{uuid.uuid4().hex[:8]}"
    config, url = write_config(tmp_path, tiny_model, desktop_image, run_id, "actors.actors=3")
    run = tmp_path / "run"
    metrics, status = run / "metrics.jsonl", run / "status.json"
    with running_job(tmp_path, config, url, tiny_model, run_id) as procs:
        alive = lambda: procs.check_alive("serve", "learner", "actors")  # noqa: E731
        # 1. one optimizer step, with rollouts of this learner running on the actors (2 of 3, so that one is
        # still out when the learner dies, though status.json may be a second old)
        until_sync(lambda: read_metrics(metrics) and read_json(status).get("running", 0) >= 2, 300,
                   "step 1 with rollouts in flight", check=alive)
        old_prefix = read_json(status)["learner_id"][:6] + "-"

        # 2. SIGKILL the learner; the actors finish their rollouts and hold the trajectories
        learner = procs.procs["learner"]
        os.killpg(learner.pid, signal.SIGKILL)
        learner.wait()
        before = read_metrics(metrics)
        saved = read_json(sorted((run / "checkpoints").glob("step-*"))[-1] / "meta.json")
        assert saved["step"] >= before[-1]["step"] and saved["policy_version"] >= before[-1]["policy_version"]
        actors_log = procs.log("actors")
        offset = actors_log.stat().st_size
        held = until_sync(lambda: [e for e in episodes(actors_log, offset) if e[1].startswith(old_prefix)], 240,
                          "an actor to finish a rollout of the killed learner",
                          check=lambda: procs.check_alive("serve", "actors"))

        # 3. a new learner on the same run folder continues and finishes learner.steps=3 in all
        learner2 = procs.start("learner2", [PY, "-m", "learner.main", "--config", str(config)])
        until_sync(lambda: learner2.poll() is not None, 400, "the resumed learner to finish",
                   check=lambda: procs.check_alive("serve") or procs.check_alive("actors", clean_exit_ok=True))
        assert learner2.returncode == 0, tail(procs.log("learner2"))
        actors = procs.procs["actors"]
        # the same process, never restarted
        until_sync(lambda: actors.poll() is not None, 120, "the actors to shut down")
        assert actors.returncode == 0, tail(actors_log)
        final_version = server_weight_version(url)

    records = read_metrics(metrics)
    assert records[: len(before)] == before  # history kept, appended to
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)) and steps[-1] == 3, steps
    versions = [r["policy_version"] for r in records]
    assert versions == sorted(set(versions)) and final_version == str(versions[-1])
    assert all(set(REQUIRED_KEYS) <= set(r) for r in records)
    resumed = next(r["resumed_from"] for r in records if "resumed_from" in r)
    assert resumed["step"] == saved["step"] and resumed["policy_version"] == saved["policy_version"]
    assert resumed["trainer_steps"] == saved["trainer_steps"]  # the optimizer step count came back
    assert resumed["replay"] == saved["replay"]  # the replay buffer came back as saved

    last = read_json(run / "checkpoints" / "step-000003" / "meta.json")
    assert last["trainer_steps"] == 3 and last["policy_version"] == versions[-1]
    assert len(list((run / "checkpoints").iterdir())) == 2  # the last two kept
    trainer_state = torch.load(run / "checkpoints" / "step-000003" / "trainer.pt", weights_only=True)
    adam_steps = {float(s["step"]) for s in trainer_state["optimizer"]["state"].values()}
    assert adam_steps == {3.0}  # AdamW moments continued from the checkpoint, not restarted

    # the same actors process noticed the new learner once and got new work from it. How many trajectories it
    # re-sent on noticing is not fixed: ZeroMQ delivers what was queued while no learner ran before the new
    # learner's first LearnerStatus can come back (a heartbeat written to the dead connection is lost, so a
    # trajectory can be the first message the new learner reads), and those are acked already.
    actors_text = actors_log.read_text(errors="replace")
    assert len(re.findall(r"learner restarted \(\w+\); re-sending \d+ trajectories", actors_text)) == 1
    assert any(not e[1].startswith(old_prefix) for e in episodes(actors_log, offset))
    # every held trajectory reached the new learner: acked and counted as late (its group was the old learner's)
    assert records[-1]["totals"].get("late", 0) - saved["totals"].get("late", 0) >= len(held) >= 1
    assert remove_containers(run_id) == []


@pytest.mark.docker
def test_lockstep_job_end_to_end(tmp_path, desktop_image, tiny_model, monkeypatch):
    """ARPO's lockstep loop with a custom advantage function (learner.advantage_function, the seam of
    learner.algo.advantages): the learner process imports it by name and the training loop's advantages stage
    calls it once per group with a reward difference."""
    run_id = f"lockstep-{uuid.uuid4().hex[:8]}"
    calls = tmp_path / "advantage_calls.jsonl"
    monkeypatch.setenv(ADVANTAGE_LOG_ENV, str(calls))  # inherited by the learner process
    config, url = write_config(tmp_path, tiny_model, desktop_image, run_id, "actors.actors=4",
                               'learner.schedule="lockstep"', "learner.groups_per_step=2", "learner.steps=2",
                               "learner.updates_per_batch=2",
                               'learner.advantage_function="tests.support:recording_advantages"')
    run = tmp_path / "run"
    with running_job(tmp_path, config, url, tiny_model, run_id) as procs:
        learner = procs.procs["learner"]
        until_sync(lambda: learner.poll() is not None, 400, "the lockstep learner to finish",
                   check=lambda: procs.check_alive("serve") or procs.check_alive("actors", clean_exit_ok=True))
        assert learner.returncode == 0, tail(procs.log("learner"))
        final_version = server_weight_version(url)
    records = read_metrics(run / "metrics.jsonl")
    assert records and records[-1]["step"] == 2 and all(r["schedule"] == "lockstep" for r in records)
    assert all(set(REQUIRED_KEYS) <= set(r) for r in records)
    assert sum(r["updates"] for r in records) == 2 and records[-1]["optimizer_steps"] == 2
    assert [r["policy_version"] for r in records] == list(range(1, len(records) + 1))
    assert final_version == str(len(records))
    assert all(r["staleness_max"] == 0 for r in records)  # nothing was handed out while training
    advantages = [json.loads(line) for line in calls.read_text().splitlines()]
    assert len(advantages) >= len(records)  # every trained batch had at least one group with a reward difference
    assert all(c["task_id"].startswith("grid4-") and len(c["rewards"]) == 2 and len(set(c["rewards"])) == 2
               for c in advantages)
    assert records[-1]["rollout_batches"] >= len(records)
    # each rollout batch is groups_per_step whole groups, all back before the next batch is handed out
    done = episodes(procs.log("actors"))
    batch_of = {group: int(re.search(r"g(\d+)-", group)[1]) // 2 for _, group, _, _ in done}
    assert len(batch_of) == 2 * records[-1]["rollout_batches"]
    order = [batch_of[group] for _, group, _, _ in done]  # batch of each episode, in the order they finished
    assert order == sorted(order), order
    assert remove_containers(run_id) == []


# ---------------------------------------------------------------- checkpoint files, without desktops

TASKS = [Task.from_dict({"id": f"grid4-{c}", "instruction": f"click {c}", "config": [],
                         "evaluator": {"func": "exact_match", "result": {"type": "vm_file", "path": "/r"},
                                       "expected": {"type": "rule", "rules": {"expected": c}}}})
         for c in ("red", "blue", "green")]


def make_service(replay_mode: str = "arpo") -> tuple[LearnerService, ReplayBuffer]:
    """A learner service with fresh components (nothing sends its outbox)."""
    replay = make_replay(replay_mode, capacity_per_task=4, seed=1)
    scheduler = GroupScheduler(TASKS, group_size=2, seed=5, id_prefix=f"{uuid.uuid4().hex[:6]}-")
    return LearnerService(Outbox(routed=True), scheduler, StalenessManager(2, 1)), replay


def finished(rollout, outcome: str, score: float) -> Trajectory:
    step = Step([1, 2, 3], [0], [4, 5], [-0.5, -0.25], [0, 0], "Thought: x\nAction: wait()", "wait()")
    return Trajectory(uuid.uuid4().hex, "a/0", rollout.task.id, rollout.group_id, rollout.rollout_index, outcome,
                      score, True, [step], [os.urandom(6000)])  # > BLOB_MIN_BYTES: travels as a raw frame


@pytest.mark.parametrize("replay_mode", ["arpo", "prioritized"])
def test_capture_and_restore_round_trip_through_a_checkpoint(tmp_path, tiny_model, replay_mode):
    ctx = zmq.asyncio.Context()
    try:
        service, replay = make_service(replay_mode)
        scheduler, admission = service.scheduler, service.admission
        group = [scheduler.next_rollout() for _ in range(2)]
        for rollout, (outcome, score) in zip(group, [("SUCCESS", 1.0), ("FAILURE", 0.0)]):
            admission.on_start()
            complete = scheduler.on_trajectory(finished(rollout, outcome, score))
            admission.on_finish(accepted=True)
        batcher = Batcher(replay, max_staleness=1, groups_per_step=1, drops=service.state.drops)  # the loop's
        assert batcher.add_group(complete, 0) is not None  # scored: 2 accepted, waiting to be trained
        open_rollout = scheduler.next_rollout()
        admission.on_start()
        scheduler.on_trajectory(finished(open_rollout, "SUCCESS", 1.0))
        admission.on_finish(accepted=True)  # 1 accepted in an incomplete group
        service.state.published_version = 5
        service.state.step = 7
        service.state.totals.update({"trajectories": 3, "late": 2, "desktop_busy_s": 12.5})
        service.state.drops["stale"] += 4
        expected_order = scheduler.state_dict()["order"]
        stored = replay.stored(group[0].task.id)
        trainer = Trainer(tiny_model, LearnerConfig(lr=1e-6, torch_threads=1))
        trainer.steps = 7
        random.seed(11)
        waiting = sum(len(g.trajectories) for g in batcher.ready)  # as TrainingLoop.checkpoint counts them
        folder = Checkpointer(tmp_path / "ck").save(7, trainer, capture(service, replay, waiting=waiting),
                                                    {"policy_version": 5})
        want = [random.random() for _ in range(3)]

        fresh, fresh_replay = make_service(replay_mode)
        fresh_trainer = Trainer(tiny_model, LearnerConfig(lr=1e-6, torch_threads=1))
        loaded, state, meta = Checkpointer(tmp_path / "ck").load_latest(fresh_trainer)
        restore(state, fresh, fresh_replay)
        assert loaded == folder and meta["policy_version"] == 5 and meta["trainer_steps"] == 7
        assert (fresh.announced_version, fresh.state.step, fresh_trainer.steps) == (5, 7, 7)
        assert fresh.state.totals == service.state.totals and fresh.state.drops == service.state.drops
        assert fresh.admission.accepted == 0  # 3 accepted, all lost with the learner (2 untrained + 1 open)
        assert fresh.scheduler.state_dict()["order"] == expected_order
        assert fresh.scheduler.task_stats == scheduler.task_stats
        assert fresh_replay.stored(group[0].task.id) == stored and stored  # trajectories, screenshots included
        assert [random.random() for _ in range(3)] == want  # the process RNG continues where it was saved
    finally:
        ctx.destroy(linger=0)


def test_checkpoints_keep_the_newest_and_fall_back_to_an_older_one(tmp_path, tiny_model):
    ctx = zmq.asyncio.Context()
    try:
        service, replay = make_service()
        trainer = Trainer(tiny_model, LearnerConfig(lr=1e-6, torch_threads=1))
        checkpointer = Checkpointer(tmp_path / "ck", keep=2)
        assert checkpointer.load_latest(trainer) is None
        for step in (1, 2, 3):
            trainer.steps = step
            checkpointer.save(step, trainer, capture(service, replay), {"policy_version": step})
        assert [f.name for f in checkpoint_folders(tmp_path / "ck")] == ["step-000002", "step-000003"]
        assert [p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith(".")] == []  # no temp folders

        (tmp_path / "ck" / "step-000003" / "learner.pt").write_bytes(b"torn")
        folder, _, meta = checkpointer.load_latest(trainer)
        assert folder.name == "step-000002" and meta["policy_version"] == 2 and trainer.steps == 2

        (tmp_path / "ck" / "step-000002" / "trainer.pt").write_bytes(b"torn")
        with pytest.raises(CheckpointError, match="step-000002.*step-000003|step-000003.*step-000002"):
            checkpointer.load_latest(trainer)
    finally:
        ctx.destroy(linger=0)


def metrics_record(step: int) -> dict:
    return {key: 0 for key in REQUIRED_KEYS} | {"step": step, "policy_version": step}


def test_reconcile_metrics_rolls_back_and_repairs(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    for step in (1, 2, 3, 4):
        writer.write(metrics_record(step))
    writer.close()
    # resumed from a checkpoint after step 2: steps 3 and 4 were undone
    assert reconcile_metrics(path, 2, [metrics_record(2)]) == 2
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.rolled_back.jsonl")] == [3, 4]
    # died after checkpoint 3 was saved but before its record was written: the record comes from the checkpoint
    assert reconcile_metrics(path, 3, [metrics_record(3)]) == 0
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    before = path.read_bytes()
    assert reconcile_metrics(path, 3, [metrics_record(3)]) == 0 and path.read_bytes() == before
