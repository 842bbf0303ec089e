"""Issue 48 item 2: the weight and control routes of arpo-serve belong to the learner alone.

Real arpo-serve processes, real HTTP, the real DistributedPublisher over real gloo groups. A client holding the
generate key (``--api-key``) and not the admin key (``--admin-api-key``, SGLang's name) tries every weight and
control route while the learner publishes; without an admin key (the generate key opens everything, as on
b190f2c) the rid-based ownership still keeps it from ending, using or learning the learner's session and groups,
and its joins to a silent address do not hold up the learner's own join.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys

import aiohttp
import pytest

from arpo_async.config import LearnerConfig
from arpo_async.inference_client import PolicyClient, RetryPolicy
from arpo_async.model.init_model import create_tiny_model
from arpo_async.sglang_engine import SGLangEngine
from learner.train.publisher import DistributedPublisher
from learner.train.trainer import Trainer
from tests.support import ServeProcess, free_port, read_until, stop_process, until

GENERATE_KEY = "generate-key-7f3a"
ADMIN_KEY = "admin-key-c91e"
OWNER = "arpo-learner-run-secret-41"
"""The learner's rid in these tests: no refusal may show it (nor any part of it) to another client."""
RETRY = RetryPolicy(attempts=1, request_timeout_s=60.0, admin_timeout_s=60.0)
TOKEN = 100


@pytest.fixture
def trainer(tmp_path) -> Trainer:
    """A trainer of a tiny random policy (its weights are what the publisher sends; the server serves the same)."""
    return Trainer(create_tiny_model(tmp_path / "policy", seed=0), LearnerConfig(lr=1e-2))


def serve(tmp_path, *args: str) -> ServeProcess:
    server = ServeProcess(tmp_path / "policy", free_port(), tmp_path, args=args)
    server.start()
    return server


@pytest.fixture(scope="module")
def admin_server(tmp_path_factory):
    """One arpo-serve with the generate key and an admin key, shared by the two tests that use both keys (the
    first leaves it as it found it: every hostile request refused, the learner's session ended, generation
    resumed); its policy has the trainer's initial weights (the same seed)."""
    folder = tmp_path_factory.mktemp("admin-keys")
    create_tiny_model(folder / "policy", seed=0)
    server = serve(folder, "--api-key", GENERATE_KEY, "--admin-api-key", ADMIN_KEY)
    try:
        yield server
    finally:
        server.stop()


def hostile_requests(group: str) -> list[tuple[str, str, dict | None]]:
    """(method, route, body) of every weight and control route, as a client that wants to end, open, squat, pause,
    re-version, flush, abort, check or join would send them (``group``: the learner's group name, as if guessed)."""
    join = {"master_address": "127.0.0.1", "master_port": 9, "rank_offset": 1, "world_size": 2,
            "group_name": "hostile", "backend": "gloo"}
    bucket = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1]], "group_name": group}
    return [("POST", "/end_weight_update", {}), ("POST", "/end_weight_update", {"rid": "guess"}),
            ("POST", "/begin_weight_update", {"selector": "all"}),
            ("POST", "/begin_weight_update", {"selector": "all", "rid": "squatter"}),
            ("POST", "/update_weights_from_distributed", bucket),
            ("POST", "/update_weights_from_distributed", {**bucket, "rid": "guess"}),
            ("POST", "/init_weights_update_group", join),
            ("POST", "/destroy_weights_update_group", {"group_name": group}),
            ("POST", "/update_weight_version", {"new_version": "666"}),
            ("POST", "/update_weights_from_disk", {"model_path": "/tmp", "weight_version": "666"}),
            ("POST", "/pause_generation", {"mode": "abort"}), ("POST", "/continue_generation", {}),
            ("GET", "/flush_cache", None), ("POST", "/flush_cache", {}),
            ("POST", "/abort_request", {"abort_all": True}),
            ("GET", "/weights_checker", None), ("POST", "/weights_checker", {"action": "checksum"})]


async def send(session: aiohttp.ClientSession, url: str, method: str, route: str, body: dict | None,
               key: str | None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    async with session.request(method, url + route, json=body, headers=headers) as resp:
        return resp.status, await resp.text()


async def generate(session: aiohttp.ClientSession, url: str, key: str) -> tuple[int, dict]:
    async with session.post(f"{url}/generate", headers={"Authorization": f"Bearer {key}"},
                            json={"input_ids": [TOKEN] * 4, "sampling_params": {"max_new_tokens": 2}}) as resp:
        return resp.status, await resp.json()


async def test_the_generate_key_opens_no_weight_or_control_route(admin_server):
    """With --admin-api-key set, the generate key (and no key, and a wrong key) gets 401 on every weight and control
    route, naming no session id or group; the learner's session and groups stay its own; /generate keeps taking
    the generate key only, and the server was neither paused nor re-versioned."""
    server = admin_server  # the module's: admin_server stops it
    async with PolicyClient([server.url], retry=RETRY, api_key=GENERATE_KEY, admin_api_key=ADMIN_KEY) as client:
        learner = SGLangEngine(client, server.url, owner=OWNER)
        assert (await learner.begin_weight_update()).ok  # a publication is under way: there is a rid to steal
        answers = []
        async with aiohttp.ClientSession() as s:
            for key in (GENERATE_KEY, None, "wrong"):
                for method, route, body in hostile_requests("arpo-weights-0-guess"):
                    answers.append((route, key, *await send(s, server.url, method, route, body, key)))
            assert len(answers) == 51
            assert [(route, key, status) for route, key, status, _ in answers if status != 401] == []
            assert not [text for *_, text in answers if "run-secret" in text or "arpo-weights" in text]
            assert all("admin API key" in text for *_, text in answers)
            # /generate: the generate key, not the admin key (SGLang: admin routes and normal routes apart)
            assert (await generate(s, server.url, ADMIN_KEY))[0] == 401
            status, out = await generate(s, server.url, GENERATE_KEY)
            assert status == 200 and out["meta_info"]["weight_version"] == "0", out
        info = await learner.server_info()
        assert info["weight_version"] == "0" and info["internal_states"][0]["paused"] is False
        assert (await learner.end_weight_update()).ok  # the session stayed the learner's
        assert (await learner.pause()).ok and (await learner.resume()).ok


async def hostile_loop(url: str, key: str, stop: asyncio.Event, statuses: list[int]) -> None:
    """Until ``stop``: every hostile request in turn with ``key`` (the generate key); records each status."""
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            for method, route, body in hostile_requests("arpo-weights-0"):
                if route == "/init_weights_update_group":
                    continue  # a join to port 9 fails at once; the join test sends silent ones
                statuses.append((await send(s, url, method, route, body, key))[0])


async def test_the_learners_publication_goes_through_while_a_generate_key_client_attacks(trainer, admin_server,
                                                                                         caplog):
    """The learner publishes twice (admin key, its own rid) while a client with the generate key loops over every
    weight and control route: both publications go through and check out, every hostile request got 401."""
    server = admin_server
    stop, statuses = asyncio.Event(), []
    try:
        async with PolicyClient([server.url], retry=RETRY, api_key=GENERATE_KEY, admin_api_key=ADMIN_KEY) as client:
            attack = asyncio.create_task(hostile_loop(server.url, GENERATE_KEY, stop, statuses))
            publisher = DistributedPublisher([SGLangEngine(client, server.url, owner=OWNER)], timeout_s=60.0,
                                             verify_every=1)
            with caplog.at_level(logging.WARNING, logger="arpo.learner.publish"):
                for version in (1, 2):
                    await publisher.publish_from(trainer, version)
            stop.set()
            await attack
            assert (publisher.failures, publisher.verified) == (0, 2), caplog.text
            assert (await client.get_json(f"{server.url}/get_model_info"))["weight_version"] == "2"
            assert len(statuses) >= 16 and set(statuses) == {401}, statuses
    finally:
        stop.set()


async def test_without_an_admin_key_no_refusal_names_the_learners_session_or_group(trainer, tmp_path):
    """With the generate key only (every route takes it, as SGLang's ADMIN_OPTIONAL routes do without an admin
    key), the rid still guards the learner's session and groups: another client cannot end or use the session, nor
    re-version or reload the weights during it, nor destroy or use the learner's group, and no refusal names the
    learner's rid or group (on b190f2c the end refusal named the rid and the update refusal listed the groups)."""
    server = serve(tmp_path, "--api-key", GENERATE_KEY)
    try:
        async with PolicyClient([server.url], retry=RETRY, api_key=GENERATE_KEY) as client:
            publisher = DistributedPublisher([SGLangEngine(client, server.url, owner=OWNER)], timeout_s=60.0)
            await publisher.publish_from(trainer, 1)  # the learner's group now exists on the server
            [group] = [g.name for g in publisher._groups.values()]
            learner = SGLangEngine(client, server.url, owner=OWNER)
            assert (await learner.begin_weight_update()).ok
            refused = []
            async with aiohttp.ClientSession() as s:
                for rid in (None, "guess", ""):
                    rid_field = {} if rid is None else {"rid": rid}
                    for route, body in (
                            ("/end_weight_update", {}),
                            ("/update_weights_from_distributed", {"names": ["lm_head.weight"], "dtypes": ["float32"],
                                                                  "shapes": [[1]], "group_name": group}),
                            ("/update_weights_from_distributed", {"names": ["lm_head.weight"], "dtypes": ["float32"],
                                                                  "shapes": [[1]], "group_name": "nope"}),
                            ("/update_weight_version", {"new_version": "666"}),
                            ("/update_weights_from_disk", {"model_path": str(tmp_path / "policy")}),
                            ("/begin_weight_update", {"selector": "all"}),
                            ("/destroy_weights_update_group", {"group_name": group})):
                        refused.append((route, *await send(s, server.url, "POST", route, {**body, **rid_field},
                                                           GENERATE_KEY)))
            assert len(refused) == 21 and {status for _, status, _ in refused} == {400}, refused
            assert not [text for *_, text in refused if "run-secret" in text or group in text or "arpo-weights"
                        in text], refused
            assert (await learner.end_weight_update()).ok  # still the learner's session
            assert (await learner.model_info())["weight_version"] == "1"
            await publisher.publish_from(trainer, 2)  # and its group is still there and its own
            assert publisher.failures == 0 and (await learner.model_info())["weight_version"] == "2"
    finally:
        server.stop()


async def test_joins_of_other_clients_to_a_silent_address_do_not_hold_up_the_learners_join(trainer, tmp_path):
    """Another client (generate key only, no admin key set) fills the server's joins with joins to an address that
    takes the connection and never answers (each would wait 120 s): from one client, from several rids, up to the
    server's cap. The learner's own join is admitted at once and its publication goes through while they still
    wait (on b190f2c two such joins made the learner's join refused, which stops the learner)."""
    from arpo_serve.weight_routes import JOINS_AT_ONCE, JOINS_PER_CLIENT
    silent = await asyncio.start_server(lambda r, w: asyncio.sleep(3600), "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    server = serve(tmp_path, "--api-key", GENERATE_KEY)
    joins: list[asyncio.Task] = []
    try:
        async with PolicyClient([server.url], retry=RETRY, api_key=GENERATE_KEY) as client, \
                aiohttp.ClientSession() as s:
            publisher = DistributedPublisher([SGLangEngine(client, server.url, owner=OWNER)], timeout_s=60.0)
            await publisher.publish_from(trainer, 1)  # the learner has opened a session here before
            for leftover in list(publisher._groups):
                publisher._drop(leftover)  # its next publication joins a new group (as after a failed one)

            def join(i: int, rid: str | None) -> asyncio.Task:
                body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                        "group_name": f"hostile-{i}", "backend": "gloo", **({"rid": rid} if rid else {})}
                return asyncio.create_task(send(s, server.url, "POST", "/init_weights_update_group", body,
                                                GENERATE_KEY))

            rids = [None] + [f"hostile-{k}" for k in range(JOINS_AT_ONCE // JOINS_PER_CLIENT + 1)]
            joins += [join(i, rid) for i, rid in enumerate(rids * (JOINS_PER_CLIENT + 1))]
            total = len(joins)

            await until(lambda: sum(t.done() for t in joins) >= total - JOINS_AT_ONCE, 60, "the extra joins refused")
            answers = [t.result() for t in joins if t.done()]
            assert len(answers) == total - JOINS_AT_ONCE and {status for status, _ in answers} == {503}, answers
            await publisher.publish_from(trainer, 2)
            assert publisher.failures == 0 and (await client.get_json(f"{server.url}/get_model_info"))[
                "weight_version"] == "2"
            assert sum(not t.done() for t in joins) == JOINS_AT_ONCE  # they still wait for their silent master
    finally:
        for task in joins:
            task.cancel()
        await asyncio.gather(*joins, return_exceptions=True)
        server.stop()
        silent.close()


async def test_a_squatted_session_is_closed_by_the_next_begin_once_idle(tmp_path):
    """Without an admin key, a client that opens a session first and never ends it blocks the learner's begins only
    until the session has been idle for SESSION_IDLE_S (here set to 1 s in a real arpo-serve process): then the
    learner's begin closes it and opens its own; the squatter can no longer end it."""
    create_tiny_model(tmp_path / "policy", seed=0)
    port = free_port()
    code = ("import sys, arpo_serve.weight_routes as w; w.SESSION_IDLE_S = 1.0; from arpo_serve.main import main; "
            "sys.exit(main(sys.argv[1:]))")
    with open(tmp_path / "serve.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", code, "--model", str(tmp_path / "policy"), "--port", str(port)],
                                stdout=subprocess.PIPE, stderr=log)
    try:
        assert read_until(proc, b"arpo-serve ready", 180)[0], (tmp_path / "serve.log").read_text()
        url = f"http://127.0.0.1:{port}"
        async with PolicyClient([url], retry=RETRY) as client:
            squatter, learner = SGLangEngine(client, url, owner="squatter"), SGLangEngine(client, url, owner=OWNER)
            assert (await squatter.begin_weight_update()).ok
            first = await learner.begin_weight_update()
            assert not first.ok and "squatter" not in first.message
            await until(lambda: learner.begin_weight_update(), 60, "the idle session to be closed",
                        ok=lambda reply: reply.ok, every_s=0.2)
            assert not (await squatter.end_weight_update()).ok and (await learner.end_weight_update()).ok
        assert "closing a weight-update session idle for" in (tmp_path / "serve.log").read_text()
    finally:
        stop_process(proc, 30.0)
