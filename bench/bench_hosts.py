"""One learner, many actor hosts: 1,024 actors on two hosts (network namespaces) send to one training learner.

What runs, each a process of its own:

- the real learner, ``python -m learner.main`` with the tiny policy: its ROUTER, LearnerService (admission,
  acks, de-duplication), scheduler, batcher, the trainer taking optimizer steps in its thread, the disk weight
  publisher, checkpoints and metrics.jsonl with TensorBoard; it binds ``tcp://0.0.0.0:PORT``;
- the real ``arpo-serve`` with the same policy, which the learner publishes every new version to (the actors do
  not call it: see below);
- two actor hosts, each a network namespace joined to the host by a veth pair (tests/netns.py, as
  tests/integration/test_second_host.py does), each running bench/actor_host.py: N real EnvActors with
  the real EpisodeRunner (UI-TARS prompt, PromptEncoder, reply parser, evaluator) and the real LearnerLink over a
  DEALER SocketPump that connects to the learner across the link. Stand-ins, from bench_actor_loop.py: the
  desktop is instant and in-process (1,024 containers would not fit this machine), and the policy waits a fixed
  latency and returns a valid UI-TARS click whose tokens carry the policy version the learner last announced.
  The evaluator's answer is a coin flip, so groups have a reward difference and the learner trains.

What it shows, over ``--seconds`` of training:

1. no message is lost: every ZeroMQ pump counts the messages it decoded and sent by type; the work requests and
   trajectories both hosts sent equal what the learner received, the assignments and acks the learner sent equal
   what the hosts received, the learner acked every trajectory it received, and no host holds an unacked one
   after draining (``lost`` = the sum of every difference);
2. every queue stays bounded, with its depth in metrics: the learner samples each queue every 50 ms and writes its
   peak in status.json and in every metrics record (``queues_max``, TensorBoard ``queues_max/*``); each peak is
   checked against the queue's bound (``unbounded`` = how many exceed it);
3. the learner's event-loop lag while it trains (a 20 ms probe, arpo_async.loop_lag): ``loop_lag_p99_ms`` is the
   p99 of every probe sample of the measured window (target <= 50 ms), read off the difference of status.json's
   run-wide histogram (``loop_lag_buckets``) at its start and end; ``loop_lag_worst_record_p99_ms`` is the worst
   metrics record's p99 (a record holds ~50 samples, so that is nearly its maximum); the baseline is the same
   learner idle before the hosts connect, measured in the same run.

Where namespaces cannot be made (not root, no iproute2) both hosts run on loopback and the last line says
``netns=0``.

Last line, e.g.: ``actors=1024 hosts=2 netns=1 lost=0 unbounded=0 loop_lag_p99_ms=... max_queue_depth=...``

    python -m bench.bench_hosts                # 2 x 512 actors, 120 s of training
    python -m bench.bench_hosts --quick        # smoke: 2 x 32 actors, 20 s
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from arpo_async.loop_lag import bucket_quantile
from bench._arpo_run import ROOT, ensure_model
from bench._common import median, result_line
from bench.bench_actor_loop import HISTORY_IMAGES, TASK, free_port
from tests.netns import NamespaceUnavailable, in_namespace, private_link

WIRE_UP = ("hello", "work_request", "trajectory")
"""Message types actor hosts send whose counts must match the learner's received counts (heartbeats are left out:
one sent as a host exits may be answered after it closed its socket)."""
WIRE_DOWN = ("assignment", "ack")
"""Message types the learner sends whose counts must match what the hosts received."""


@dataclasses.dataclass
class Setup:
    """One run's shape."""

    hosts: int
    actors_per_host: int
    seconds: float
    latency_s: float
    max_steps: int
    group_size: int
    groups_per_step: int
    max_staleness: int
    tasks: int
    """Task ids (copies of one task): with 32, the success replay fills to its default total of 256."""

    @property
    def actors(self) -> int:
        return self.hosts * self.actors_per_host


def read_json(path: Path) -> dict:
    """A JSON file written atomically by another process ({} while absent)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def wait_for(what: str, condition, timeout_s: float, alive=lambda: None, period_s: float = 0.5):
    """Poll ``condition()`` until it returns something truthy (returned); ``alive()`` raises if a process died.

    Raises:
        TimeoutError: ``timeout_s`` passed first (names ``what``).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive()
        if found := condition():
            return found
        time.sleep(period_s)
    raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")


class Processes:
    """Child processes with their logs in ``folder``; each in a session of its own (signalled as a group)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        """Start ``argv`` as ``name`` (log: ``<folder>/<name>.log``)."""
        with (self.folder / f"{name}.log").open("w") as log:
            self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                                start_new_session=True)
        return self.procs[name]

    def check(self, *names: str) -> None:
        """Raise RuntimeError (with the log's tail) if one of ``names`` exited."""
        for name in names:
            code = self.procs[name].poll()
            if code is not None:
                tail = (self.folder / f"{name}.log").read_text()[-3000:]
                raise RuntimeError(f"{name} exited with {code}:\n{tail}")

    def signal(self, name: str, sig: int) -> None:
        """Send ``sig`` to ``name`` (gone already: nothing)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.procs[name].pid, sig)

    def stop_all(self) -> None:
        """SIGTERM every process group still running; SIGKILL what is left after 60 s."""
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def learner_config(work: Path, model: Path, setup: Setup, port: int, serve_url: str, run_id: str) -> Path:
    """The run file of the learner: ``setup.tasks`` copies of the bench's task, groups of ``group_size``, training
    until stopped."""
    from arpo_async.config import dump_toml, load_config

    tasks = work / "tasks"
    tasks.mkdir()
    for i in range(setup.tasks):  # copies of one task: the replay buffer fills as over ARPO's task set
        (tasks / f"task-{i:03d}.json").write_text(json.dumps({**TASK, "id": f"bench-hosts-{i:03d}"}))
    config = load_config(None, [
        f'run_dir="{work / "run"}"', f'model="{model}"', f'run_id="{run_id}"',
        f'transport.endpoint="tcp://0.0.0.0:{port}"', "transport.heartbeat_s=1.0",
        f'learner.tasks="{tasks}"', f"learner.group_size={setup.group_size}",
        f"learner.groups_per_step={setup.groups_per_step}", f"learner.max_staleness={setup.max_staleness}",
        "learner.steps=0", "learner.sample_trajectories=0", f'actors.inference_urls=["{serve_url}"]',
        f"actors.max_steps={setup.max_steps}", f"actors.history_images={HISTORY_IMAGES}"])
    path = work / "config.toml"
    path.write_text(dump_toml(config))
    return path


@contextlib.contextmanager
def hosts_links(count: int, netns: bool):
    """``count`` (namespace or None, address of the learner as that host sees it); loopback without netns."""
    with contextlib.ExitStack() as stack:
        links = []
        for _ in range(count):
            if netns:
                ns, host_ip, _ = stack.enter_context(private_link())
                links.append((ns, host_ip))
            else:
                links.append((None, "127.0.0.1"))
        yield links


def run(setup: Setup, model: Path, work: Path, netns: bool) -> dict:
    """Run the learner, arpo-serve and the actor hosts; return what both ends counted and measured."""
    procs = Processes(work)
    serve_port, port, run_id = free_port(), free_port(), f"hosts-{uuid.uuid4().hex[:8]}"
    serve_url = f"http://127.0.0.1:{serve_port}"
    config = learner_config(work, model, setup, port, serve_url, run_id)
    status_path, metrics_path = work / "run" / "status.json", work / "run" / "metrics.jsonl"
    status = lambda: read_json(status_path)  # noqa: E731
    names = [f"host-{chr(ord('a') + i)}" for i in range(setup.hosts)]
    try:
        with hosts_links(setup.hosts, netns) as links:
            procs.start("serve", [sys.executable, "-m", "arpo_serve.main", "--model", str(model),
                                  "--port", str(serve_port)])
            ready = lambda: "arpo-serve ready" in (work / "serve.log").read_text(errors="replace")  # noqa: E731
            wait_for("arpo-serve's ready line", ready, 300, lambda: procs.check("serve"))
            procs.start("learner", [sys.executable, "-m", "learner.main", "--config", str(config)])
            alive = lambda: procs.check("serve", "learner")  # noqa: E731
            wait_for("the learner's status.json", lambda: status().get("loop_lag_ms", {}).get("samples", 0) >= 100,
                     300, alive)
            idle = status()["loop_lag_ms"]  # the baseline: the same learner, no actor yet
            for name, (ns, address) in zip(names, links):
                argv = [sys.executable, "-m", "bench.actor_host", "--endpoint",
                        f"tcp://{address}:{port}", "--actors", str(setup.actors_per_host), "--actor-id", name,
                        "--run-id", run_id, "--model", str(model), "--latency", str(setup.latency_s),
                        "--max-steps", str(setup.max_steps), "--counts", str(work / f"{name}.json"),
                        "--seed", str(len(procs.procs))]
                procs.start(name, in_namespace(ns, argv) if ns else argv)
            alive = lambda: procs.check("serve", "learner", *names)  # noqa: E731
            wait_for("both hosts to say hello", lambda: status().get("actors", 0) >= setup.hosts, 180, alive)
            wait_for("the first optimizer step", lambda: status().get("step", 0) >= 1, 300, alive)
            started, seen = time.monotonic(), []
            while time.monotonic() - started < setup.seconds:
                alive()
                seen.append(status())
                time.sleep(1.0)
            trained = status()
            for name in names:  # stop asking for work, drain
                procs.signal(name, signal.SIGUSR1)
            wait_for("the hosts to drain", lambda: all(read_json(work / f"{n}.json").get("drained") for n in names),
                     120, alive)
            final = wait_for("the learner to go quiet", lambda: quiet(status, metrics_path), 300,
                             lambda: procs.check("serve", "learner"), period_s=0)
            for name in names:
                procs.signal(name, signal.SIGUSR2)
            hosts = wait_for("the hosts' final counts", lambda: [c for n in names
                                                                 if (c := read_json(work / f"{n}.json")).get("done")]
                             if all(read_json(work / f"{n}.json").get("done") for n in names) else None, 60)
    finally:
        procs.stop_all()
    from arpo_async.metrics import read_metrics

    return {"idle": idle, "trained": trained, "final": final, "hosts": hosts, "records": read_metrics(metrics_path),
            "seen": seen}


def quiet(status, metrics_path: Path, still_s: float = 5.0) -> dict | None:
    """The learner's status once nothing it sends or receives changes for ``still_s`` (and at least one record
    interval: a training step still running would publish a version and so hand out more rollouts): None before."""
    from arpo_async.metrics import read_metrics

    walls = [r["wall_s"] for r in read_metrics(metrics_path)]
    gaps = [b - a for a, b in zip(walls, walls[1:])]
    wait_s = max(still_s, 1.5 * max(gaps, default=0.0))
    before = status()
    time.sleep(wait_s)
    after = status()
    same = before.get("messages") == after.get("messages") and before.get("step") == after.get("step")
    return after if same and after else None


def bounds(setup: Setup) -> dict[str, int]:
    """The bound of every learner queue whose peak is checked (see the module docstring of each owner):
    the pump's inbox and outbox (arpo_async.transport), requests waiting (each host's Hello announces one slot per
    actor: waiting + running <= slots, learner.rollouts.peers), one host's request queue, rollouts running, scored
    groups not yet trained (AReaL's rule, accepted + running < (eta + version + 1) x B, leaves at most (eta + 1) x B
    trainable trajectories untrained: (eta + 1) x groups_per_step groups), and the fullest host's outbox."""
    from arpo_async.transport import INBOX_SIZE, OUTBOX_SIZE

    return {"inbox": INBOX_SIZE, "outbox": OUTBOX_SIZE, "waiting_requests": setup.actors,
            "waiting_max_peer": setup.actors_per_host, "running": setup.actors,
            "ready_groups": (setup.max_staleness + 1) * setup.groups_per_step, "actor_outbox_max": OUTBOX_SIZE}


def analyse(setup: Setup, out: dict) -> tuple[dict, list[str]]:
    """The figures of one run and the table lines that show them."""
    import collections

    from arpo_async.transport import INBOX_SIZE, OUTBOX_SIZE

    final, hosts = out["final"], out["hosts"]
    learner_in, learner_out = final["messages"]["received"], final["messages"]["sent"]
    host_out, host_in = collections.Counter(), collections.Counter()
    for host in hosts:
        host_out.update(host["messages"]["sent"])
        host_in.update(host["messages"]["received"])
    lines = [f"{'message':<14} {'sent':>9} {'received':>9} {'lost':>6}"]
    lost = 0
    for kind, sent, received in ([(t, host_out[t], learner_in.get(t, 0)) for t in WIRE_UP]
                                 + [(t, learner_out.get(t, 0), host_in[t]) for t in WIRE_DOWN]):
        lost += abs(sent - received)
        lines.append(f"{kind:<14} {sent:>9} {received:>9} {sent - received:>6}")
    unacked = sum(h["unacked"] for h in hosts)
    # the learner acks each trajectory it gets (one Ack message may carry a burst's ids: count the ids)
    not_acked = learner_in.get("trajectory", 0) - final["totals"].get("acked", 0)
    lost += unacked + abs(not_acked)
    lines.append(f"trajectories the learner received but did not ack: {not_acked}; held unacked by the hosts after "
                 f"draining: {unacked}")

    peaks, limit = final["queues_max"], bounds(setup)
    lines.append(f"{'queue (learner)':<18} {'peak':>6} {'bound':>6}")
    unbounded = 0
    for name, bound in limit.items():
        unbounded += peaks.get(name, 0) > bound
        lines.append(f"{name:<18} {peaks.get(name, 0):>6} {bound:>6}")
    for name, bound in (("inbox", INBOX_SIZE), ("outbox", OUTBOX_SIZE)):
        peak = max(h["peaks"][name] for h in hosts)
        unbounded += peak > bound
        lines.append(f"{'host ' + name:<18} {peak:>6} {bound:>6}")
    lines.append(f"{'host unacked':<18} {max(h['peaks']['unacked'] for h in hosts):>6} {'-':>6}")
    checked = {name: peaks.get(name, 0) for name in limit}
    deepest = max(checked, key=checked.get)

    lags = [r["loop_lag_ms"] for r in out["records"] if r.get("loop_lag_ms", {}).get("samples")]
    p99s = [lag["p99"] for lag in lags]
    idle = out["idle"]
    trained, first = out["trained"], out["seen"][0]
    during = lag_buckets_between(first, trained)
    if not during:
        raise RuntimeError("the learner's loop-lag probe recorded no sample while it trained")
    steps = trained["step"] - first["step"]
    window_s = trained["wall_s"] - first["wall_s"]
    trajectories = trained["totals"].get("trajectories", 0) - first["totals"].get("trajectories", 0)
    lines.append(f"learner event-loop lag while training (ms, {sum(during.values())} samples of the measured "
                 f"window): p50 {bucket_quantile(during, 0.5)}, p99 {bucket_quantile(during, 0.99)}, p99.9 "
                 f"{bucket_quantile(during, 0.999)}")
    lines.append(f"learner event-loop lag per metrics record (ms): p99 median {median(p99s):.1f}, worst "
                 f"{max(p99s):.1f}; p50 median {median(lag['p50'] for lag in lags):.2f}; max "
                 f"{max(lag['max'] for lag in lags):.1f} ({len(lags)} records); idle before the hosts connected: "
                 f"p99 {idle['p99']:.0f}, max {idle['max']:.1f}")
    figures = {
        "actors": setup.actors, "hosts": setup.hosts, "netns": int(out["netns"]), "seconds": round(window_s),
        "steps": steps, "trajectories": trajectories, "traj_per_s": trajectories / max(window_s, 1e-9),
        "work_requests": learner_in.get("work_request", 0), "lost": lost, "unbounded": unbounded,
        "max_queue_depth": checked[deepest], "max_queue": deepest,
        "loop_lag_p99_ms": bucket_quantile(during, 0.99), "loop_lag_worst_record_p99_ms": max(p99s),
        "loop_lag_p99_median_ms": median(p99s),
        "loop_lag_max_ms": max(lag["max"] for lag in lags), "idle_lag_p99_ms": idle["p99"],
        "lag_p99_over_idle": max(p99s) / max(idle["p99"], 1.0),
        "host_lag_p99_ms": max(h["loop_lag_ms"]["p99"] for h in hosts), "load": round(os.getloadavg()[0], 1),
    }
    return figures, lines


def lag_buckets_between(before: dict, after: dict) -> dict[int, int]:
    """The learner's loop-lag samples between two status.json readings: the difference of their run-wide
    histograms (``loop_lag_buckets``, {ms: samples}; JSON made the keys strings)."""
    if "loop_lag_buckets" not in after or "loop_lag_buckets" not in before:
        raise RuntimeError("the learner's status.json has no loop_lag_buckets: no lag figure for the window")
    old = {int(ms): n for ms, n in before["loop_lag_buckets"].items()}
    return {int(ms): n - old.get(int(ms), 0) for ms, n in after["loop_lag_buckets"].items()
            if n - old.get(int(ms), 0) > 0}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke mode: 2 x 32 actors, 20 s")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--actors-per-host", type=int, default=512)
    p.add_argument("--seconds", type=float, default=120.0, help="measured seconds of training")
    p.add_argument("--latency", type=float, default=2.0, help="seconds per policy step of the stand-in")
    p.add_argument("--max-steps", type=int, default=3, help="episode budgets are drawn from 1..max-steps")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--groups-per-step", type=int, default=4)
    p.add_argument("--eta", type=int, default=4, help="learner.max_staleness")
    p.add_argument("--tasks", type=int, default=32, help="task ids the learner hands out (copies of one task)")
    p.add_argument("--model", type=Path, default=ROOT / "runs" / "tiny-model", help="created when missing")
    p.add_argument("--no-netns", action="store_true", help="run the hosts on loopback")
    p.add_argument("--keep", type=Path, default=None, help="copy the run folder and logs here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick:
        setup = Setup(hosts=2, actors_per_host=32, seconds=20, latency_s=0.5, max_steps=2, group_size=4,
                      groups_per_step=2, max_staleness=2, tasks=4)
    else:
        setup = Setup(args.hosts, args.actors_per_host, args.seconds, args.latency, args.max_steps,
                      args.group_size, args.groups_per_step, args.eta, args.tasks)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed bench still stops its processes, links
    model = ensure_model(args.model)
    netns = not args.no_netns
    with tempfile.TemporaryDirectory(prefix="bench-hosts-") as tmp:
        try:
            out = run(setup, model, Path(tmp), netns)
        except NamespaceUnavailable as why:
            print(f"no network namespaces here ({why}); the hosts run on loopback", flush=True)
            netns = False
            shutil.rmtree(tmp, ignore_errors=True)
            Path(tmp).mkdir()
            out = run(setup, model, Path(tmp), netns)
        out["netns"] = netns
        if args.keep is not None:
            shutil.copytree(tmp, args.keep, dirs_exist_ok=True)
    print(f"{setup.hosts} hosts x {setup.actors_per_host} actors ({'network namespaces' if netns else 'loopback'}); "
          f"policy stand-in {setup.latency_s:g} s per step, episodes of 1..{setup.max_steps} steps; G = "
          f"{setup.group_size}, {setup.groups_per_step} groups per step, eta = {setup.max_staleness}, "
          f"{setup.tasks} tasks; "
          f"{os.cpu_count()} CPUs", flush=True)
    figures, lines = analyse(setup, out)
    for line in lines:
        print(line)
    print(result_line(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
