"""Weight sync over a process group with real arpo-serve processes (learner.weight_sync = "distributed").

One server gets the trained weights from disk, the other over a gloo weight group; both then score the same
reply with bit-identical log-probs. A server SIGKILLed while the buckets stream in is skipped without
stopping the learner, and once restarted it gets the whole current weights over a new group.
"""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import aiohttp
from aiohttp import web
import pytest

from arpo_async.config import LearnerConfig
from arpo_async.inference_client import PolicyClient, RetryPolicy
from arpo_async.model.init_model import create_tiny_model
from arpo_async.model.inputs import PromptEncoder
from arpo_async.sglang_engine import SGLangEngine, sglang_engines
from learner.train.publisher import (DistributedPublisher, WeightPublisher, WeightsMismatch, servers_behind,
                                     verify_server)
from learner.train.trainer import Trainer
from tests.rank_driver import batch, screenshot
from tests.support import ServeProcess, free_port, start_http, until


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("sync") / "policy", seed=0)


async def scored(url: str, model_dir: Path) -> tuple[list[float], str]:
    """The server's log-probs of a fixed greedy reply to a fixed prompt, and its weight version."""
    encoder = PromptEncoder(model_dir)
    ids = encoder.encode([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Click red."}]}],
                         [(320, 180)])
    body = {"input_ids": ids, "image_data": [base64.b64encode(screenshot("red")).decode()], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/generate", json=body) as resp:
            assert resp.status == 200
            out = await resp.json()
    return [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]], out["meta_info"]["weight_version"]


async def test_distributed_sync_matches_disk_and_survives_a_server_killed_mid_sync(model_dir, tmp_path):
    trainer = Trainer(model_dir, LearnerConfig(lr=1e-2))
    trainer.train_step(batch(model_dir, 0))
    disk_server = ServeProcess(model_dir, free_port(), tmp_path)
    net_server = ServeProcess(model_dir, free_port(), tmp_path)
    retry = RetryPolicy(attempts=2, request_timeout_s=30.0, admin_timeout_s=30.0)
    try:
        disk_server.start()  # inside the try: a server that fails to start never leaves the other running
        net_server.start()
        async with PolicyClient([disk_server.url, net_server.url], retry=retry) as client:
            before, _ = await scored(net_server.url, model_dir)
            disk = WeightPublisher([SGLangEngine(client, disk_server.url)], tmp_path / "weights")
            net = DistributedPublisher([SGLangEngine(client, net_server.url)], bucket_mb=0.05, timeout_s=20.0)
            await disk.publish_from(trainer, 1)
            await net.publish_from(trainer, 1)
            assert net.failures == 0
            via_disk, version_disk = await scored(disk_server.url, model_dir)
            via_group, version_group = await scored(net_server.url, model_dir)
            assert version_disk == version_group == "1"
            assert via_group == via_disk  # bit-identical weights
            assert via_group != before  # and they are the trained ones

            # version 2: SIGKILL the server once its first bucket is in; the learner skips it and goes on
            trainer.train_step(batch(model_dir, 1))
            log = net_server.log_dir / f"serve-{net_server.port}-{net_server.starts}.log"
            slow = DistributedPublisher([SGLangEngine(client, net_server.url)], bucket_mb=0.001, timeout_s=20.0)
            slow._groups = net._groups  # the same learner: its group to this server exists already
            syncing = asyncio.create_task(slow.publish_from(trainer, 2))
            await until(lambda: "weight bucket of" in log.read_text(errors="replace"), 60,
                        f"'weight bucket of' in {log}", every_s=0.01)
            net_server.proc.kill()
            async with asyncio.timeout(60):
                await syncing  # returns: a dead server never stops the learner
            assert slow.failures == 1
            net_server.proc.wait()
            net_server.proc.stdout.close()
            net_server.proc = None

            net_server.start()  # back, with the initial weights (version 0)
            assert (await scored(net_server.url, model_dir))[1] == "0"
            await disk.publish_from(trainer, 2)
            await slow.publish_from(trainer, 2)  # a new group, the whole weights
            assert slow.failures == 1
            via_disk, version_disk = await scored(disk_server.url, model_dir)
            via_group, version_group = await scored(net_server.url, model_dir)
            assert version_disk == version_group == "2"
            assert via_group == via_disk
    finally:
        disk_server.stop()
        net_server.stop()


async def test_a_restarted_server_is_caught_up_to_the_current_version(model_dir, tmp_path):
    """A server restarted after a publication serves the base weights as version 0; catch_up sends it the current
    weights (disk: the current folder; distributed: over a new group), skips a server that is down without raising,
    a publication skips it too, and a current server is left alone (learner.resync_interval_s; issue 27: a run with one server would otherwise
    never train again, its rollouts too stale). With checksums verified after every publication (verify_every=1),
    a server down through a publication is skipped by the check as well (issue 39 item 4: it stopped the learner)."""
    trainer = Trainer(model_dir, LearnerConfig(lr=1e-2))
    trainer.train_step(batch(model_dir, 0))
    disk_server = ServeProcess(model_dir, free_port(), tmp_path)
    net_server = ServeProcess(model_dir, free_port(), tmp_path)
    urls = [disk_server.url, net_server.url]
    retry = RetryPolicy(attempts=2, request_timeout_s=30.0, admin_timeout_s=30.0)
    try:
        disk_server.start()
        net_server.start()
        async with PolicyClient(urls, retry=retry) as client:
            disk = WeightPublisher([SGLangEngine(client, disk_server.url)], tmp_path / "weights", verify_every=1)
            net = DistributedPublisher([SGLangEngine(client, net_server.url)], bucket_mb=0.05, timeout_s=20.0,
                                       verify_every=1)
            await disk.publish_from(trainer, 1)
            await net.publish_from(trainer, 1)
            assert disk.verified == 1 and net.verified == 1
            trained, version = await scored(disk_server.url, model_dir)
            assert version == "1"
            assert await servers_behind(sglang_engines(client), 1) == []
            assert await disk.catch_up(trainer, 1) == [] and await net.catch_up(trainer, 1) == []

            for server in (disk_server, net_server):
                server.stop()
            assert await disk.catch_up(trainer, 1) == [] and await net.catch_up(trainer, 1) == []  # down: skipped
            trainer.train_step(batch(model_dir, 1))
            await disk.publish_from(trainer, 2)  # a server down through a publication is skipped, not fatal
            await net.publish_from(trainer, 2)
            assert disk.failures == 1 and net.failures == 1
            assert disk.verified == 1 and net.verified == 1  # nothing to check on a server that is down
            for server in (disk_server, net_server):
                server.start()  # back with the base weights
            assert [v for _, v in [await scored(u, model_dir) for u in urls]] == ["0", "0"]
            assert [e.url for e in await servers_behind(sglang_engines(client), 2)] == urls
            assert await disk.catch_up(trainer, 2) == [disk_server.url]
            assert await net.catch_up(trainer, 2) == [net_server.url]
            via_disk, via_group = await scored(disk_server.url, model_dir), await scored(net_server.url, model_dir)
            assert via_disk == via_group and via_disk[1] == "2" and via_disk[0] != trained
            assert await servers_behind(sglang_engines(client), 2) == [] and net.failures == 1
    finally:
        disk_server.stop()
        net_server.stop()


async def test_weight_group_requests_are_checked(model_dir, tmp_path):
    server = ServeProcess(model_dir, free_port(), tmp_path)
    server.start()
    try:
        async with aiohttp.ClientSession() as session:
            async def post(path: str, body: dict) -> tuple[int, dict]:
                async with session.post(f"{server.url}{path}", json=body) as resp:
                    return resp.status, await resp.json()

            init = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
                    "group_name": "g"}
            status, body = await post("/init_weights_update_group", {**init, "backend": "nccl"})
            assert status == 400 and body["success"] is False
            assert "runs on cpu and joins weight groups with gloo" in body["message"]
            status, body = await post("/init_weights_update_group", {**init, "backend": "gloo", "rank_offset": 0})
            assert status == 400 and "rank_offset" in body["error"]["message"]
            update = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[4, 4]], "group_name": "none"}
            status, body = await post("/update_weights_from_distributed", update)  # SGLang 0.5.23: no session
            assert status == 400 and body["success"] is False and "begin_weight_update" in body["message"]
            status, body = await post("/end_weight_update", {})
            assert status == 400 and body["success"] is False and "no weight-update session" in body["message"]
            assert (await post("/begin_weight_update", {"selector": "all"})) == (200, {"success": True,
                                                                                    "message": "Success"})
            status, body = await post("/begin_weight_update", {"selector": "all"})
            assert status == 400 and body["success"] is False and "already open" in body["message"]
            status, body = await post("/update_weights_from_distributed", update)
            assert status == 400 and body["success"] is False and "init_weights_update_group" in body["message"]
            status, body = await post("/update_weights_from_distributed", {**update, "load_format": "direct"})
            assert status == 400 and "load_format" in body["error"]["message"]
            assert (await post("/end_weight_update", {}))[0] == 200
            status, body = await post("/update_weights_from_distributed", {
                "names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g"})
            assert status == 400 and "equal length" in body["error"]["message"]
    finally:
        server.stop()


def test_nccl_sync_without_cuda_names_the_key():
    import torch

    from arpo_async.config import ConfigError, load_config
    from learner.main import sync_backend

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    lc = load_config(None, ['learner.weight_sync="distributed"', 'learner.sync_backend="nccl"']).learner
    with pytest.raises(ConfigError, match="learner.sync_backend"):
        sync_backend(lc)
    assert sync_backend(load_config(None, ['learner.weight_sync="distributed"']).learner) == "gloo"


class ModuleNamed:
    """A trainer that publishes transformers' module names (``model.language_model...``), as the learner did
    before it sent checkpoint names: SGLang 0.5.23 cannot load them, so arpo-serve must refuse them."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.model, self.model_dir = trainer.model, trainer.model_dir

    def checkpoint_state_dict(self) -> dict:
        return self.trainer.full_state_dict()


async def test_flattened_buckets_checksums_and_refused_names(model_dir, tmp_path):
    trainer = Trainer(model_dir, LearnerConfig(lr=1e-2))
    trainer.train_step(batch(model_dir, 0))
    server = ServeProcess(model_dir, free_port(), tmp_path)
    server.start()
    retry = RetryPolicy(attempts=2, request_timeout_s=30.0, admin_timeout_s=30.0)
    try:
        async with PolicyClient([server.url], retry=retry) as client:
            engine = SGLangEngine(client, server.url)
            initial = (await engine.weights_checksums()).checksums
            assert set(initial) == set(trainer.checkpoint_state_dict())  # checkpoint names, every weight

            flat = DistributedPublisher([SGLangEngine(client, server.url)], bucket_mb=0.05, timeout_s=20.0,
                                        load_format="flattened_bucket", verify_every=1)
            await flat.publish_from(trainer, 1)
            assert (flat.failures, flat.verified) == (0, 1)
            published = (await engine.weights_checksums()).checksums
            assert published != initial
            assert (await scored(server.url, model_dir))[1] == "1"

            # module names are refused and nothing of them is loaded; the server is resumed (issue 39 item 5) and
            # marked for the whole weights, which the next publication (first closing the session left open) sends
            trainer.train_step(batch(model_dir, 1))
            refused = DistributedPublisher([SGLangEngine(client, server.url)], bucket_mb=0.05, timeout_s=20.0)
            await refused.publish_from(ModuleNamed(trainer), 2)
            assert refused.failures == 1
            assert (await engine.weights_checksums()).checksums == published
            info = await engine.server_info()
            assert info["internal_states"][0]["paused"] is False and info["weight_version"] == "1"
            assert list(refused.partial) == [server.url] and not refused.paused
            await flat.publish_from(trainer, 2)
            assert (flat.failures, flat.verified) == (0, 2)
            assert (await scored(server.url, model_dir))[1] == "2"

            # a server whose weights differ from the learner's stops the learner, naming the server
            tampered = trainer.checkpoint_state_dict()
            name = next(iter(tampered))
            tampered[name] = tampered[name] + 1.0
            with pytest.raises(WeightsMismatch, match=f"{server.url}.*{name}"):
                await verify_server(engine, tampered, trainer)
    finally:
        server.stop()


def test_weight_group_names_are_single_use_as_in_torch():
    """Both ends build groups with SGLang's init_custom_process_group; torch refuses a group name twice in one
    process, so the publisher names each new group afresh and destroys the old one."""
    from arpo_async.weight_sync import WeightGroup, WeightGroupError

    group = WeightGroup.join("127.0.0.1", free_port(), 0, 1, "single-use", 20.0)
    with pytest.raises(WeightGroupError, match="single-use"):
        WeightGroup.join("127.0.0.1", free_port(), 0, 1, "single-use", 5.0)
    group.destroy()
    WeightGroup.join("127.0.0.1", free_port(), 0, 1, "single-use", 5.0).destroy()


async def test_a_bf16_server_gets_bf16_weights_both_ways_half_the_bytes(model_dir, tmp_path):
    """learner.publish_dtype = "served": arpo-serve holding bf16 weights (--dtype bfloat16, as SGLang's --dtype)
    gets a bf16 folder from disk and bf16 tensors over the weight group: half the bytes of the float32 master
    weights, the checksums still agree (verify_every=1), and both servers then score alike. "float32" sends the
    master weights; the server casts them and serves the very same weights."""
    from learner.train.publish_dtype import PublishDtypes, tensor_bytes

    trainer = Trainer(model_dir, LearnerConfig(lr=1e-2))
    trainer.train_step(batch(model_dir, 0))
    master = tensor_bytes(trainer.checkpoint_state_dict())
    floats = sum(t.numel() for t in trainer.checkpoint_state_dict().values() if t.is_floating_point())
    disk_server = ServeProcess(model_dir, free_port(), tmp_path, args=("--dtype", "bfloat16"))
    net_server = ServeProcess(model_dir, free_port(), tmp_path, args=("--dtype", "bfloat16"))
    try:
        disk_server.start()
        net_server.start()
        async with PolicyClient([disk_server.url, net_server.url]) as client:
            disk_engine, net_engine = SGLangEngine(client, disk_server.url), SGLangEngine(client, net_server.url)
            assert await disk_engine.served_dtype() == "bfloat16"
            disk = WeightPublisher([disk_engine], tmp_path / "weights", verify_every=1)
            net = DistributedPublisher([net_engine], bucket_mb=0.05, timeout_s=20.0, verify_every=1)
            await disk.publish_from(trainer, 1)  # verify_every=1: WeightsMismatch unless the server holds them
            await net.publish_from(trainer, 1)
            assert (disk.verified, net.verified, net.failures) == (1, 1, 0)
            assert net.bytes_published == master - 2 * floats  # every float tensor in 2 bytes instead of 4
            assert disk.bytes_published < master * 0.55
            raw = (disk.folder(1) / "model.safetensors").read_bytes()  # 8-byte header length, then the JSON header
            header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
            assert {entry["dtype"] for name, entry in header.items() if name != "__metadata__"} == {"BF16"}
            via_disk, _ = await scored(disk_server.url, model_dir)
            via_group, _ = await scored(net_server.url, model_dir)
            assert via_disk == via_group

            # "float32": the master weights go out as they are; the bf16 server casts them to the same weights
            trainer.train_step(batch(model_dir, 1))
            as_trained = DistributedPublisher([net_engine], bucket_mb=0.05, timeout_s=20.0, verify_every=1,
                                              dtypes=PublishDtypes(served=False))
            as_trained._groups = net._groups  # the same learner: its group to this server exists already
            await as_trained.publish_from(trainer, 2)
            await disk.publish_from(trainer, 2)
            assert as_trained.bytes_published == master and as_trained.verified == 1
            assert (await scored(net_server.url, model_dir))[0] == (await scored(disk_server.url, model_dir))[0]
    finally:
        disk_server.stop()
        net_server.stop()


async def test_a_server_with_bad_or_slow_answers_is_skipped_by_the_resync_and_the_others_are_caught_up(
        model_dir, tmp_path, caplog):
    """Issue 39 item 3: servers answering /get_model_info with a weight_version of Infinity or 1e400, a /health or
    /get_model_info body that is not UTF-8, or an answer that takes minutes, are each skipped for the round with
    one warning, within the check's bound, while a real arpo-serve that is behind is found and caught up."""
    hostile = {
        "infinity": (b'{"weight_version": Infinity}', 0),
        "huge": (b'{"weight_version": 1e400}', 0),
        "string-huge": (b'{"weight_version": "' + b"9" * 31 + b'"}', 0),
        "not-utf8-info": (b'{"weight_version": "\xff\xfe"}', 0),
        "not-utf8-health": (b"\xff\xfe\xfd", 0),
        "slow": (b'{"weight_version": "0"}', 120),
    }

    async def answer(request: web.Request) -> web.Response:
        body, delay = hostile[request.match_info["kind"]]
        if delay:
            await asyncio.sleep(delay)
        if request.match_info["route"] == "health" and request.match_info["kind"] != "not-utf8-health":
            return web.Response(body=b"")
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/{kind}/{route}", answer)
    runner, base = await start_http(app)
    server = ServeProcess(model_dir, free_port(), tmp_path)
    trainer = Trainer(model_dir, LearnerConfig(lr=1e-2))
    trainer.train_step(batch(model_dir, 0))
    try:
        server.start()
        bad_urls = [f"{base}/{kind}" for kind in hostile]
        retry = RetryPolicy(attempts=6, request_timeout_s=600.0, admin_timeout_s=600.0)
        async with PolicyClient([server.url, *bad_urls], retry=retry) as client:
            engines = sglang_engines(client)
            publisher = WeightPublisher(engines[:1], tmp_path / "weights")
            await publisher.publish_from(trainer, 1)
            server.stop()
            server.start()  # back with the base weights: behind
            started = asyncio.get_running_loop().time()
            # the check's bound (3 s) ends the slow one before /health's own 5 s timeout would (a silent "down")
            behind = await servers_behind(engines, 1, timeout_s=3.0)
            assert asyncio.get_running_loop().time() - started < 30  # the slow one was not waited for
            assert [e.url for e in behind] == [server.url]
            assert await publisher.catch_up(trainer, 1, behind) == [server.url]
            assert await servers_behind(engines[:1], 1) == []
        skipped = [r.getMessage() for r in caplog.records if "skipped this round" in r.getMessage()]
        assert sorted(m.split()[4] for m in skipped) == sorted(bad_urls), skipped
    finally:
        server.stop()
        await runner.cleanup()


async def test_a_failed_end_or_resume_never_leaves_a_server_paused_or_half_updated(model_dir, tmp_path):
    """Issue 39 item 5: a real arpo-serve behind a proxy that refuses /end_weight_update (after the last bucket set
    the new version) is resumed anyway and marked as holding part of a version; the next catch-up sends it the
    whole weights although it reports the current version; its failed weight group is destroyed on the server
    (/destroy_weights_update_group, item 8). A /continue_generation that fails is tried again by the next catch-up,
    and the server generates again."""
    server = ServeProcess(model_dir, free_port(), tmp_path)
    refuse: set[str] = set()
    groups: dict[str, list[str]] = {"init_weights_update_group": [], "destroy_weights_update_group": []}

    async def forward(request: web.Request) -> web.Response:
        route = request.match_info["route"]
        if route in groups:
            groups[route].append(json.loads(await request.read())["group_name"])
        if route in refuse:
            if route == "end_weight_update":
                return web.json_response({"success": False, "message": "refused by the test's proxy"}, status=400)
            return web.Response(status=503, text="the test's proxy")
        async with aiohttp.ClientSession() as session, session.request(
                request.method, f"{server.url}/{route}", data=await request.read(),
                headers={"Content-Type": request.content_type}) as resp:
            return web.Response(status=resp.status, body=await resp.read(), content_type=resp.content_type)

    app = web.Application()
    app.router.add_route("*", "/{route:.*}", forward)
    runner, proxy = await start_http(app)
    trainer = Trainer(model_dir, LearnerConfig(lr=1e-2))
    trainer.train_step(batch(model_dir, 0))
    try:
        server.start()
        retry = RetryPolicy(attempts=2, max_delay_s=0.1, request_timeout_s=30.0, admin_timeout_s=30.0)
        async with PolicyClient([proxy], retry=retry) as client:
            [engine] = sglang_engines(client)
            net = DistributedPublisher([engine], bucket_mb=0.05, timeout_s=20.0)
            refuse.add("end_weight_update")
            await net.publish_from(trainer, 1)
            assert net.failures == 1 and list(net.partial) == [proxy] and not net.paused
            assert groups["destroy_weights_update_group"] == groups["init_weights_update_group"]  # left, not kept
            assert (await engine.server_info())["internal_states"][0]["paused"] is False  # resumed all the same
            assert (await asyncio.wait_for(scored(proxy, model_dir), 30))[1] == "1"  # the last bucket set the version
            assert await servers_behind([engine], 1) == [] and await net.behind(1) == [engine]
            refuse.clear()
            assert await net.catch_up(trainer, 1) == [proxy] and not net.partial
            refuse.add("continue_generation")
            trainer.train_step(batch(model_dir, 1))
            await net.publish_from(trainer, 2)
            assert list(net.paused) == [proxy] and net.failures == 1  # the weights went in; the resume did not
            assert (await engine.server_info())["internal_states"][0]["paused"] is True
            refuse.clear()
            assert await net.catch_up(trainer, 2) == [] and not net.paused
            assert (await engine.server_info())["internal_states"][0]["paused"] is False
            assert (await asyncio.wait_for(scored(server.url, model_dir), 30))[1] == "2"
    finally:
        server.stop()
        await runner.cleanup()
