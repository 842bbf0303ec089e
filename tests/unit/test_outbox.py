"""The transport's Outbox: a full outbox makes its sender wait and is counted (never a dropped message); a ROUTER's
outbox refuses a message without a peer."""

import asyncio

import pytest

from arpo_async.transport import Outbox


async def test_a_full_outbox_makes_the_sender_wait_and_counts_it():
    outbox = Outbox(routed=True, size=1)
    await outbox.send("first", "peer")
    second = asyncio.create_task(outbox.send("second", "peer"))
    done, _ = await asyncio.wait({second}, timeout=0.2)
    assert not done and outbox.full_waits == 1 and outbox.qsize() == 1
    assert outbox.get_nowait() == ("peer", "first")
    await asyncio.wait_for(second, 5)
    assert outbox.get_nowait() == ("peer", "second") and outbox.full_waits == 1


async def test_a_router_outbox_needs_a_peer():
    with pytest.raises(ValueError, match="peer"):
        await Outbox(routed=True).send("message")
    dealer = Outbox(routed=False)
    await dealer.send("message")
    assert dealer.get_nowait() == (None, "message")
