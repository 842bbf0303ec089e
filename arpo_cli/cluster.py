"""`arpo launch`: one run placed on a Ray cluster and supervised there.

Ray only launches and supervises; the processes are the ones `arpo run` starts and talk as everywhere else
(ZeroMQ between actors and learner, HTTP to the servers, torch.distributed between learner ranks).

Owns: the Ray actors that host each process (arpo_cli.cluster_process.ProcessHost), the learner ranks' placement
group, the gathered logs (``<run>/logs/<process>.log``, pulled from each node every second) and
``<run>/cluster.json`` (where each process runs).
Order: check the address, the cluster's resources and the desktop nodes (arpo_cli.cluster_plan: one ClusterError
before anything starts) -> reserve the ranks' placement group (packed) -> check every rank and server node sees
the run folder and every desktop node holds the desktop image -> fill the addresses into ``<run>/config.toml``
-> start the inference servers and wait for their /health -> the learner ranks (torchrun's variables) -> one arpo-actors per desktop node -> progress line until
rank 0 exits -> stop actors, ranks, servers (SIGTERM, SIGKILL after cluster.stop_grace_s), remove every desktop
container on every desktop node, release the placement group.
Supervision: Ray restarts a dead arpo-actors or server process (cluster.max_restarts; the learner re-issues the
rollouts of the dead actor id); a desktop node that leaves takes its actors with it and the run goes on with the
others; a learner rank that dies stops the job (ClusterError; `arpo launch --resume` continues from the newest
checkpoint). Invariant: however the run ends (its steps, an error, Ctrl-C or SIGTERM), no placed process and no
container of the run is left on any node that is still in the cluster.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from arpo_async.config import RunConfig, dump_toml
from arpo_cli.cluster_plan import (LAUNCH_SERVE_PORT, ClusterError, Node, check_address, check_capacity,
                                   check_desktop_images, check_run_folder, desktop_shares, fill_addresses,
                                   place_servers, rank_bundle, rank_environments)
from arpo_cli.cluster_process import ProcessHost
from arpo_cli.launcher import (RunSignals, answers_health, crash_excerpt, draw_curve, prepare_run, run_interruptible,
                               show_progress, sigterm_as_interrupt, write_summary)
from arpo_cli.progress import ProgressDisplay, TrajectoryRate, open_display, progress_line

log = logging.getLogger("arpo.launch")

LOG_EVERY_S = 1.0
"""Each placed process's log is pulled into the run folder this often (seconds)."""
CALL_TIMEOUT_S = 30.0
"""Deadline of one short call to a placed process (its log, its node, a stop beyond its grace)."""
RANK_GRACE_S = 10.0
"""After rank 0 exits non-zero, how long to wait for the other ranks' exits: a rank killed under it makes rank 0's
next collective fail at once, so rank 0's exit often arrives first; the rank that was killed is the cause to name."""


@dataclass
class Placed:
    """One process placed on the cluster: its log name, role ("serve", "learner", "actors"), Ray actor handle,
    node, and for arpo-actors the label of its desktops; ``gone`` once its node left or its restarts ran out."""

    name: str
    role: str
    handle: Any
    node: Node
    label: str = ""
    log_offset: int = 0
    restarts: int = 0
    gone: bool = False
    info: dict = field(default_factory=dict)


def alive_nodes(ray: Any) -> list[Node]:
    """The cluster's alive nodes, head first as Ray lists them."""
    return [Node(n["NodeID"], n["NodeManagerAddress"], dict(n["Resources"])) for n in ray.nodes() if n["Alive"]]


def launch(address: str, config: RunConfig, *, resume: bool = False, display: ProgressDisplay | None = None) -> int:
    """Place and run ``config`` on the Ray cluster at ``address`` (HOST:PORT of the head's GCS) until the learner
    finishes; returns rank 0's exit code. SIGTERM is handled like Ctrl-C.

    Raises:
        ClusterError: bad input found before anything started (address, GPUs, CPUs, desktop nodes, run folder),
            or a learner rank or every server or desktop host died (the message names it and its log).
        arpo_cli.launcher.RunError: the run folder holds a run and ``resume`` is False, or has no checkpoint.
        KeyboardInterrupt: Ctrl-C or SIGTERM; everything was stopped and every container removed first.
    """
    previous = signal.signal(signal.SIGTERM, sigterm_as_interrupt)
    display = open_display() if display is None else display
    try:
        check_address(address)
        import ray

        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        try:
            nodes = alive_nodes(ray)
            check_capacity(nodes, config)
            shares = desktop_shares(nodes, config.actors.actors, config.cluster.desktops_resource)
            config = prepare_run(config, display.say, resume, desktops=False)
            run = ClusterRun(ray, config, display.say)
            return run_interruptible(lambda signals: _launch(run, nodes, shares, display, signals))
        finally:
            ray.shutdown()
    finally:
        display.close()
        signal.signal(signal.SIGTERM, previous)


async def _launch(run: ClusterRun, nodes: list[Node], shares: dict[str, int], display: ProgressDisplay,
                  signals: RunSignals) -> int:
    signals.install()
    started = time.monotonic()
    try:
        await run.place(nodes, shares)
        rate = TrajectoryRate()
        code = await run.supervise(lambda: show_progress(run.config, display, started, rate))
        display.update(progress_line(run.config, started, rate), time.monotonic(), force=True)
        await asyncio.to_thread(write_summary, run.config, code, run.config.actors.inference_urls[0],
                                time.monotonic() - started)
        curve = await asyncio.to_thread(draw_curve, run.config.run_path)
        if curve is not None:
            display.say(f"learning curve in {curve}")
        if code != 0:
            logs = run.config.run_path / "logs" / "learner-rank0.log"
            display.say(f"learner rank 0 exited with {code}; see {logs}:\n{crash_excerpt(logs)}")
        return code
    finally:
        signals.cleaning = True
        await run.stop()
        display.say(f"done in {time.monotonic() - started:.0f} s; logs in {run.config.run_path / 'logs'}")


class ClusterRun:
    """The placed processes of one run and their supervision (module docstring). ``say`` shows a message."""

    def __init__(self, ray: Any, config: RunConfig, say: Callable[[str], None]) -> None:
        self.ray, self.config, self.say = ray, config, say
        self.placed: list[Placed] = []
        self.group: Any = None
        self.host_class = ray.remote(max_concurrency=8)(ProcessHost)
        self.node_log_dir = f"/tmp/arpo-cluster/{config.resolved_run_id}"
        self._pulling = asyncio.Lock()  # one pull at a time: two from the same offset would write a piece twice
        self._rank0_exited = False

    def _of(self, role: str) -> list[Placed]:
        return [p for p in self.placed if p.role == role]

    async def place(self, nodes: list[Node], shares: dict[str, int]) -> None:
        """Reserve, check and start everything in order (module docstring). Raises ClusterError."""
        from ray.util.placement_group import placement_group, placement_group_table

        c = self.config.cluster
        bundle = rank_bundle(self.config)
        self.group = placement_group([bundle] * c.learner_ranks, strategy="PACK")
        try:
            async with asyncio.timeout(c.startup_timeout_s):
                await self.group.ready()
        except TimeoutError:
            raise ClusterError(f"the learner's {c.learner_ranks} ranks of {bundle} (cluster.learner_ranks, "
                               f"cluster.learner_cpus_per_rank, cluster.learner_gpus_per_rank) found no room within "
                               f"{c.startup_timeout_s:g} s (cluster.startup_timeout_s)") from None
        by_id = {n.node_id: n for n in nodes}
        table = placement_group_table(self.group)["bundles_to_node_id"]
        rank_nodes = [by_id[table[i]] for i in range(c.learner_ranks)]
        taken: dict[str, dict[str, float]] = {}
        for node in rank_nodes:
            for r, amount in bundle.items():
                taken.setdefault(node.node_id, {}).setdefault(r, 0.0)
                taken[node.node_id][r] += amount
        server_nodes = place_servers(nodes, self.config, taken)
        await self._check_run_folder(list({n.node_id: n for n in rank_nodes + server_nodes}.values()))
        await self._check_desktop_image([by_id[node_id] for node_id in shares])
        ports = [(self.config.serve.port or LAUNCH_SERVE_PORT) + i for i in range(c.servers)]
        self.config = fill_addresses(self.config, rank_nodes[0].ip, [(n.ip, p) for n, p in zip(server_nodes, ports)])
        (self.config.run_path / "config.toml").write_text(dump_toml(self.config))
        await self._start_servers(server_nodes, ports)
        await self._start_ranks(rank_nodes)
        self._start_actors(by_id, shares)
        await self._write_layout()
        self.say(f"placed {len(self._of('serve'))} server(s), {len(self._of('learner'))} learner rank(s) and "
                 f"arpo-actors on {len(self._of('actors'))} desktop node(s); where: "
                 f"{self.config.run_path / 'cluster.json'}")

    def _pinned(self, node: Node, **options: Any) -> Any:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return self.host_class.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
                                       **options)

    async def _check_run_folder(self, nodes: list[Node]) -> None:
        """Every node in ``nodes`` reads back a token the driver wrote in the run folder (check_run_folder)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        token = secrets.token_hex(8)
        marker = (self.config.run_path / f".launch-check-{token}").resolve()
        marker.write_text(token)
        reader = self.ray.remote(num_cpus=0)(_reads)
        try:
            seen = [reader.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False))
                    .remote(str(marker), token) for n in nodes]
            async with asyncio.timeout(self.config.cluster.startup_timeout_s):
                answers = [await ref for ref in seen]
        finally:
            marker.unlink(missing_ok=True)
        check_run_folder([f"{n.ip} (node {n.node_id[:8]})" for n, ok in zip(nodes, answers) if not ok],
                         str(self.config.run_path.resolve()))

    async def _check_desktop_image(self, nodes: list[Node]) -> None:
        """Every desktop node's Docker engine holds the desktop image (check_desktop_images)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        image = self.config.actors.image
        probe = self.ray.remote(num_cpus=0)(_has_image)
        calls = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False))
                 .remote(image) for n in nodes]
        async with asyncio.timeout(self.config.cluster.startup_timeout_s):
            answers = [await call for call in calls]
        check_desktop_images([f"{n.ip} (node {n.node_id[:8]})" for n, ok in zip(nodes, answers) if not ok], image)

    async def _start_servers(self, nodes: list[Node], ports: list[int]) -> None:
        c, run = self.config.cluster, self.config.run_path.resolve()
        text = dump_toml(self.config)
        for i, (node, port) in enumerate(zip(nodes, ports)):
            if c.server_gpus:
                args = ["{python}", "-m", "sglang.launch_server", "--model-path", self.config.model, "--host", node.ip,
                        "--port", str(port), "--tp-size", str(c.server_gpus)]
                args += ["--api-key", self.config.serve.api_key] if self.config.serve.api_key else []
                args += ["--admin-api-key", self.config.serve.admin_api_key] if self.config.serve.admin_api_key else []
            else:
                args = ["{python}", "-m", "arpo_serve.main", "--config", "{config}", "--host", node.ip, "--port",
                        str(port), "--weight-version", "0", "--weights-root", str(run / "weights")]
            name = f"serve-{i}"
            handle = self._pinned(node, num_cpus=c.server_cpus, num_gpus=c.server_gpus,
                                  max_restarts=c.max_restarts, max_task_retries=0).remote(
                name, args, text, {}, self.node_log_dir, restart_on_failure=True)
            self.placed.append(Placed(name, "serve", handle, node))
        for p, url in zip(self._of("serve"), self.config.actors.inference_urls):
            try:
                await answers_health(url, self.config.run_path / "logs" / f"{p.name}.log", c.startup_timeout_s)
            finally:
                await self._pull_logs()
            self.say(f"{p.name} ready at {url}")

    async def _start_ranks(self, nodes: list[Node]) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        c, text = self.config.cluster, dump_toml(self.config)
        for i, node in enumerate(nodes):
            handle = self.host_class.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=i),
                num_cpus=c.learner_cpus_per_rank, num_gpus=c.learner_gpus_per_rank, max_restarts=0).remote(
                f"learner-rank{i}", ["{python}", "-m", "learner.main", "--config", "{config}"], text, {},
                self.node_log_dir, start=False)
            self.placed.append(Placed(f"learner-rank{i}", "learner", handle, node))
        ranks = self._of("learner")
        infos = [await p.handle.node.remote() for p in ranks]
        master_port = await ranks[0].handle.free_port.remote()
        envs = rank_environments([p.node.ip for p in ranks], master_port)
        for p, info, env in zip(ranks, infos, envs):
            same_node = [other for other, o in zip(ranks, infos) if other.node.node_id == p.node.node_id]
            gpus = [g for other, o in zip(ranks, infos) if other in same_node for g in o["gpus"]]
            if gpus:  # torchrun's ranks see every GPU of their node and take cuda:LOCAL_RANK
                env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
            p.info = {"pid": await p.handle.start.remote(env), **env}

    def _start_actors(self, nodes: dict[str, Node], shares: dict[str, int]) -> None:
        c, text = self.config.cluster, dump_toml(self.config)
        for k, (node_id, share) in enumerate(shares.items()):
            label = f"n{k}"
            name = f"actors-{label}"
            args = ["{python}", "-m", "actors.main", "--config", "{config}", "--actors", str(share),
                    "--actor-id", f"{name}-{{worker_pid}}", "--set", f'actors.host_label="{label}"']
            handle = self._pinned(nodes[node_id], num_cpus=0, resources={c.desktops_resource: share},
                                  max_restarts=c.max_restarts, max_task_retries=0).remote(
                name, args, text, {}, self.node_log_dir, restart_on_failure=True)
            self.placed.append(Placed(name, "actors", handle, nodes[node_id], label=label, info={"actors": share}))

    async def _write_layout(self) -> None:
        """``<run>/cluster.json``: each process's name, role, node, pid (null once gone), restarts, the label of
        its desktops, the learner endpoint and server URLs. Rewritten after each restart."""
        from ray.exceptions import RayError

        rows = []
        for p in self.placed:
            try:
                async with asyncio.timeout(CALL_TIMEOUT_S):
                    pid = None if p.gone else (await p.handle.node.remote())["pid"]
            except (RayError, TimeoutError):
                pid = None
            rows.append({"name": p.name, "role": p.role, "node_id": p.node.node_id, "ip": p.node.ip, "pid": pid,
                         "restarts": p.restarts, "gone": p.gone,
                         "desktop_label": f"{self.config.resolved_run_id}-{p.label}" if p.label else None,
                         **{k: v for k, v in p.info.items() if k != "pid"}})
        layout = {"learner_endpoint": self.config.transport.endpoint,
                  "inference_urls": list(self.config.actors.inference_urls), "processes": rows}
        (self.config.run_path / "cluster.json").write_text(json.dumps(layout, indent=2))

    async def supervise(self, progress: Callable[[], Any]) -> int:
        """Wait for learner rank 0 to exit and return its code, while other tasks watch every other process,
        pull the logs and show ``progress()``. When rank 0 fails, the other ranks get ``RANK_GRACE_S`` to report
        a death of their own, which is then the error raised.

        Raises:
            ClusterError: another learner rank died, or every server or every desktop host is gone.
        """
        try:
            async with asyncio.TaskGroup() as tg:
                ranks = [tg.create_task(self._watch_rank(p)) for p in self._of("learner")[1:]]
                others = [tg.create_task(self._watch_restartable(p)) for p in self._of("serve") + self._of("actors")]
                others += [tg.create_task(self._pump_logs()), tg.create_task(progress())]
                code = await self._rank_exit(self._of("learner")[0])
                if code != 0 and ranks:
                    self._rank0_exited = True
                    await asyncio.wait(ranks, timeout=RANK_GRACE_S)  # one killed under it raises here
                for task in ranks + others:
                    task.cancel()
        except* ClusterError as errors:
            raise errors.exceptions[0] from None
        return code

    async def _rank_exit(self, p: Placed) -> int:
        from ray.exceptions import RayError

        try:
            return await p.handle.wait.remote()
        except RayError as e:
            raise self._rank_died(p, f"its Ray actor died ({type(e).__name__})") from None

    def _rank_died(self, p: Placed, why: str) -> ClusterError:
        logs = self.config.run_path / "logs" / f"{p.name}.log"
        return ClusterError(f"learner rank {p.name.removeprefix('learner-rank')} on {p.node.ip} {why}; the job stops. "
                            f"`arpo launch --resume --out {self.config.run_dir} --address HOST:PORT` continues from "
                            f"the newest checkpoint. See {logs}:\n{crash_excerpt(logs)}")

    async def _watch_rank(self, p: Placed) -> None:
        """Raise ClusterError when rank ``p`` dies: its Ray actor died, it was killed by a signal, or it exited
        non-zero while rank 0 still ran (after rank 0 failed, a rank exiting 1 is the consequence, not the cause)."""
        code = await self._rank_exit(p)
        if code < 0 or (code != 0 and not self._rank0_exited):
            await self._pull_logs()
            raise self._rank_died(p, f"exited with {code}")

    async def _watch_restartable(self, p: Placed) -> None:
        """Follow a server or arpo-actors through Ray's restarts; mark it gone when it cannot come back (its node
        left, or cluster.max_restarts ran out). Raises ClusterError when every process of its role is gone."""
        from ray.exceptions import RayError

        while True:
            try:
                if await p.handle.wait.remote() == 0:
                    return  # arpo-actors after the learner said shutdown
                continue  # non-zero: the worker is going down for a restart; the next call tells
            except RayError:
                pass
            try:
                info = await self._back_again(p)
                p.restarts += 1
                self.say(f"{p.name} on {p.node.ip} died; Ray restarted it (pid {info['pid']}, restart {p.restarts} "
                         f"of cluster.max_restarts = {self.config.cluster.max_restarts})")
                await self._write_layout()
            except (RayError, TimeoutError) as e:
                p.gone = True
                why = "its node left the cluster" if not self._node_alive(p.node) else f"{type(e).__name__}"
                if all(other.gone for other in self._of(p.role)):
                    raise ClusterError(f"{p.name} on {p.node.ip} is gone ({why}) and no other {p.role} process is "
                                       f"left; see {self.config.run_path / 'logs' / (p.name + '.log')}") from None
                self.say(f"{p.name} on {p.node.ip} is gone ({why}); the run goes on without it")
                await self._write_layout()
                return

    async def _back_again(self, p: Placed) -> dict:
        """Wait for Ray to restart ``p``'s actor (calls answer ActorUnavailableError meanwhile); its node() info.

        Raises:
            ray.exceptions.RayError: it died for good (ActorDiedError: its node left, or its restarts ran out).
            TimeoutError: it was not back within cluster.startup_timeout_s.
        """
        from ray.exceptions import ActorUnavailableError

        async with asyncio.timeout(self.config.cluster.startup_timeout_s):
            while True:
                try:
                    return await p.handle.node.remote()
                except ActorUnavailableError:
                    await asyncio.sleep(LOG_EVERY_S)

    def _node_alive(self, node: Node) -> bool:
        return any(n.node_id == node.node_id for n in alive_nodes(self.ray))

    async def _pump_logs(self) -> None:
        while True:
            await self._pull_logs()
            await asyncio.sleep(LOG_EVERY_S)

    async def _pull_logs(self) -> None:
        """Append what each placed process logged since the last pull to ``<run>/logs/<name>.log``."""
        from ray.exceptions import RayError

        folder = self.config.run_path / "logs"
        folder.mkdir(parents=True, exist_ok=True)
        async with self._pulling:
            for p in self.placed:
                if p.gone:
                    continue
                try:
                    while True:
                        async with asyncio.timeout(CALL_TIMEOUT_S):
                            data, p.log_offset = await p.handle.read_log.remote(p.log_offset)
                        if not data:
                            break
                        with (folder / f"{p.name}.log").open("ab") as out:
                            out.write(data)
                except (RayError, TimeoutError):
                    continue  # restarting or gone: its watcher says which

    async def stop(self) -> None:
        """Stop arpo-actors, then the learner ranks, then the servers (each SIGTERM, SIGKILL after
        cluster.stop_grace_s), pull the logs a last time, remove the run's containers on every desktop node still
        in the cluster, end the Ray actors and release the placement group. Never raises for a process or node
        that is already gone."""
        from ray.exceptions import RayError

        grace = self.config.cluster.stop_grace_s
        for role in ("actors", "learner", "serve"):
            calls = [p.handle.stop.remote(grace) for p in self._of(role) if not p.gone]
            for call in calls:
                try:
                    async with asyncio.timeout(grace + CALL_TIMEOUT_S):
                        await call
                except (RayError, TimeoutError):
                    pass
        await self._pull_logs()
        await self._remove_containers()
        for p in self.placed:
            self.ray.kill(p.handle, no_restart=True)
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self.group)

    async def _remove_containers(self) -> None:
        from ray.exceptions import RayError
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        remover = self.ray.remote(num_cpus=0)(_remove_containers)
        for p in self._of("actors"):
            if not self._node_alive(p.node):
                continue
            label = f"{self.config.resolved_run_id}-{p.label}"
            try:
                async with asyncio.timeout(CALL_TIMEOUT_S * 4):
                    removed = await remover.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                        p.node.node_id, soft=False)).remote(label)
            except (RayError, TimeoutError) as e:
                self.say(f"could not remove the containers labelled {label} on {p.node.ip}: {e}")
                continue
            if removed:
                self.say(f"removed {removed} leftover desktop container(s) on {p.node.ip}")


def _reads(path: str, token: str) -> bool:
    """On a node (a Ray task): does ``path`` hold ``token``?"""
    try:
        return Path(path).read_text() == token
    except OSError:
        return False


def _has_image(image: str) -> bool:
    """On a desktop node (a Ray task): does its Docker engine hold ``image``? (False when Docker does not answer.)"""
    from actors.desktop.build import image_exists

    try:
        return image_exists(image)
    except OSError:  # no docker command
        return False


def _remove_containers(label: str) -> int:
    """On a desktop node (a Ray task): remove the desktops labelled ``arpo.run=<label>``; how many."""
    from actors.desktop.fleet import remove_run_containers

    return asyncio.run(remove_run_containers(label))
