"""`arpo launch`'s plan: which node runs what, checked before anything starts.

Role: pure functions from the cluster's nodes (as Ray reports them) and the run's ``[cluster]`` section to the
processes to place: the desktop nodes and their share of ``actors.actors``, the learner ranks' torchrun
variables, the inference servers' URLs. Every bad input (too few GPUs or CPUs, no node offering the desktops
resource, a Ray address that does not answer, a run folder a node cannot see, a desktop node without the desktop
image) is one :class:`ClusterError` naming
the resource and the config key, raised before any process starts.
Imports no Ray (tests/unit/test_cluster_plan.py runs without a cluster).
"""

from __future__ import annotations

import dataclasses
import math
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from arpo_async.config import RunConfig

DEFAULT_RAY_PORT = 6379
"""The GCS port `ray start --head` listens on unless told otherwise."""


class ClusterError(RuntimeError):
    """The cluster cannot run this run file, or a placed process failed; the message names the resource and key."""


@dataclass(frozen=True)
class Node:
    """One alive Ray node: its id, the address other nodes reach it at, and its total resources
    (``{"CPU": 16.0, "GPU": 8.0, "desktops": 64.0, ...}``, as ``ray.nodes()`` reports them)."""

    node_id: str
    ip: str
    resources: Mapping[str, float]

    def has(self, resource: str) -> float:
        """How much of ``resource`` this node offers (0.0 when none)."""
        return float(self.resources.get(resource, 0.0))


def split_address(address: str) -> tuple[str, int]:
    """``host[:port]`` -> (host, port), the port DEFAULT_RAY_PORT when absent.

    Raises:
        ClusterError: not of that form (e.g. ``ray://`` client addresses, which `arpo launch` does not use).
    """
    host, sep, port = address.rpartition(":")
    if not sep:
        host, port = address, str(DEFAULT_RAY_PORT)
    if not host or "/" in host or not port.isdigit():
        raise ClusterError(f"--address {address!r}: give the head node's GCS address as HOST:PORT "
                           f"(what `ray start --head` printed, port {DEFAULT_RAY_PORT} by default)")
    return host, int(port)


def check_address(address: str, timeout_s: float = 5.0) -> tuple[str, int]:
    """Check that something accepts TCP connections at the Ray head's address before ``ray.init`` (which would
    retry for a long time); returns (host, port).

    Raises:
        ClusterError: the address is malformed, or nothing answers within ``timeout_s`` seconds.
    """
    host, port = split_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as e:
        raise ClusterError(f"the Ray cluster at {host}:{port} does not answer (--address): {e}; start it with "
                           f"`ray start --head --port {port}` on the head node") from None
    return host, port


def desktop_shares(nodes: Sequence[Node], actors: int, resource: str) -> dict[str, int]:
    """Split ``actors`` EnvActors over the nodes offering ``resource`` in proportion to how much each offers
    (Hamilton's largest-remainder method; ties go to the node listed first). Returns ``{node_id: actors}`` for
    the nodes that get at least one, in node order.

    Raises:
        ClusterError: no node offers ``resource``, or all of them together offer fewer than ``actors``.
    """
    offers = {n.node_id: n.has(resource) for n in nodes if n.has(resource) > 0}
    if not offers:
        raise ClusterError(f"no node of the Ray cluster offers the resource {resource!r} "
                           f"(cluster.desktops_resource) for the {actors} desktops of actors.actors; start each "
                           f"desktop host with `ray start --address HEAD --resources '{{\"{resource}\": N}}'`")
    total = sum(offers.values())
    if total < actors:
        raise ClusterError(f"the nodes offering {resource!r} (cluster.desktops_resource) offer {total:g} desktops, "
                           f"fewer than actors.actors = {actors}")
    exact = {node: actors * offer / total for node, offer in offers.items()}
    shares = {node: math.floor(x) for node, x in exact.items()}
    order = sorted(exact, key=lambda node: -(exact[node] - shares[node]))  # stable: first listed wins a tie
    for node in order[:actors - sum(shares.values())]:
        shares[node] += 1
    return {node: n for node, n in shares.items() if n > 0}


def check_capacity(nodes: Sequence[Node], config: RunConfig) -> None:
    """Check the cluster has the GPUs and CPUs the ``[cluster]`` section asks for: in all, and for each learner
    rank and each server a node it fits on.

    Raises:
        ClusterError: naming the resource (GPU, CPU or cluster.server_resource) and the keys that ask for it.
    """
    c = config.cluster
    asks = {"GPU": (c.learner_ranks * c.learner_gpus_per_rank + c.servers * c.server_gpus,
                    "cluster.learner_ranks x cluster.learner_gpus_per_rank + cluster.servers x cluster.server_gpus"),
            "CPU": (c.learner_ranks * c.learner_cpus_per_rank + c.servers * c.server_cpus,
                    "cluster.learner_ranks x cluster.learner_cpus_per_rank + cluster.servers x cluster.server_cpus")}
    for resource, (need, keys) in asks.items():
        have = sum(n.has(resource) for n in nodes)
        if need > have:
            raise ClusterError(f"the run needs {need:g} {resource} ({keys}) but the Ray cluster offers {have:g}")
    rank = rank_bundle(config)
    if not any(all(n.has(r) >= amount for r, amount in rank.items()) for n in nodes):
        extra = f" and the resource {c.learner_resource!r} (cluster.learner_resource)" if c.learner_resource else ""
        raise ClusterError(f"no node has the {c.learner_gpus_per_rank} GPU and {c.learner_cpus_per_rank:g} CPU of "
                           f"one learner rank (cluster.learner_gpus_per_rank, cluster.learner_cpus_per_rank){extra}")
    if not server_nodes(nodes, config):
        extra = f" and the resource {c.server_resource!r} (cluster.server_resource)" if c.server_resource else ""
        raise ClusterError(f"no node has the {c.server_gpus} GPU and {c.server_cpus:g} CPU of one inference server "
                           f"(cluster.server_gpus, cluster.server_cpus){extra}")


def rank_bundle(config: RunConfig) -> dict[str, float]:
    """What one learner rank reserves (a placement-group bundle): its CPUs, its GPU if any, and one unit of
    cluster.learner_resource if set. Ray refuses zero amounts, so they are left out."""
    c = config.cluster
    return {"CPU": c.learner_cpus_per_rank, **({"GPU": c.learner_gpus_per_rank} if c.learner_gpus_per_rank else {}),
            **({c.learner_resource: 1} if c.learner_resource else {})}


def server_nodes(nodes: Sequence[Node], config: RunConfig) -> list[Node]:
    """The nodes one inference server fits on (its GPUs, CPUs and cluster.server_resource)."""
    c = config.cluster
    needs = {"GPU": c.server_gpus, "CPU": c.server_cpus, **({c.server_resource: 1} if c.server_resource else {})}
    return [n for n in nodes if all(n.has(r) >= amount for r, amount in needs.items())]


def rank_environments(rank_ips: Sequence[str], master_port: int) -> list[dict[str, str]]:
    """The variables torchrun gives each rank, for ranks placed on the nodes at ``rank_ips`` (rank i on
    ``rank_ips[i]``): RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE (its index among, and the number of, the
    ranks on its node), GROUP_RANK (its node's index in order of first rank), MASTER_ADDR (rank 0's node) and
    MASTER_PORT. Source: torch.distributed.run's documented environment variables."""
    nodes = list(dict.fromkeys(rank_ips))
    per_node = {ip: [i for i, other in enumerate(rank_ips) if other == ip] for ip in nodes}
    return [{"RANK": str(i), "WORLD_SIZE": str(len(rank_ips)), "LOCAL_RANK": str(per_node[ip].index(i)),
             "LOCAL_WORLD_SIZE": str(len(per_node[ip])), "GROUP_RANK": str(nodes.index(ip)),
             "MASTER_ADDR": rank_ips[0], "MASTER_PORT": str(master_port)} for i, ip in enumerate(rank_ips)]


def check_run_folder(unseen: Sequence[str], run_dir: str) -> None:
    """``unseen``: the nodes (learner ranks and servers) that could not read a file the driver wrote in the run
    folder.

    Raises:
        ClusterError: some node cannot see the run folder (naming the key run_dir and the nodes).
    """
    if unseen:
        raise ClusterError(f"the run folder {run_dir} (run_dir) is not visible from {', '.join(unseen)}: the learner "
                           "ranks and the inference servers read and write it (checkpoints, weights), so it must be "
                           "on storage they share with the driver (NFS or another shared filesystem at the same "
                           "path), or every one of them must run on the driver's node")


def place_servers(nodes: Sequence[Node], config: RunConfig, taken: Mapping[str, Mapping[str, float]]) -> list[Node]:
    """A node for each of ``cluster.servers`` inference servers: the first node (in ``nodes`` order) where one more
    still fits (its GPUs, CPUs and cluster.server_resource), after what ``taken`` ({node_id: {resource: amount}},
    the learner ranks' bundles) holds.

    Raises:
        ClusterError: the servers do not fit beside the learner ranks (naming the keys).
    """
    c = config.cluster
    needs = {"GPU": c.server_gpus, "CPU": c.server_cpus, **({c.server_resource: 1} if c.server_resource else {})}
    left = {n.node_id: {r: n.has(r) - taken.get(n.node_id, {}).get(r, 0.0) for r in needs} for n in nodes}
    placed = []
    for i in range(c.servers):
        node = next((n for n in nodes if all(left[n.node_id][r] >= amount for r, amount in needs.items())), None)
        if node is None:
            raise ClusterError(f"inference server {i + 1} of cluster.servers = {c.servers} does not fit beside the "
                               f"learner ranks: no node has {c.server_gpus} GPU and {c.server_cpus:g} CPU left "
                               "(cluster.server_gpus, cluster.server_cpus)")
        for r, amount in needs.items():
            left[node.node_id][r] -= amount
        placed.append(node)
    return placed


LAUNCH_SERVE_PORT = 30000
"""`arpo launch`: the first inference server's port when serve.port is 0 (server i listens on it + i)."""
LAUNCH_LEARNER_PORT = 5555
"""`arpo launch`: the learner's port when transport.endpoint's is 0 (a free one is `arpo run`'s rule only)."""


def fill_addresses(config: RunConfig, learner_ip: str, servers: Sequence[tuple[str, int]]) -> RunConfig:
    """The run file every placed process reads: the learner's endpoint on rank 0's node (the port of
    transport.endpoint, LAUNCH_LEARNER_PORT for 0), the inference URLs (``http://IP:PORT`` per server),
    learner.sync_host (where servers reach rank 0 for a distributed weight sync) and run_id, resolved once so every
    node labels alike.

    Raises:
        ClusterError: transport.endpoint is not tcp:// (ipc:// reaches no other node).
    """
    scheme, _, rest = config.transport.endpoint.partition("://")
    if scheme != "tcp":
        raise ClusterError(f"transport.endpoint = {config.transport.endpoint!r}: `arpo launch` needs tcp://HOST:PORT "
                           "(actors on other nodes connect to it)")
    port = rest.rpartition(":")[2]
    port = str(LAUNCH_LEARNER_PORT) if port in ("0", "*") else port  # a free port of rank 0's node is not known here
    return dataclasses.replace(
        config, run_id=config.resolved_run_id,
        transport=dataclasses.replace(config.transport, endpoint=f"tcp://{learner_ip}:{port}"),
        learner=dataclasses.replace(config.learner, sync_host=learner_ip),
        actors=dataclasses.replace(config.actors, inference_urls=tuple(f"http://{ip}:{p}" for ip, p in servers)))


def check_desktop_images(missing: Sequence[str], image: str) -> None:
    """``missing``: the desktop nodes whose Docker engine does not hold ``image`` (or does not answer).

    Raises:
        ClusterError: some do (naming the key actors.image and the nodes).
    """
    if missing:
        raise ClusterError(f"the desktop image {image} (actors.image) is not on {', '.join(missing)}: run "
                           "`arpo desktop build` on each desktop host (with its Docker engine running) first")
