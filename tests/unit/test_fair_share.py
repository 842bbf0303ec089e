"""Max-min fair shares of the admitted rollouts (learner.rollouts.fair_share) and the session book
(learner.rollouts.sessions) that ties rollouts to a secret instead of a routing id."""

import collections
import secrets

import pytest

from arpo_async.validation import InvalidMessage
from learner.rollouts.fair_share import fair_shares
from learner.rollouts.sessions import SESSIONS_PER_PEER, SessionBook


def test_a_peer_that_asks_for_little_keeps_it_and_the_rest_is_split_evenly():
    assert fair_shares({"honest": 8, "hog": 1024}, 320) == {"honest": 8, "hog": 312}
    storm = fair_shares({**{f"s{i:02}": 20 for i in range(16)}, "honest": 8}, 320)
    assert storm["honest"] == 8 and sum(storm.values()) == 320 and set(storm.values()) == {8, 19, 20}
    assert fair_shares({"a": 3, "b": 4}, 100) == {"a": 3, "b": 4}  # everything fits
    assert fair_shares({"a": 100, "b": 100, "c": 100}, 11) == {"a": 3, "b": 4, "c": 4}
    assert fair_shares({}, 5) == {} and fair_shares({"a": 5}, 0) == {"a": 0}


def test_fair_shares_do_not_depend_on_the_order_of_the_peers():
    slots = {"b": 7, "a": 7, "c": 2}
    assert fair_shares(slots, 10) == fair_shares(dict(reversed(slots.items())), 10) == {"c": 2, "a": 4, "b": 4}


def test_negative_numbers_are_refused():
    with pytest.raises(ValueError):
        fair_shares({"a": 1}, -1)
    with pytest.raises(ValueError):
        fair_shares({"a": -1}, 1)


def token() -> str:
    return secrets.token_urlsafe(16)


def test_a_session_belongs_to_the_peer_and_key_that_opened_it():
    book = SessionBook()
    mine = token()
    book.open(mine, "actor-1", key="K")
    assert book.check(mine, "actor-1", "K").peer == "actor-1"
    for peer, key in (("actor-2", "K"), ("actor-1", ""), ("actor-1", "other")):
        with pytest.raises(InvalidMessage, match="session"):
            book.check(mine, peer, key)
        with pytest.raises(InvalidMessage, match="session"):
            book.open(mine, peer, key)  # nobody else can open it either
    book.open(mine, "actor-1", key="K")  # the same peer saying Hello again
    with pytest.raises(InvalidMessage, match="at least 22"):
        book.open("short", "actor-1")


def test_a_hello_flood_under_one_routing_id_never_evicts_a_session_that_owns_work():
    book = SessionBook()
    honest = token()
    book.open(honest, "actor-1")
    book.add(honest)  # a request waiting
    for _ in range(3 * SESSIONS_PER_PEER):  # idle sessions are evicted, least recently used first
        book.open(token(), "actor-1")
    assert book.check(honest, "actor-1").outstanding == 1
    flooded = [token() for _ in range(SESSIONS_PER_PEER - 1)]
    for session in flooded:
        book.open(session, "actor-1")
        book.add(session)
    with pytest.raises(InvalidMessage, match="each with work"):  # every one has work: refused, nothing evicted
        book.open(token(), "actor-1")
    book.add(honest, -1)
    book.forget_peer("actor-1")  # a silent peer: its sessions with no work go
    assert book.latest("actor-1") in flooded
    with pytest.raises(InvalidMessage):
        book.check(honest, "actor-1")


async def test_a_starved_peer_takes_a_rollout_back_only_with_a_share():
    """2 rollouts at once. A hog holds both; b, starved, takes one back (its share is 1). Then a asks: over a, b and
    the hog its share is 0 (more peers than rollouts), so it waits without taking any back, and dispatch returns."""
    import itertools

    from arpo_async.messages import WorkRequest
    from arpo_async.tasks import Task
    from arpo_async.transport import Envelope, Outbox
    from learner.rollouts.scheduler import GroupScheduler
    from learner.rollouts.service import LearnerService
    from learner.rollouts.staleness import StalenessManager
    from tests.support import hello

    task = Task.from_dict({"id": "grid4-red", "instruction": "click red", "config": [],
                           "evaluator": {"func": "exact_match", "result": {"type": "vm_file", "path": "/r"},
                                         "expected": {"type": "rule", "rules": {"expected": "x"}}}})
    order = itertools.cycle([task])
    service = LearnerService(Outbox(routed=True), GroupScheduler([task], group_size=2, pick_task=lambda: next(order)),
                             StalenessManager(2, 0))
    service.peers.starved_after_s = 0.0
    sessions = {peer: await hello(service, peer, n) for peer, n in {"a": 1, "b": 1, "hog": 5}.items()}

    async def ask(peer: str, n: int) -> None:
        for i in range(n):
            await service.handle(Envelope(WorkRequest(f"{peer}-{i}", peer, session=sessions[peer]), peer))

    def holders() -> collections.Counter:
        return collections.Counter(hold.peer for hold in service.peers.assigned.values())

    await ask("hog", 3)  # holds both rollouts, one more waiting
    assert holders() == {"hog": 2}
    await ask("b", 1)
    assert holders() == {"hog": 1, "b": 1} and service.state.totals["rollouts_reclaimed"] == 1
    await ask("a", 1)
    assert service.peers.fair_shares() == {"a": 0, "b": 1, "hog": 1}
    assert holders() == {"hog": 1, "b": 1} and service.state.totals["rollouts_reclaimed"] == 1
    assert service.peers.waiting_count == 2  # the hog's third request and a's
