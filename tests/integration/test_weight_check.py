"""Checking the weights a server serves after a publication (learner.verify_weights_every), with real arpo-serve
processes behind a test proxy (issue 48 item 4).

A server that came back after being down, or cannot check for another reason, answers /weights_checker as SGLang
0.5.23 answers when its checker raises: HTTP 400, {"success": false, "message": <the exception's text>}
(managers/scheduler: ``CheckWeightsReqOutput(success=False, message=f"{e}")``; entrypoints/http_server.py). That is
not a mismatch: the learner sends that server the whole weights again and checks once more. A server restarted
between taking the weights and the check serves the base weights; it is resynced the same way. Only checksums that
still differ after the resync stop the learner (WeightsMismatch), naming the server and the weight.
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest
from aiohttp import web

from arpo_async.config import LearnerConfig
from arpo_async.inference_client import PolicyClient, RetryPolicy
from arpo_async.model.init_model import create_tiny_model
from arpo_async.sglang_engine import SGLangEngine
from learner.train.publisher import DistributedPublisher, WeightPublisher, WeightsMismatch
from learner.train.trainer import Trainer
from tests.integration.test_weight_sync import scored
from tests.rank_driver import batch
from tests.support import ServeProcess, free_port, start_http

CANNOT_CHECK = {"success": False, "message": "CUDA error: an illegal memory access was encountered"}
"""What SGLang 0.5.23's /weights_checker answers (HTTP 400) when its checker raises: the exception's text."""

LOADS = ("update_weights_from_disk", "end_weight_update")
"""The routes after whose success a server holds a whole publication."""


class Proxy:
    """A proxy in front of real arpo-serve processes (``/<name>/<route>`` -> server ``name``), which can restart a
    server before its next /weights_checker (``restart_before_check``: name -> whether it comes back unable to
    check until it has loaded weights), answer /weights_checker as a server that cannot check (``cannot_check``),
    take disk loads without passing them on (the server keeps serving what it had), or change one checksum in the
    answer. ``calls[name]`` lists the routes asked, in order."""

    def __init__(self, servers: dict[str, ServeProcess]) -> None:
        self.servers = servers
        self.restart_before_check: dict[str, bool] = {}
        self.cannot_check: dict[str, str] = {}
        """name -> "until loaded" or "always"."""
        self.swallow_loads: set[str] = set()
        self.flip_checksum: set[str] = set()
        self.calls: dict[str, list[str]] = {name: [] for name in servers}
        self.url = ""
        self._runner = None

    async def start(self) -> None:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{name}/{route:.*}", self.forward)
        self._runner, self.url = await start_http(app)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def at(self, name: str) -> str:
        return f"{self.url}/{name}"

    async def forward(self, request: web.Request) -> web.Response:
        name, route = request.match_info["name"], request.match_info["route"]
        server = self.servers[name]
        self.calls[name].append(route)
        if route == "weights_checker":
            if name in self.restart_before_check:  # down and back: the base weights, version 0
                if self.restart_before_check.pop(name):
                    self.cannot_check[name] = "until loaded"
                await asyncio.to_thread(server.stop)
                await asyncio.to_thread(server.start)
            if name in self.cannot_check:
                return web.json_response(CANNOT_CHECK, status=400)
        if route == "update_weights_from_disk" and name in self.swallow_loads:
            return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                      "num_paused_requests": 0})
        async with aiohttp.ClientSession() as session, session.request(
                request.method, f"{server.url}/{route}", data=await request.read(),
                headers={"Content-Type": request.content_type}) as resp:
            status, body, kind = resp.status, await resp.read(), resp.content_type
        if route in LOADS and status == 200 and self.cannot_check.get(name) == "until loaded":
            del self.cannot_check[name]
        if route == "weights_checker" and status == 200 and name in self.flip_checksum:
            answer = json.loads(body)
            checksums = answer["ranks"][0]["checksums"]
            first = sorted(checksums)[0]
            checksums[first] = ("1" if checksums[first][0] != "1" else "2") + checksums[first][1:]
            body = json.dumps(answer).encode()
        return web.Response(status=status, body=body, content_type=kind)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return create_tiny_model(tmp_path_factory.mktemp("check") / "policy", seed=0)


RETRY = RetryPolicy(attempts=2, max_delay_s=0.1, request_timeout_s=300.0, admin_timeout_s=300.0)
"""Generous: a proxied /weights_checker may wait for a server restart on a loaded machine."""


def verifying_publishers(client, proxy, tmp_path):
    """A disk publisher to the proxy's "disk" server and a distributed one to its "net" server, each checking the
    weights after every publication (learner.verify_weights_every = 1)."""
    disk = WeightPublisher([SGLangEngine(client, proxy.at("disk"))], tmp_path / "weights", verify_every=1)
    net = DistributedPublisher([SGLangEngine(client, proxy.at("net"))], bucket_mb=0.05, timeout_s=60.0,
                               verify_every=1)
    return disk, net


async def test_a_server_that_comes_back_or_cannot_check_is_resynced_and_checked_again(model_dir, tmp_path, caplog):
    """Both publishers, verify_every=1, each to a real arpo-serve behind the proxy:

    1. each server is restarted just before its check and then answers success=false (it cannot check until it
       has loaded weights again): on b190f2c the learner stopped with WeightsMismatch; now it resyncs the server,
       checks again, and the checksums agree;
    2. the disk server is restarted before its check and answers with the base weights' checksums (a real
       difference, from a server that came back): resynced, checked again, they agree; the other server cannot
       check at all: resynced, checked again, skipped with one warning, and the learner goes on.
    Both servers then serve the learner's weights under the current version."""
    caplog.set_level(logging.WARNING, "arpo.learner.publish")
    disk_server = ServeProcess(model_dir, free_port(), tmp_path)
    net_server = ServeProcess(model_dir, free_port(), tmp_path)
    proxy = Proxy({"disk": disk_server, "net": net_server})
    trainer = Trainer(model_dir, LearnerConfig(lr=1e-2))
    trainer.train_step(batch(model_dir, 0))
    try:
        disk_server.start()
        net_server.start()
        await proxy.start()
        async with PolicyClient([proxy.at("disk"), proxy.at("net")], retry=RETRY) as client:
            disk, net = verifying_publishers(client, proxy, tmp_path)

            proxy.restart_before_check.update(disk=True, net=True)  # back unable to check until loaded
            await disk.publish_from(trainer, 1)  # b190f2c: WeightsMismatch (weights_checker answered success=false)
            await net.publish_from(trainer, 1)
            assert (disk.verified, net.verified, disk_server.starts, net_server.starts) == (1, 1, 2, 2)
            for name in ("disk", "net"):  # checked, resynced, checked again
                checks = [i for i, route in enumerate(proxy.calls[name]) if route == "weights_checker"]
                assert len(checks) == 2 and any(r in LOADS for r in proxy.calls[name][checks[0]:checks[1]]), name
            trained = await scored(disk_server.url, model_dir)
            assert trained[1] == "1" and await scored(net_server.url, model_dir) == trained

            trainer.train_step(batch(model_dir, 1))
            proxy.restart_before_check["disk"] = False  # back with the base weights: their checksums differ
            proxy.cannot_check["net"] = "always"
            await disk.publish_from(trainer, 2)
            await net.publish_from(trainer, 2)  # never checked this time; the learner goes on
            assert (disk.verified, net.verified, disk_server.starts, net.failures) == (2, 1, 3, 0)
            assert proxy.calls["net"].count("weights_checker") == 4
            now = await scored(disk_server.url, model_dir)
            assert now[1] == "2" and now != trained and await scored(net_server.url, model_dir) == now
        skipped = [r.getMessage() for r in caplog.records if "even after it was sent the whole weights again"
                   in r.getMessage()]
        assert len(skipped) == 1 and proxy.at("net") in skipped[0] and "version 2" in skipped[0], skipped
    finally:
        disk_server.stop()
        net_server.stop()
        await proxy.stop()


async def test_a_checksum_difference_that_survives_a_resync_stops_the_learner(model_dir, tmp_path):
    """A server that takes disk loads without applying them (it serves the base weights), and one whose reported
    checksums differ in one weight: each is resynced once and checked again, then the learner stops with
    WeightsMismatch naming the server and the weight."""
    disk_server = ServeProcess(model_dir, free_port(), tmp_path)
    net_server = ServeProcess(model_dir, free_port(), tmp_path)
    proxy = Proxy({"disk": disk_server, "net": net_server})
    trainer = Trainer(model_dir, LearnerConfig(lr=1e-2))
    trainer.train_step(batch(model_dir, 0))
    first = sorted(trainer.checkpoint_state_dict())[0]
    try:
        disk_server.start()
        net_server.start()
        await proxy.start()
        async with PolicyClient([proxy.at("disk"), proxy.at("net")], retry=RETRY) as client:
            disk, net = verifying_publishers(client, proxy, tmp_path)
            proxy.swallow_loads.add("disk")
            proxy.flip_checksum.add("net")
            with pytest.raises(WeightsMismatch, match=f"{proxy.at('disk')} weights checksums"):
                await disk.publish_from(trainer, 1)
            with pytest.raises(WeightsMismatch, match=f"{proxy.at('net')} weights checksums: 1 of .*{first}"):
                await net.publish_from(trainer, 1)
            for name in ("disk", "net"):  # the stop came after one resync and a second check
                assert proxy.calls[name].count("weights_checker") == 2, proxy.calls[name]
            assert proxy.calls["disk"].count("update_weights_from_disk") == 2
            assert proxy.calls["net"].count("end_weight_update") == 2
    finally:
        disk_server.stop()
        net_server.stop()
        await proxy.stop()
