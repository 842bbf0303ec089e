"""How the distributed publisher meets a server that does not play along: a session left open by a publication cut
short (closed once, then the publication goes through), and a server that says it joined the weight group but
never does (the rendezvous times out; that server is skipped with one log line and the learner goes on)."""

from __future__ import annotations

import logging

import pytest
from aiohttp import web

from arpo_async.config import LearnerConfig
from arpo_async.inference_client import PolicyClient, RetryPolicy
from arpo_async.model.init_model import create_tiny_model
from arpo_async.sglang_engine import SGLangEngine
from learner.train.publisher import DistributedPublisher
from learner.train.trainer import Trainer
from tests.support import ServeProcess, catch_all_http_server, free_port

RETRY = RetryPolicy(attempts=1, request_timeout_s=30.0, admin_timeout_s=30.0)


@pytest.fixture
def trainer(tmp_path) -> Trainer:
    """A trainer of a tiny random policy (its weights are what the publisher sends)."""
    return Trainer(create_tiny_model(tmp_path / "policy", seed=0), LearnerConfig(lr=1e-2))


async def publish_once(url: str, trainer: Trainer, caplog) -> DistributedPublisher:
    """One distributed publication of version 1 to the server at ``url`` (a test's own HTTP server), its
    warnings captured; returns the publisher (its ``failures``)."""
    async with PolicyClient([url], retry=RETRY) as client:
        publisher = DistributedPublisher([SGLangEngine(client, url)], timeout_s=3.0)
        with caplog.at_level(logging.WARNING, logger="arpo.learner.publish"):
            await publisher.publish_from(trainer, 1)  # returns: a server never stops the learner
    return publisher


async def test_a_session_left_open_is_closed_once_and_the_publication_goes_through(trainer, tmp_path, caplog):
    server = ServeProcess(tmp_path / "policy", free_port(), tmp_path)  # the trainer fixture's policy
    server.start()
    try:
        async with PolicyClient([server.url], retry=RETRY) as client:
            engine = SGLangEngine(client, server.url)
            assert (await engine.begin_weight_update()).ok  # a learner died here
            publisher = DistributedPublisher([SGLangEngine(client, server.url)], timeout_s=20.0, verify_every=1)
            with caplog.at_level(logging.WARNING, logger="arpo.learner.publish"):
                await publisher.publish_from(trainer, 7)
            assert (publisher.failures, publisher.verified) == (0, 1)
            assert "begin_weight_update refused (a weight-update session is already open" in caplog.text
            info = await engine.server_info()
            assert info["weight_version"] == "7" and info["internal_states"][0]["paused"] is False
            assert not (await engine.end_weight_update()).ok  # the session was closed
    finally:
        server.stop()


async def test_a_session_opened_with_a_rid_is_ended_only_by_that_rid(trainer, tmp_path, caplog):
    """Issue 39 item 8: the learner opens its weight-update sessions with its own ``rid`` (SGLang's request-id
    field); another client holding the same API key cannot end one (400; issue 48 item 2: the refusal names no rid,
    so the other client cannot learn the owner's and end the session with it), so it cannot break a publication;
    the owner's publication, which finds its own session left open, closes it and goes through."""
    server = ServeProcess(tmp_path / "policy", free_port(), tmp_path)
    server.start()
    try:
        async with PolicyClient([server.url], retry=RETRY) as client:
            owner = SGLangEngine(client, server.url, owner="arpo-learner-run-a")
            assert (await owner.begin_weight_update()).ok  # a publication of run a is under way
            for other in (SGLangEngine(client, server.url, owner="arpo-learner-run-b"),
                          SGLangEngine(client, server.url)):
                refused = await other.end_weight_update()
                assert not refused.ok and "opened by another client" in refused.message
                assert "arpo-learner-run-a" not in refused.message and "run-a" not in refused.message
            publisher = DistributedPublisher([owner], timeout_s=20.0)  # the owner restarted: its session is its own
            with caplog.at_level(logging.WARNING, logger="arpo.learner.publish"):
                await publisher.publish_from(trainer, 3)
            assert publisher.failures == 0 and (await owner.server_info())["weight_version"] == "3"
            unowned = SGLangEngine(client, server.url)  # without a rid, as SGLang: anyone may end it
            assert (await unowned.begin_weight_update()).ok and (await owner.end_weight_update()).ok
    finally:
        server.stop()


async def test_a_server_that_never_joins_is_skipped_after_the_rendezvous_timeout(trainer, caplog):
    calls: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        calls.append(request.path)
        if request.path == "/get_server_info":
            return web.json_response({"tp_size": 1})
        if request.path == "/health":
            return web.Response()
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async with catch_all_http_server(answer) as url:
        publisher = await publish_once(url, trainer, caplog)
    assert publisher.failures == 1
    assert "/begin_weight_update" not in calls and "/update_weights_from_distributed" not in calls
    [line] = [r.getMessage() for r in caplog.records if "weight sync of version 1" in r.getMessage()]
    assert url in line and "cannot join weight group" in line


async def test_a_server_reporting_a_nonsense_tp_size_is_skipped_with_a_reason(trainer, caplog):
    calls: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        calls.append(request.path)
        if request.path == "/get_server_info":
            return web.json_response({"tp_size": "eight"})
        return web.Response() if request.path == "/health" else web.json_response({"success": True})

    async with catch_all_http_server(answer) as url:
        publisher = await publish_once(url, trainer, caplog)
    assert publisher.failures == 1 and "/init_weights_update_group" not in calls
    assert any("tp_size 'eight'" in r.getMessage() and url in r.getMessage() for r in caplog.records)
