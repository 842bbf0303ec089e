"""Actor <-> learner protocol over real ZeroMQ TCP sockets on 127.0.0.1.

Covers: assignments under the staleness rule (requests wait, never fail), acks, de-duplication, a learner
restart (actors notice the new learner id and re-send what they hold), hostile frames (rejected, counted,
the learner keeps serving), and the task pre-pass (its groups are evaluated, never trained on; training then
draws only the valuable tasks).
"""

import asyncio
import collections
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager

import pytest
import zmq
import zmq.asyncio

from actors.link import LearnerLink
from arpo_async import codec
from arpo_async.config import LearnerConfig, TransportConfig
from arpo_async.messages import Hello, Outcome, Reject, Step, Trajectory, WorkRequest
from arpo_async.tasks import Task
from arpo_async.transport import INBOX_SIZE, Outbox, SocketPump, dealer_socket, peer_name, router_socket
from learner.algo.prepass import PREPASS_FILE, plan_tasks
from learner.algo.task_selection import TaskSelector
from learner.rollouts.scheduler import GroupScheduler
from learner.rollouts.service import LearnerService
from learner.rollouts.staleness import StalenessManager
from learner.run import run_prepass
from tests.support import free_port, hello_over, huge_table, trained, until

TASK = Task.from_dict({"id": "grid4-red", "instruction": "click red", "config": [],
                       "evaluator": {"func": "exact_match", "result": {"type": "vm_file", "path": "/r"},
                                     "expected": {"type": "rule", "rules": {"expected": "red"}}}})



@pytest.fixture
def transport() -> TransportConfig:
    return TransportConfig(endpoint=f"tcp://127.0.0.1:{free_port()}", heartbeat_s=0.05, resend_after_s=0.5)


@asynccontextmanager
async def learner(ctx, transport, *, batch=2, eta=0, scheduler=None):
    inbox, outbox = asyncio.Queue(INBOX_SIZE), Outbox(routed=True)
    pump = SocketPump(router_socket(ctx, transport), inbox=inbox, outbox=outbox, max_bytes=transport.max_message_bytes)
    service = LearnerService(outbox, scheduler or GroupScheduler([TASK], group_size=2), StalenessManager(batch, eta))
    tasks = [asyncio.create_task(pump.run()), asyncio.create_task(service.serve(inbox))]
    try:
        yield service
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@asynccontextmanager
async def actor(ctx, transport):
    inbox, outbox = asyncio.Queue(INBOX_SIZE), Outbox(routed=False)
    pump = SocketPump(dealer_socket(ctx, transport, "actor-1"), inbox=inbox, outbox=outbox,
                      max_bytes=transport.max_message_bytes)
    link = LearnerLink(outbox, "actor-1", 4, transport)
    tasks = [asyncio.create_task(pump.run()), asyncio.create_task(link.serve(inbox)),
             asyncio.create_task(link.keepalive())]
    try:
        yield link
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def trajectory(assignment, outcome="SUCCESS", score=1.0) -> Trajectory:
    step = Step([1, 2, 3], [0], [4, 5], [-0.1, -0.2], [0, 0], "Thought: a\nAction: wait()", "wait()")
    return Trajectory(uuid.uuid4().hex, "actor-1/0", assignment.task["id"], assignment.group_id,
                      assignment.rollout_index, outcome, score, True, [step], [b"\x89PNG" * 2000])


async def test_work_flows_and_admission_holds_requests_back(transport):
    ctx = zmq.asyncio.Context()
    try:
        async with learner(ctx, transport, batch=2, eta=0) as service, actor(ctx, transport) as link:
            first = await asyncio.wait_for(link.request_work(), 5)
            second = await asyncio.wait_for(link.request_work(), 5)
            assert first.task["id"] == "grid4-red" and first.group_id == second.group_id
            assert {first.rollout_index, second.rollout_index} == {0, 1}
            third = asyncio.create_task(link.request_work())
            await until(lambda: service.peers.waiting_count == 1)  # (0 + 0 + 1) * 2 rollouts admitted, then wait
            assert not third.done()
            await link.submit(trajectory(first))
            await link.submit(trajectory(second, "FAILURE", 0.0))
            assert await link.wait_acked(5)
            assert service.state.totals["trajectories"] == 2 and service.groups.qsize() == 1  # for the training loop
            await trained(service, 0, 1)
            assignment = await asyncio.wait_for(third, 5)
            assert assignment.policy_version == 1 and link.policy_version == 1
    finally:
        ctx.destroy(linger=0)


async def test_duplicates_are_acked_but_counted_once(transport):
    ctx = zmq.asyncio.Context()
    try:
        async with learner(ctx, transport) as service, actor(ctx, transport) as link:
            assignment = await asyncio.wait_for(link.request_work(), 5)
            traj = trajectory(assignment)
            await link.submit(traj)
            await link.submit(traj)
            assert await link.wait_acked(5)
            await until(lambda: service.state.totals["duplicates"] == 1)
            assert service.state.totals["trajectories"] == 1
    finally:
        ctx.destroy(linger=0)


async def test_learner_restart_gets_held_trajectories_again(transport):
    ctx = zmq.asyncio.Context()
    try:
        async with actor(ctx, transport) as link:
            async with learner(ctx, transport) as old:
                assignment = await asyncio.wait_for(link.request_work(), 5)
                old_id = old.learner_id
            await link.submit(trajectory(assignment))  # the learner is down: held, not lost
            assert link.unacked == 1
            async with learner(ctx, transport) as new:
                await until(lambda: link.learner_id == new.learner_id != old_id)
                assert await link.wait_acked(5)
                await until(lambda: new.state.totals["late"] == 1)  # received, acked; its group was the old learner's
    finally:
        ctx.destroy(linger=0)


async def test_a_trajectory_that_cannot_be_encoded_ends_alone_and_the_actor_goes_on(transport, caplog):
    """Issue 39 item 1: a trajectory msgpack cannot pack (a lone surrogate put in its error after it was built)
    reaches the learner as an ENV_ERROR record of itself, never trained on; one whose record cannot be encoded
    either (a rollout index beyond 64 bits) is dropped; the actor's pump and link go on, and the next trajectory
    is taken as usual."""
    ctx = zmq.asyncio.Context()
    try:
        async with learner(ctx, transport, batch=4) as service, actor(ctx, transport) as link:
            first, second, third = [await asyncio.wait_for(link.request_work(), 5) for _ in range(3)]
            bad = trajectory(first)
            bad.error = "controller said \ud800"
            await link.submit(bad)
            assert await link.wait_acked(5)
            await until(lambda: service.state.totals[Outcome.ENV_ERROR] == 1)
            assert service.state.totals["trajectories"] == 1 and service.state.totals[Outcome.SUCCESS] == 0
            assert link.unencodable == 1
            hopeless = trajectory(second)
            hopeless.rollout_index = 2**70
            await link.submit(hopeless)
            assert await link.wait_acked(5)  # dropped: nothing left to wait for
            assert link.unencodable == 2
            await link.submit(trajectory(third))
            assert await link.wait_acked(5)
            await until(lambda: service.state.totals[Outcome.SUCCESS] == 1)
            assert service.state.totals["trajectories"] == 2
            assert any("could not be encoded" in r.getMessage() for r in caplog.records)
    finally:
        ctx.destroy(linger=0)


async def test_hostile_frames_are_rejected_and_the_learner_keeps_serving(transport):
    ctx = zmq.asyncio.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(transport.endpoint)
    try:
        async with learner(ctx, transport) as service, actor(ctx, transport) as link:
            for frames in ([b"\xc1\xc1"], [b"\x81\xa4type\xa6pickle"], [b"x" * 10, b"y"], huge_table(100_000),
                           huge_table(4097)):  # issue 39 item 7: refused from their lengths, rows never built
                await raw.send_multipart(frames)
            await until(lambda: service.state.totals["bad_messages"] == 5)
            reply = codec.decode(await asyncio.wait_for(raw.recv_multipart(), 5), max_bytes=1 << 20)
            assert isinstance(reply, Reject) and "msgpack" in reply.reason
            assert (await asyncio.wait_for(link.request_work(), 5)).task["id"] == "grid4-red"
    finally:
        raw.close(0)
        ctx.destroy(linger=0)


async def test_a_repeated_request_gets_the_same_assignment_again(transport):
    """An assignment lost on the way (a full ROUTER queue drops silently) is recovered by re-sending the request."""
    ctx = zmq.asyncio.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.ROUTING_ID, b"raw-actor")
    raw.connect(transport.endpoint)
    try:
        async with learner(ctx, transport) as service:
            session = await hello_over(raw, "raw-actor", 4)
            request = codec.encode(WorkRequest("raw-r0", "raw-actor", session=session))
            await raw.send_multipart(request)
            first = codec.decode(await asyncio.wait_for(raw.recv_multipart(), 5), max_bytes=1 << 20)
            await raw.send_multipart(request)  # as if `first` had been lost
            again = codec.decode(await asyncio.wait_for(raw.recv_multipart(), 5), max_bytes=1 << 20)
            assert (again.group_id, again.rollout_index) == (first.group_id, first.rollout_index)
            assert service.admission.running == 1 and service.state.totals["assignments_resent"] == 1
    finally:
        raw.close(0)
        ctx.destroy(linger=0)


async def test_task_prepass_keeps_valuable_tasks_and_trains_on_none_of_it(transport, tmp_path):
    other = Task.from_dict({**TASK.to_dict(), "id": "grid4-blue", "instruction": "click blue"})
    lc = LearnerConfig(prepass_k=2, group_size=2, task_retire=False)  # one group of 2 per task
    plan = plan_tasks([TASK, other], lc, tmp_path, resuming=False)
    assert plan.prepass is not None and plan.selector is None
    scheduler = GroupScheduler(plan.pool, group_size=2, group_budget=0, pick_task=plan.pick_task)
    scores = {"grid4-red": [("SUCCESS", 1.0), ("FAILURE", 0.0)], "grid4-blue": [("FAILURE", 0.0)] * 2}
    ctx = zmq.asyncio.Context()
    try:
        async with learner(ctx, transport, batch=4, eta=1, scheduler=scheduler) as service, \
                actor(ctx, transport) as link:
            passing = asyncio.create_task(run_prepass(plan, service, lc))
            for _ in range(4):
                assignment = await asyncio.wait_for(link.request_work(), 5)
                assert "prepass" in service.report.status() and service.stats.prepass_running
                outcome, score = scores[assignment.task["id"]][assignment.rollout_index]
                await link.submit(trajectory(assignment, outcome, score))
            await asyncio.wait_for(passing, 5)
            assert plan.prepass.results == {"grid4-red": [1.0, 0.0], "grid4-blue": [0.0, 0.0]}
            assert [t.id for t in plan.pool] == ["grid4-red"] and plan.selector is service.control.selector
            assert json.loads((tmp_path / PREPASS_FILE).read_text())["valuable"] == ["grid4-red"]
            assert service.groups.empty()  # nothing to train on
            assert service.admission.accepted == 0 and service.stats.window.take().outcomes == {}
            assert "prepass" not in service.report.status() and not service.stats.prepass_running
            # training hands out only the valuable task
            assert (await asyncio.wait_for(link.request_work(), 5)).task["id"] == "grid4-red"
        restarted = plan_tasks([TASK, other], lc, tmp_path, resuming=True)  # a restart reuses the finished pass
        assert restarted.prepass is None and [t.id for t in restarted.pool] == ["grid4-red"]
    finally:
        ctx.destroy(linger=0)


async def test_a_flood_of_rejected_messages_writes_a_few_log_lines_and_counts_every_one(transport, caplog):
    """Issue 24 item 8: 1,000 refused work requests (beyond the slots the peer's Hello announced) are each
    answered with a Reject and counted by reason, but the learner logs at most its warning budget of them."""
    ctx = zmq.asyncio.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.ROUTING_ID, b"flooder")
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(transport.endpoint)
    try:
        async with learner(ctx, transport) as service:
            caplog.set_level(logging.WARNING, logger="learner.rollouts.service")
            session = await hello_over(raw, "flooder", 1)
            for i in range(1001):  # the first takes the one slot; the other 1,000 are refused
                await raw.send_multipart(codec.encode(WorkRequest(f"flood-{i}", "flooder", session=session)))
            await until(lambda: service.stats.rejections["slots"] == 1000, 30, "1,000 rejections")
            logged = [r for r in caplog.records if r.getMessage().startswith("rejected a message from flooder")]
            assert 1 <= len(logged) <= 20
            assert service.state.totals["warnings_suppressed"] == 1000 - len(logged)
            assert service.state.totals["bad_messages"] == 1000
    finally:
        raw.close(0)
        ctx.destroy(linger=0)


async def test_a_task_whose_rollouts_end_in_task_error_is_set_aside_and_named(transport):
    """Issue 24 item 1: TASK_ERROR trajectories are acked, never trained on, counted per task; after
    task_error_limit of them in a row the task is set aside (named in status.json and metrics) and only the
    other task is handed out."""
    other = Task.from_dict({**TASK.to_dict(), "id": "grid4-blue", "instruction": "click blue"})
    selector = TaskSelector([TASK, other], task_error_limit=2, retire=False)
    scheduler = GroupScheduler([TASK, other], group_size=2, pick_task=selector.pick_task, max_retries=0)
    ctx = zmq.asyncio.Context()
    try:
        async with learner(ctx, transport, batch=8, eta=4, scheduler=scheduler) as service, \
                actor(ctx, transport) as link:
            service.control.selector = selector
            handed: list[str] = []
            while "grid4-red" not in service.report.status()["set_aside"]:
                assignment = await asyncio.wait_for(link.request_work(), 5)
                handed.append(assignment.task["id"])
                broken = assignment.task["id"] == "grid4-red"
                traj = trajectory(assignment, "TASK_ERROR" if broken else "FAILURE", 0.0)
                traj.error = "TypeError: 'int' object is not iterable" if broken else ""
                await link.submit(traj)
                await until(lambda: service.state.totals["trajectories"] == len(handed), 5, "the trajectory")
                assert len(handed) < 20
            assert service.state.totals["TASK_ERROR"] == 2
            assert service.report.counters()["task_selection"]["set_aside"] == ["grid4-red"]
            later = [(await asyncio.wait_for(link.request_work(), 5)).task["id"] for _ in range(2)]
            assert "grid4-red" not in later[-1:]  # after the group open when it was set aside, only grid4-blue
    finally:
        ctx.destroy(linger=0)


async def test_a_rollout_slot_takes_trajectories_only_from_its_owner_with_its_task(transport):
    """Issue 24 item 3: a forged trajectory for another peer's slot is a Reject (``owner``) and leaves the slot's
    owner record alone, so the honest trajectory is still taken (not dropped as late); a trajectory id reused with
    other content is a Reject (``duplicate``); the owner's trajectory with another task id is a Reject (``task``)
    and ends the slot as ABORTED, so the rollout is handed out again."""
    ctx = zmq.asyncio.Context()
    forger = ctx.socket(zmq.DEALER)
    forger.setsockopt(zmq.ROUTING_ID, b"forger")
    forger.setsockopt(zmq.LINGER, 0)
    forger.connect(transport.endpoint)

    async def forge(traj: Trajectory) -> list[str]:
        await forger.send_multipart(codec.encode(traj))
        answers = []
        for _ in range(2):  # an Ack, then the Reject
            answers.append(codec.decode(await asyncio.wait_for(forger.recv_multipart(), 5), max_bytes=1 << 26))
        return [type(a).__name__ for a in answers]

    try:
        async with learner(ctx, transport, batch=4, eta=1) as service, actor(ctx, transport) as link:
            first, second = [await asyncio.wait_for(link.request_work(), 5) for _ in range(2)]
            honest = trajectory(first, "SUCCESS", 1.0)
            forged = trajectory(first, "FAILURE", 0.0)
            assert await forge(forged) == ["Ack", "Reject"]
            assert service.stats.rejections["owner"] == 1
            assert peer_name(service.peers.assigned[(first.group_id, 0)].peer) == "actor-1"
            reused = trajectory(first, "FAILURE", 0.0)
            reused.trajectory_id = honest.trajectory_id
            await link.submit(honest)
            await until(lambda: service.state.totals["trajectories"] == 1, 5, "the honest trajectory")
            assert service.state.totals["late"] == 0
            assert await forge(reused) == ["Ack", "Reject"]  # its id again, other content
            assert service.stats.rejections["duplicate"] == 1 and service.state.totals["duplicates"] == 0
            wrong_task = trajectory(second, "SUCCESS", 1.0)
            wrong_task.task_id = "grid4-blue"
            await link.submit(wrong_task)
            await until(lambda: service.stats.rejections["task"] == 1, 5, "the task rejection")
            assert service.state.totals["ABORTED"] == 1  # the slot ended as ABORTED: handed out again
            again = await asyncio.wait_for(link.request_work(), 5)
            assert (again.group_id, again.rollout_index) == (second.group_id, second.rollout_index)
    finally:
        forger.close(0)
        ctx.destroy(linger=0)


async def test_an_actor_of_another_run_is_refused_naming_both_runs(transport):
    """Issue 24 item 5: an actor whose Hello and work requests name another run gets no rollout and a Shutdown
    marked ``refused`` that names both run ids (arpo-actors then exits non-zero with it); this run's actor and an
    actor that names no run are served."""
    ctx = zmq.asyncio.Context()
    try:
        async with learner(ctx, transport) as service:
            service.peers.run_id = "new-run"
            inbox, outbox = asyncio.Queue(INBOX_SIZE), Outbox(routed=False)
            pump = SocketPump(dealer_socket(ctx, transport, "actor-1"), inbox=inbox, outbox=outbox,
                              max_bytes=transport.max_message_bytes)
            orphan = LearnerLink(outbox, "actor-1", 4, transport, run_id="old-run")
            tasks = [asyncio.create_task(pump.run()), asyncio.create_task(orphan.serve(inbox)),
                     asyncio.create_task(orphan.keepalive())]
            try:
                assert await asyncio.wait_for(orphan.request_work(), 5) is None  # shut down, not served
                assert orphan.refused and "'new-run'" in orphan.shutdown_reason and "'old-run'" in orphan.shutdown_reason
                await until(lambda: service.stats.rejections["run"] >= 1, 5, "the Hello refused")
                assert service.admission.running == 0 and not service.peers.waiting_count
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        async with learner(ctx, transport) as service, actor(ctx, transport) as link:
            service.peers.run_id, link.run_id = "new-run", "new-run"
            assert (await asyncio.wait_for(link.request_work(), 5)).task["id"] == "grid4-red"
            link.run_id = ""  # an embedding agent that names no run
            assert (await asyncio.wait_for(link.request_work(), 5)).task["id"] == "grid4-red"
    finally:
        ctx.destroy(linger=0)


async def test_arpo_actors_of_another_run_stops_with_the_learners_message(transport, tiny_model, tmp_path):
    from actors.link import ActorRefused
    from actors.main import run_actors
    from arpo_async.config import load_config

    config = load_config(None, [f'run_dir="{tmp_path / "old-run"}"', f'model="{tiny_model}"',
                                f'transport.endpoint="{transport.endpoint}"', "transport.heartbeat_s=0.05",
                                "actors.actors=1", "actors.warm_spares=0"])
    ctx = zmq.asyncio.Context()
    try:
        async with learner(ctx, transport) as service:
            service.peers.run_id = "new-run"
            with pytest.raises(ActorRefused, match="this learner runs 'new-run' but actor a-1 belongs to run 'old-run'"):
                await asyncio.wait_for(run_actors(config, "a-1"), 60)
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize("attack", ["hog", "storm"])
async def test_an_honest_actor_gets_work_beside_a_hog_or_a_storm_that_holds_every_rollout(transport, attack):
    """Issue 39 item 6: one peer announcing 4,096 slots and sending 1,100 requests (a hog, capped at
    transport.max_slots_per_peer: 76 refused), or 16 peers holding 20 rollouts each (a storm) beside 100 identities
    that never said Hello (all 500 of their requests refused, reason ``session``), take every one of the 320
    rollouts the admission rule allows before an honest actor arrives. The honest actor, starved for
    ``starved_after_s``, takes the newest rollout back from the peer furthest above its fair share (re-issued,
    counted in ``rollouts_reclaimed``) and gets work, long before any rollout_timeout_s."""
    ctx = zmq.asyncio.Context()
    sockets = []

    def dealer(identity: str):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, identity.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.connect(transport.endpoint)
        sockets.append(sock)
        return sock

    try:
        async with learner(ctx, transport, batch=320, eta=0) as service:  # room for 320 rollouts running
            service.peers.max_slots_per_peer, service.peers.starved_after_s = 1024, 0.5
            expire = asyncio.create_task(service.peers.expire_loop(period_s=0.1))
            if attack == "hog":
                hog = dealer("hog")
                session = await hello_over(hog, "hog", 4096)
                for i in range(1100):
                    await hog.send_multipart(codec.encode(WorkRequest(f"hog-{i}", "hog", session=session)))
                refusals = {"slots": 1100 - 1024}
            else:
                for p in range(16):
                    sock = dealer(f"storm-{p}")
                    session = await hello_over(sock, f"storm-{p}", 20)
                    for i in range(20):
                        await sock.send_multipart(codec.encode(WorkRequest(f"s{p}-{i}", f"storm-{p}",
                                                                           session=session)))
                for p in range(100):
                    sock = dealer(f"nameless-{p}")
                    for i in range(5):
                        await sock.send_multipart(codec.encode(WorkRequest(f"n{p}-{i}", f"nameless-{p}")))
                refusals = {"session": 500}
            await until(lambda: dict(service.stats.rejections) == refusals and service.admission.running == 320, 30,
                        f"every rollout held, and {refusals}")
            started = time.monotonic()
            async with actor(ctx, transport) as link:
                assignment = await asyncio.wait_for(link.request_work(), 5)
            assert assignment.task["id"] == "grid4-red" and time.monotonic() - started < 5
            assert service.state.totals["rollouts_reclaimed"] == 1 and service.admission.running == 320
            holders = collections.Counter(peer_name(hold.peer) for hold in service.peers.assigned.values())
            assert holders["actor-1"] == 1 and sum(holders.values()) == 320
            assert max(holders.values()) == (319 if attack == "hog" else 20)
            expire.cancel()
    finally:
        for sock in sockets:
            sock.close(0)
        ctx.destroy(linger=0)


async def test_a_peer_that_copies_an_actors_routing_id_cannot_submit_for_its_rollouts(transport):
    """Issue 39 item 6: a peer that connects under an honest actor's id ("actor-1"; the random part of the honest
    routing id it cannot know, so it does not take the route) and says Hello with a session of its own cannot
    submit for the honest actor's rollouts, neither with its own session nor with none (Reject ``owner``), nor ask
    for work under a session it did not open; the honest trajectory is taken and acked."""
    ctx = zmq.asyncio.Context()
    impostor = ctx.socket(zmq.DEALER)
    impostor.setsockopt(zmq.ROUTING_ID, b"actor-1")
    impostor.setsockopt(zmq.LINGER, 0)
    try:
        async with learner(ctx, transport, batch=4, eta=1) as service, actor(ctx, transport) as link:
            first = await asyncio.wait_for(link.request_work(), 5)
            impostor.connect(transport.endpoint)
            session = await hello_over(impostor, "actor-1", 4)
            assert session != link.session
            for forged_session in (session, ""):
                forged = trajectory(first, "SUCCESS", 1.0)
                forged.session = forged_session
                await impostor.send_multipart(codec.encode(forged))
            await impostor.send_multipart(codec.encode(WorkRequest("stolen", "actor-1", session=link.session[:-1])))
            await until(lambda: service.stats.rejections["owner"] == 2 and service.stats.rejections["session"] == 1,
                        10, "the forged trajectories and the request refused")
            assert service.peers.assigned[(first.group_id, first.rollout_index)].session == link.session
            impostor.close(0)
            await link.submit(trajectory(first, "FAILURE", 0.0))
            assert await link.wait_acked(10)
            assert service.state.totals["trajectories"] == 1 and service.state.totals[Outcome.FAILURE] == 1
            assert service.state.totals[Outcome.SUCCESS] == 0
    finally:
        impostor.close(0)
        ctx.destroy(linger=0)


async def test_a_captured_session_sent_from_another_routing_id_is_refused(transport):
    """Issue 48 item 8: a peer that learnt an honest actor's session (without CURVE it travels in clear) and sends,
    from a routing id of its own, a trajectory for the actor's rollout under that session: refused (``owner``), as
    the session is bound to the routing id that opened it; so is one from a second socket under the actor's own
    actor id (another random part), and a work request under it (``session``). Each is answered with a Reject;
    the honest trajectory is then taken. (b190f2c took the first forged trajectory as the rollout's.)"""
    ctx = zmq.asyncio.Context()
    thieves = [dealer_socket(ctx, transport, "thief"), dealer_socket(ctx, transport, "actor-1")]
    try:
        async with learner(ctx, transport, batch=4, eta=1) as service, actor(ctx, transport) as link:
            first = await asyncio.wait_for(link.request_work(), 5)
            hold = service.peers.assigned[(first.group_id, first.rollout_index)]
            assert hold.session == link.session and peer_name(hold.peer) == "actor-1"
            for thief in thieves:
                forged = trajectory(first, "SUCCESS", 1.0)
                forged.session = link.session  # captured
                await thief.send_multipart(codec.encode(forged))
                async with asyncio.timeout(10):  # its Ack (the learner holds the id), then the Reject
                    while not isinstance(refusal := codec.decode(await thief.recv_multipart(), max_bytes=1 << 20),
                                         Reject):
                        pass
                assert "belongs to another session" in refusal.reason, refusal
            await thieves[0].send_multipart(codec.encode(WorkRequest("t-r0", "thief", session=link.session)))
            await until(lambda: service.stats.rejections["owner"] == 2 and service.stats.rejections["session"] == 1,
                        10, "the captured session refused")
            assert service.state.totals["trajectories"] == 0
            assert (first.group_id, first.rollout_index) in service.peers.assigned  # still the honest actor's
            await link.submit(trajectory(first, "FAILURE", 0.0))
            assert await link.wait_acked(10)
            assert service.state.totals[Outcome.FAILURE] == 1 and service.state.totals[Outcome.SUCCESS] == 0
    finally:
        for thief in thieves:
            thief.close(0)
        ctx.destroy(linger=0)


async def test_an_actor_whose_session_was_forgotten_says_hello_again_and_gets_work(transport):
    """Issue 39 item 6: a learner that thought the actor silent forgets its session; the actor's next request is
    refused (``session``), it says Hello again at its next heartbeat, and the request, sent again, gets work. A
    request made before the link's keepalive started sends the Hello first."""
    ctx = zmq.asyncio.Context()
    try:
        async with learner(ctx, transport, batch=4, eta=1) as service:
            inbox, outbox = asyncio.Queue(INBOX_SIZE), Outbox(routed=False)
            pump = SocketPump(dealer_socket(ctx, transport, "actor-1"), inbox=inbox, outbox=outbox,
                              max_bytes=transport.max_message_bytes)
            link = LearnerLink(outbox, "actor-1", 4, transport)
            tasks = [asyncio.create_task(pump.run()), asyncio.create_task(link.serve(inbox))]
            try:
                first = await asyncio.wait_for(link.request_work(), 5)  # no keepalive yet: the Hello goes first
                assert first.task["id"] == "grid4-red"
                tasks.append(asyncio.create_task(link.keepalive()))
                (peer,) = service.peers.actors
                service.peers.actors[peer] -= 3600  # as if silent for an hour
                await service.peers.forget_silent_peers()
                assert not service.peers.sessions.latest(peer)
                again = await asyncio.wait_for(link.request_work(), 10)
                assert again.task["id"] == "grid4-red" and service.stats.rejections["session"] >= 1
                assert service.peers.sessions.latest(peer) == link.session
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        ctx.destroy(linger=0)


async def test_over_curve_a_session_is_bound_to_the_key_that_opened_it(transport, tmp_path):
    """Issue 39 item 6, with CURVE on: a second authorized host that has learnt an actor's session (its secret
    leaked) still cannot use it: its Hello naming that session, a request under it and a trajectory for the actor's
    rollout are refused (``session``, ``owner``), because the session is bound to the public key ZeroMQ's ZAP
    handler authenticated for the connection that opened it. The honest actor's trajectory is taken."""
    import dataclasses
    import shutil

    import zmq.auth

    from arpo_async.transport import start_authenticator

    keys, authorized = tmp_path / "keys", tmp_path / "authorized"
    keys.mkdir(), authorized.mkdir()
    zmq.auth.create_certificates(str(keys), "learner")
    for name in ("honest", "thief"):
        public, _ = zmq.auth.create_certificates(str(keys), name)
        shutil.copy(public, authorized)
    at_learner = dataclasses.replace(transport, curve_secret_key_file=str(keys / "learner.key_secret"),
                                     curve_authorized_dir=str(authorized))

    def at_host(name: str) -> TransportConfig:
        return dataclasses.replace(transport, curve_secret_key_file=str(keys / f"{name}.key_secret"),
                                   curve_server_key_file=str(keys / "learner.key"))

    ctx = zmq.asyncio.Context()
    authenticator = start_authenticator(ctx, at_learner)
    thief = dealer_socket(ctx, at_host("thief"), "thief")
    try:
        async with learner(ctx, at_learner, batch=4, eta=1) as service, actor(ctx, at_host("honest")) as link:
            first = await asyncio.wait_for(link.request_work(), 5)
            hold = service.peers.assigned[(first.group_id, first.rollout_index)]
            assert len(hold.key) == 40 and hold.session == link.session  # the honest host's Z85 public key
            await thief.send_multipart(codec.encode(Hello("thief", 4, session=link.session)))
            await thief.send_multipart(codec.encode(WorkRequest("t-r0", "thief", session=link.session)))
            forged = trajectory(first, "SUCCESS", 1.0)
            forged.session = link.session
            await thief.send_multipart(codec.encode(forged))
            await until(lambda: service.stats.rejections["session"] == 2 and service.stats.rejections["owner"] == 1,
                        10, "the stolen session refused")
            await link.submit(trajectory(first, "FAILURE", 0.0))
            assert await link.wait_acked(10)
            assert service.state.totals[Outcome.FAILURE] == 1 and service.state.totals[Outcome.SUCCESS] == 0
    finally:
        thief.close(0)
        authenticator.stop()
        ctx.destroy(linger=0)
