"""`arpo launch`'s plan and bad-input checks (arpo_cli.cluster_plan) without a cluster, and the process host
(arpo_cli.cluster_process) with real child processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from arpo_async.config import ConfigError, load_config
from arpo_cli.cluster_plan import (ClusterError, Node, check_address, check_capacity, check_desktop_images,
                                   check_run_folder, desktop_shares, fill_addresses, place_servers, rank_environments,
                                   split_address)
from arpo_cli.cluster_process import ProcessHost
from tests.support import until_sync

ROOT = Path(__file__).resolve().parents[2]


def node(name: str, **resources: float) -> Node:
    return Node(name, f"10.0.0.{len(name)}", resources)


def config(*overrides: str):
    return load_config(None, overrides)


def test_desktops_are_shared_in_proportion_by_largest_remainder():
    nodes = [node("head", CPU=8), node("a", desktops=64), node("b", desktops=32), node("c", desktops=32)]
    assert desktop_shares(nodes, 128, "desktops") == {"a": 64, "b": 32, "c": 32}
    assert desktop_shares(nodes, 10, "desktops") == {"a": 5, "b": 3, "c": 2}  # 5, 2.5, 2.5: the first listed wins
    assert desktop_shares(nodes, 1, "desktops") == {"a": 1}  # nodes with no share get no process
    # a plain loop: every share is floor or ceil of the exact one, and they add up
    for actors in range(1, 129):
        shares = desktop_shares(nodes, actors, "desktops")
        assert sum(shares.values()) == actors
        for n in nodes[1:]:
            exact = actors * n.has("desktops") / 128
            assert int(exact) <= shares.get(n.node_id, 0) <= int(exact) + 1


def test_no_desktops_node_or_too_few_desktops_is_one_error_naming_the_resource_and_key():
    with pytest.raises(ClusterError, match=r"no node .* offers the resource 'desktops' \(cluster.desktops_resource\)"
                                           r" for the 8 desktops of actors.actors"):
        desktop_shares([node("head", CPU=8, GPU=8)], 8, "desktops")
    with pytest.raises(ClusterError, match=r"offer 6 desktops, fewer than actors.actors = 8"):
        desktop_shares([node("a", desktops=2), node("b", desktops=4)], 8, "desktops")


def test_too_few_gpus_is_refused_naming_the_keys():
    nodes = [node("gpu", CPU=64, GPU=8), node("a", CPU=16, desktops=64)]
    check_capacity(nodes, config("cluster.learner_ranks=7", "cluster.learner_gpus_per_rank=1", "cluster.server_gpus=1"))
    with pytest.raises(ClusterError, match=r"needs 9 GPU \(cluster.learner_ranks x cluster.learner_gpus_per_rank \+ "
                                           r"cluster.servers x cluster.server_gpus\) but the Ray cluster offers 8"):
        check_capacity(nodes, config("cluster.learner_ranks=8", "cluster.learner_gpus_per_rank=1",
                                     "cluster.server_gpus=1"))
    with pytest.raises(ClusterError, match=r"needs 11 CPU"):
        check_capacity([node("head", CPU=10)], config("cluster.learner_ranks=10"))
    with pytest.raises(ClusterError, match=r"one inference server .*cluster.server_resource"):
        check_capacity(nodes, config('cluster.server_resource="sglang"'))
    with pytest.raises(ClusterError, match=r"one learner rank .* the resource 'train' \(cluster.learner_resource\)"):
        check_capacity(nodes, config('cluster.learner_resource="train"'))
    with pytest.raises(ClusterError, match=r"no node has the 1 GPU and 4 CPU of one learner rank"):
        check_capacity([node("g", CPU=2, GPU=4), node("c", CPU=8)],
                       config("cluster.learner_gpus_per_rank=1", "cluster.learner_cpus_per_rank=4"))


def test_a_rank_takes_at_most_one_gpu_as_under_torchrun():
    with pytest.raises(ConfigError, match=r"cluster.learner_gpus_per_rank: must be <= 1, got 2"):
        config("cluster.learner_gpus_per_rank=2")


def test_servers_go_where_they_fit_beside_the_ranks():
    nodes = [node("learn", CPU=16, GPU=8), node("infer", CPU=16, GPU=8)]
    c = config("cluster.servers=3", "cluster.server_gpus=4", "cluster.learner_ranks=8",
               "cluster.learner_gpus_per_rank=1")
    with pytest.raises(ClusterError, match=r"inference server 3 of cluster.servers = 3 does not fit"):
        place_servers(nodes, c, {"learn": {"GPU": 8, "CPU": 8}})
    c = config("cluster.servers=2", "cluster.server_gpus=4")
    assert [n.node_id for n in place_servers(nodes, c, {"learn": {"GPU": 8}})] == ["infer", "infer"]


def test_ranks_get_torchruns_variables():
    envs = rank_environments(["10.0.0.1", "10.0.0.1", "10.0.0.2"], 29500)
    assert [(e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"]) for e in envs] == [
        ("0", "0", "2", "0"), ("1", "1", "2", "0"), ("2", "0", "1", "1")]
    assert {(e["WORLD_SIZE"], e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {("3", "10.0.0.1", "29500")}


def test_addresses_are_filled_in():
    filled = fill_addresses(config('transport.endpoint="tcp://127.0.0.1:5600"', 'run_dir="runs/x"'), "10.0.0.5",
                            [("10.0.0.6", 30000), ("10.0.0.6", 30001)])
    assert filled.transport.endpoint == "tcp://10.0.0.5:5600" and filled.learner.sync_host == "10.0.0.5"
    assert filled.actors.inference_urls == ("http://10.0.0.6:30000", "http://10.0.0.6:30001")
    assert filled.run_id == "x"
    with pytest.raises(ClusterError, match=r"transport.endpoint = 'ipc:///tmp/l'"):
        fill_addresses(config('transport.endpoint="ipc:///tmp/l"'), "10.0.0.5", [])


def test_a_ray_address_that_does_not_answer_is_refused_at_once():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(ClusterError, match=rf"the Ray cluster at 127.0.0.1:{port} does not answer \(--address\)"):
        check_address(f"127.0.0.1:{port}", timeout_s=2)
    assert time.monotonic() - started < 3
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert check_address(f"127.0.0.1:{server.getsockname()[1]}") == ("127.0.0.1", server.getsockname()[1])
    assert split_address("head") == ("head", 6379)
    with pytest.raises(ClusterError, match="HOST:PORT"):
        split_address("ray://head:10001")


def test_arpo_launch_with_a_dead_address_exits_1_with_one_message(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "arpo_cli", "launch", "--address", f"127.0.0.1:{port}", "--out",
                           str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith(f"arpo launch: the Ray cluster at 127.0.0.1:{port} does not answer")
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_a_run_folder_a_node_cannot_see_is_refused_naming_run_dir():
    check_run_folder([], "/shared/runs/a")
    with pytest.raises(ClusterError, match=r"/shared/runs/a \(run_dir\) is not visible from 10.0.0.7 .*shared "
                                           r"filesystem"):
        check_run_folder(["10.0.0.7 (node abcd)"], "/shared/runs/a")


def test_a_desktop_node_without_the_image_is_refused_naming_actors_image():
    check_desktop_images([], "arpo-desktop:x")
    with pytest.raises(ClusterError, match=r"arpo-desktop:x \(actors.image\) is not on 10.0.0.3 .*arpo desktop build"):
        check_desktop_images(["10.0.0.3 (node 1234)"], "arpo-desktop:x")


def test_process_host_logs_reports_exit_and_stops_the_process_group(tmp_path):
    host = ProcessHost("echo", ["{python}", "-c", "import sys; print(open(sys.argv[1]).read().strip(), sys.argv[2])",
                                "{config}", "{worker_pid}"], "x = 1", {}, str(tmp_path))
    assert host.wait() == 0
    text, offset = host.read_log(0)
    assert text.decode().splitlines()[-1] == f"x = 1 {os.getpid()}"
    assert host.read_log(offset) == (b"", offset)

    sleeper = ProcessHost("sleeper", ["sh", "-c", "trap '' TERM; echo ready; sleep 60 & wait"], "", {}, str(tmp_path))
    child = sleeper.node()["pid"]
    until_sync(lambda: b"\nready\n" in sleeper.read_log(0)[0], 30, "the shell's trap")
    assert group_alive(child)
    started = time.monotonic()
    assert sleeper.stop(grace_s=0.5) == -signal.SIGKILL  # SIGTERM ignored, so SIGKILL after the grace period
    assert time.monotonic() - started < 10
    until_sync(lambda: not group_alive(child), 10, "the sleep in the group to go")  # SIGKILL reached it too


def group_alive(pgid: int) -> bool:
    """Does a live (not zombie) process of group ``pgid`` remain? (/proc: state Z is a zombie awaiting reaping)"""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def test_a_failed_process_takes_its_worker_down_so_ray_restarts_it(tmp_path):
    # the host runs in a process of its own here, as in a Ray worker: its child exits 3, so the host exits 1
    code = ("import sys; from arpo_cli.cluster_process import ProcessHost; "
            f"h = ProcessHost('f', ['sh', '-c', 'exit 3'], '', {{}}, {str(tmp_path)!r}, restart_on_failure=True); "
            "h.wait(); import time; time.sleep(30)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "f exited with 3; restarting it" in (tmp_path / "f.log").read_text()
