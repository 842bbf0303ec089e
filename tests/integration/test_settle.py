"""actors.settle on real desktops: the screenshot after an action waits until the screen stops changing.

The screen is put in motion from inside the desktop (the cursor moved in small steps by xdotool, drawn into every
screenshot), so the tests see what an agent's action with a slow redraw looks like without depending on how busy
the machine is.
"""
from __future__ import annotations

import time

import pytest

from actors.desktop.controller_client import ControllerClient
from actors.settle import settle, settled_screenshot
from tests.support import until

pytestmark = pytest.mark.docker


async def _move_cursor_in_steps(c: ControllerClient, steps: int, pause_s: float) -> None:
    """Start moving the cursor right by 15 px ``steps`` times, ``pause_s`` apart, in the background."""
    loop = f"for i in $(seq {steps}); do xdotool mousemove_relative -- 15 0; sleep {pause_s}; done"
    await c.execute(["xdotool", "mousemove", "--sync", "100", "100"])
    r = await c.execute(f"setsid sh -c '{loop}' >/dev/null 2>&1 &", shell=True)
    assert r["returncode"] == 0, r


async def test_a_screen_in_motion_is_returned_once_it_stops(fleet):
    c = (await fleet.start()).controller
    await _move_cursor_in_steps(c, steps=10, pause_s=0.03)
    moving = await c.screenshot()
    settled = await settled_screenshot(c, interval_s=0.3, timeout_s=20)
    await until(c.cursor_position, 20, "the cursor at the end of its path", ok=lambda p: p == (250, 100))
    still = await c.screenshot()
    assert moving != still  # the first screenshot caught the screen in motion...
    assert settled == still  # ...the settled one shows where it stopped


async def test_a_still_screen_settles_after_one_interval(fleet):
    c = (await fleet.start()).controller
    before = await c.screenshot()
    start = time.monotonic()
    shot = await settled_screenshot(c, interval_s=0.1, timeout_s=30)
    assert time.monotonic() - start < 15  # long before the deadline: two equal screenshots end the wait
    assert shot == before
    settled = await settle(c, interval_s=0.1, timeout_s=30)  # what a step records (Step.settle_s, settle_timed_out)
    assert settled.screenshot == before and not settled.timed_out
    assert 0.1 <= settled.seconds < 15  # one interval at least, long before the deadline


async def test_a_screen_that_never_settles_gives_the_latest_at_the_deadline(fleet):
    c = (await fleet.start()).controller
    await _move_cursor_in_steps(c, steps=200, pause_s=0.02)  # ~4 s or more of motion
    start = time.monotonic()
    settled = await settle(c, interval_s=0.3, timeout_s=1.0)  # settled_screenshot's wait, with what a step records
    assert time.monotonic() - start >= 1.0
    assert settled.screenshot.startswith(b"\x89PNG")
    assert settled.timed_out and settled.seconds >= 1.0  # Step.settle_timed_out: the screen was still moving


async def test_no_interval_takes_one_screenshot_and_bad_values_are_refused(fleet):
    c = (await fleet.start()).controller
    await _move_cursor_in_steps(c, steps=200, pause_s=0.02)
    start = time.monotonic()
    assert (await settled_screenshot(c, interval_s=0, timeout_s=30)).startswith(b"\x89PNG")
    assert time.monotonic() - start < 15
    with pytest.raises(ValueError, match="must be >= 0"):
        await settled_screenshot(c, interval_s=-0.1)
