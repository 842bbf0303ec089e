"""DesktopPool and the fast observation path, on real desktop containers.

Covers: warm spares (acquire hands out an already-booted desktop and the pool refills in the background),
release removes the used container, or (max_episodes > 1) resets it in place and hands it out again until it has
served max_episodes; a desktop released as not reusable, or whose reset fails, is replaced; a dead spare is found by the health check and replaced, a start that
keeps failing surfaces as DesktopError after the configured tries, close() leaves no container behind;
start-ups are bounded by the fleet's start slots and fair: a start queued behind the others longer than its
deadline still succeeds, as the deadline counts from its own slot;
the controller's screenshot encodings (PNG default, JPEG with quality, bad values rejected) and the
byte-identical screenshots of an unchanged screen that the trajectory de-duplication relies on; and the
shutdown races: a removal or start cancelled part-way still leaves no container behind.
"""
from __future__ import annotations

import asyncio
import io
import math
import secrets
import time

import pytest
from PIL import Image

from actors.desktop.controller_client import DesktopError
from actors.desktop.fleet import DesktopFleet
from actors.desktop.pool import DesktopPool
from actors.episode import add_screenshot
from tests.support import labelled, until

pytestmark = pytest.mark.docker

BOOT_DEADLINE_S = 180.0  # generous: the whole suite may be starting containers on 2 cores


@pytest.fixture
async def fleet(desktop_image):
    run_id = f"test-pool-{secrets.token_hex(3)}"
    f = DesktopFleet(desktop_image, run_id=run_id)
    try:
        yield f
    finally:
        await f.remove_all()
        await f.close()


async def test_warm_spare_is_handed_out_at_once_and_refilled(fleet):
    async with DesktopPool(fleet, warm_spares=2, max_episodes=1) as pool:
        async with asyncio.timeout(BOOT_DEADLINE_S):
            await pool.wait_spares()
        spares = {d.container_id for d in pool.spares}
        assert len(spares) == 2 and pool.in_use == []
        asked_at = time.monotonic()
        desktop = await pool.acquire()
        assert desktop.container_id in spares and desktop.started_at < asked_at  # booted before we asked
        assert pool.stats["warm_acquires"] == 1 and pool.stats["cold_acquires"] == 0
        assert pool.in_use == [desktop]
        assert (await desktop.controller.screenshot()).startswith(b"\x89PNG")

        await pool.release(desktop)
        await until(lambda: len(pool.spares) == 2, BOOT_DEADLINE_S, "the pool to refill to 2 spares")
        await until(_gone(fleet.run_id, desktop.container_id), 60, "the released container to be removed")
        assert desktop.container_id not in {d.container_id for d in pool.spares}
        assert pool.stats["started"] == 3 and pool.stats["removed"] == 1
    assert await labelled(fleet.run_id) == []  # close() removed the spares


def _gone(run_id: str, container_id: str):
    async def check() -> bool:
        return container_id not in await labelled(run_id)
    return check


async def test_acquire_without_spares_boots_one_and_close_removes_desktops_in_use(fleet):
    async with DesktopPool(fleet, warm_spares=0) as pool:
        async with asyncio.timeout(BOOT_DEADLINE_S):
            first, second = await asyncio.gather(pool.acquire(), pool.acquire())
        assert first.container_id != second.container_id
        assert pool.stats["cold_acquires"] == 2 and pool.spares == [] and pool.starting == 0
        assert set(await labelled(fleet.run_id)) == {first.container_id, second.container_id}
    assert await labelled(fleet.run_id) == []  # close() removed them although they were never released


async def test_dead_spare_is_replaced(fleet):
    async with DesktopPool(fleet, warm_spares=1, health_interval_s=0.5) as pool:
        async with asyncio.timeout(BOOT_DEADLINE_S):
            await pool.wait_spares()
        (victim,) = pool.spares
        await fleet.docker.containers.container(victim.container_id).kill()
        await until(lambda: pool.stats["dead_spares"] >= 1, 60, "the health check to notice the dead spare")
        await until(lambda: len(pool.spares) == 1 and pool.spares[0] is not victim, BOOT_DEADLINE_S,
                    "a replacement spare")
        await until(_gone(fleet.run_id, victim.container_id), 60, "the dead container to be removed")
        replacement = await pool.acquire()
        assert replacement is not victim and await replacement.controller.health()
        await pool.release(replacement)
    assert await labelled(fleet.run_id) == []


async def _acquire(pool: DesktopPool):
    async with asyncio.timeout(BOOT_DEADLINE_S):
        return await pool.acquire()


async def test_released_desktop_is_reset_and_reused_until_max_episodes(fleet):
    async with DesktopPool(fleet, warm_spares=0, max_episodes=3) as pool:
        first = await _acquire(pool)
        for episode in (2, 3):
            await first.controller.execute(["sh", "-c", "echo leak > /tmp/arpo/leak"])
            await pool.release(first)
            again = await _acquire(pool)
            assert again.container_id == first.container_id and again.episodes == episode
            assert await again.controller.get_file("/tmp/arpo/leak") is None  # the reset removed it
        await pool.release(first)  # third episode done: retired, not reset
        fresh = await _acquire(pool)
        assert fresh.container_id != first.container_id and fresh.episodes == 1
        await until(_gone(fleet.run_id, first.container_id), 60, "the retired container to be removed")
        assert pool.stats["resets"] == 2 and pool.stats["retired"] == 1 and pool.stats["started"] == 2
        await pool.release(fresh)
    assert await labelled(fleet.run_id) == []


async def test_desktop_released_as_not_reusable_or_failing_its_reset_is_replaced(fleet):
    async with DesktopPool(fleet, warm_spares=0, max_episodes=10) as pool:
        errored = await _acquire(pool)
        await pool.release(errored, reusable=False)  # e.g. its episode ended in ENV_ERROR
        dying = await _acquire(pool)
        assert dying.container_id != errored.container_id
        await fleet.docker.containers.container(dying.container_id).kill()  # dies after its episode
        await pool.release(dying)
        third = await _acquire(pool)
        assert third.container_id not in (errored.container_id, dying.container_id)
        assert await third.controller.health()
        assert pool.stats["reset_failures"] == 1 and pool.stats["resets"] == 0 and pool.stats["started"] == 3
        await pool.release(third)
    assert await labelled(fleet.run_id) == []


async def test_start_failure_is_retried_then_surfaces_as_desktop_error():
    run_id = f"test-pool-{secrets.token_hex(3)}"
    fleet = DesktopFleet("arpo-desktop:no-such-version", run_id=run_id)
    try:
        async with DesktopPool(fleet, warm_spares=0, start_attempts=3, retry_base_s=0.05) as pool:
            with pytest.raises(DesktopError, match="in 3 tries.*no-such-version"):
                async with asyncio.timeout(60):
                    await pool.acquire()
            assert pool.stats["start_failures"] == 3 and pool.stats["start_gave_up"] == 1
            assert pool.in_use == [] and pool.spares == []
        with pytest.raises(DesktopError, match="not running"):
            await pool.acquire()
    finally:
        await fleet.close()
    assert await labelled(run_id) == []


async def test_starts_are_bounded_and_a_start_queued_past_its_deadline_does_not_time_out(desktop_image):
    """One start slot, a ready deadline of 6 boots (at least 10 s), and enough desktops asked for at once that the
    last waits ~2.5 deadlines for its slot: every start succeeds on its first try, the boots never overlap, and
    each boot (slot to healthy) stays within the deadline although the queue before it did not."""
    run_id = f"test-pool-{secrets.token_hex(3)}"
    with pytest.raises(ValueError):
        DesktopFleet(desktop_image, run_id=run_id, max_concurrent_starts=0)
    probe = DesktopFleet(desktop_image, run_id=run_id)
    boots = []
    for _ in range(2):  # the faster of two boots: the first is often slowed by a cold page cache
        one = await probe.start()
        boots.append(one.ready_s)
        await probe.remove(one)
    await probe.close()
    boot_s = min(boots)
    deadline_s = max(6 * boot_s, 10.0)
    n = min(40, math.ceil(2.5 * deadline_s / boot_s) + 1)
    fleet = DesktopFleet(desktop_image, run_id=run_id, max_concurrent_starts=1, ready_timeout=deadline_s)
    try:
        async with DesktopPool(fleet, warm_spares=0, start_attempts=1, max_episodes=1) as pool:
            async with asyncio.timeout(BOOT_DEADLINE_S + n * deadline_s):
                desktops = await asyncio.gather(*(pool.acquire() for _ in range(n)))
            assert pool.stats["started"] == n and pool.stats["start_failures"] == 0
            assert len({d.container_id for d in desktops}) == n
            assert max(d.queued_s for d in desktops) > deadline_s, (boot_s, deadline_s, n)  # the premise
            assert all(d.ready_s <= deadline_s for d in desktops)
            slots = sorted((d.queued_s, d.queued_s + d.ready_s) for d in desktops)  # seconds after the ask
            assert slots[0][0] < 1.0
            for (_, end), (begin, _) in zip(slots, slots[1:]):
                assert begin >= end - 0.01, slots  # one boot at a time: the next slot opens as the last closes
    finally:
        await fleet.remove_all()
        await fleet.close()
    assert await labelled(run_id) == []


async def test_screenshot_encodings(fleet):
    desktop = await fleet.start()
    c = desktop.controller
    png = await c.screenshot()
    jpeg = await c.screenshot("jpeg", 85)
    low = await c.screenshot("jpeg", 10)
    assert png.startswith(b"\x89PNG") and jpeg.startswith(b"\xff\xd8\xff")
    for data, fmt in ((png, "PNG"), (jpeg, "JPEG"), (low, "JPEG")):
        image = Image.open(io.BytesIO(data))
        assert image.format == fmt and image.size == (1280, 720)
    assert len(low) < len(jpeg)  # quality reaches the encoder
    with pytest.raises(ValueError):
        await c.screenshot("gif")
    with pytest.raises(ValueError):
        await c.screenshot("jpeg", 0)
    with pytest.raises(DesktopError, match="HTTP 400.*quality"):  # the controller validates too
        await c._request("GET", "/screenshot?format=jpeg&quality=101")


async def test_unchanged_screen_gives_identical_bytes_stored_once(fleet):
    """The de-duplication in EpisodeRunner relies on an unchanged screen encoding to the same bytes."""
    desktop = await fleet.start()
    c = desktop.controller
    shots: list[bytes] = []
    indices = [add_screenshot(shots, await c.screenshot()) for _ in range(3)]
    assert indices == [0, 0, 0] and len(shots) == 1
    indices.append(add_screenshot(shots, await c.screenshot("jpeg", 85)))
    indices.append(add_screenshot(shots, await c.screenshot("jpeg", 85)))
    assert indices[3:] == [1, 1]
    r = await c.execute(["xdotool", "mousemove", "--sync", "300", "200"], timeout=20)
    assert r["returncode"] == 0, r
    assert add_screenshot(shots, await c.screenshot()) == 2  # the cursor moved: a new screenshot


@pytest.mark.parametrize("cancel_at", ["before it runs", "delete requested", "delete answered"])
async def test_cancelled_removal_then_close_leaves_nothing(fleet, cancel_at):
    """close() right after a release whose background removal it cancels (the pool's shutdown race) must still
    leave no container: a second delete of a container the engine is already removing waits for it. The cancel
    lands before the removal ran, while its delete call waits on the engine, or once the engine answered."""
    desktop = await asyncio.wait_for(fleet.start(), BOOT_DEADLINE_S)
    reached = {"delete requested": asyncio.Event(), "delete answered": asyncio.Event()}
    real_delete = fleet._delete

    async def delete(container_id: str) -> bool:
        reached["delete requested"].set()
        answer = await real_delete(container_id)
        reached["delete answered"].set()
        return answer

    fleet._delete = delete
    removal = asyncio.create_task(fleet.remove(desktop))
    if cancel_at in reached:  # we run again once the removal waits on the engine (or is done)
        await asyncio.wait_for(reached[cancel_at].wait(), 60)
    removal.cancel()
    await asyncio.wait([removal])
    await fleet.remove(desktop)  # what close() does for a desktop whose removal did not finish
    assert await labelled(fleet.run_id) == []


async def test_start_cancelled_after_the_engine_created_the_container_removes_it(fleet):
    """The pool closing while a refill's create request is in flight: the engine has made the container but its
    reply has not reached us yet; the cancelled start must still remove it."""
    created = asyncio.Event()
    real_create = fleet.docker.containers.create

    async def create_with_slow_reply(*args, **kwargs):  # the real create; its reply arrives 0.5 s later
        container = await real_create(*args, **kwargs)
        created.set()
        await asyncio.sleep(0.5)
        return container

    fleet.docker.containers.create = create_with_slow_reply
    start = asyncio.create_task(fleet.start())
    await asyncio.wait_for(created.wait(), 60)
    assert len(await labelled(fleet.run_id)) == 1
    start.cancel()
    await asyncio.wait([start])
    assert start.cancelled()
    assert await labelled(fleet.run_id) == []
