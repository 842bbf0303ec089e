"""A second (or third) host on one machine: a network namespace joined to the host by a veth pair on a private /30.

Test infrastructure, not product: shared by tests/integration/test_second_host.py and bench/bench_hosts.py (which
imports it from here; no test imports bench/). A process started with
``nsenter --net=/var/run/netns/<ns>`` (:func:`in_namespace`) has only the namespace's loopback and its end of the
link, so everything it sends to the host crosses the veth pair over TCP, as between two machines. Needs root and
iproute2; :class:`NamespaceUnavailable` says which is missing. The namespace (and the veth pair with it) is
deleted on exit.
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager


class NamespaceUnavailable(RuntimeError):
    """Network namespaces cannot be made here (no iproute2, or not root); the message says which."""


@contextmanager
def private_link() -> Iterator[tuple[str, str, str]]:
    """A network namespace and a veth pair: yields (namespace name, host address, namespace address).

    Raises:
        NamespaceUnavailable: ``ip`` is not installed, or a command failed (not root, no netns support); the
            message quotes the failing command and its stderr.
    """
    if shutil.which("ip") is None:
        raise NamespaceUnavailable("iproute2 is not installed")
    tag = uuid.uuid4().hex[:6]
    ns, host_if, ns_if = f"arpo-{tag}", f"vh{tag}", f"vn{tag}"
    octet = int(tag[:2], 16) % 250 + 1
    host_ip, ns_ip = f"10.231.{octet}.1", f"10.231.{octet}.2"
    commands = [["ip", "netns", "add", ns], ["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if],
                ["ip", "link", "set", ns_if, "netns", ns], ["ip", "addr", "add", f"{host_ip}/30", "dev", host_if],
                ["ip", "link", "set", host_if, "up"],
                ["ip", "netns", "exec", ns, "ip", "addr", "add", f"{ns_ip}/30", "dev", ns_if],
                ["ip", "netns", "exec", ns, "ip", "link", "set", ns_if, "up"],
                ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"]]
    try:
        for command in commands:
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise NamespaceUnavailable(f"{' '.join(command)} failed: {done.stderr.strip()[:300]}")
        yield ns, host_ip, ns_ip
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # takes the veth pair with it
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)


def in_namespace(ns: str, argv: list[str]) -> list[str]:
    """``argv`` run inside network namespace ``ns``. nsenter --net, not `ip netns exec`: that also gives the
    process a mount namespace of its own, where the tmpfs a desktop fleet mounts on each desktop's socket folder
    would be invisible to dockerd."""
    return ["nsenter", f"--net=/var/run/netns/{ns}", *argv]
