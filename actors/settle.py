"""Settle: the screen after an action, once the app has drawn what the action did.

An action is sent to the desktop as X input events (xdotool or pyautogui); the command returns once the X server
has the events, not once the app has handled them and redrawn. A screenshot taken right away can show the screen
before the action: on a busy machine (8 desktops, arpo-serve and the learner on 2 cores) 57 of 123 clicks on a
section tab of the settings app were not yet visible in the screenshot that followed, and the policy was asked
for its next action on a screen that no longer existed. OSWorld waits a fixed time instead (``DesktopEnv.step(action,
pause=2)`` sleeps ``pause`` seconds after every action before its observation); a fixed wait is either too short
under load or wasted on a quiet machine, so this waits until two screenshots ``interval_s`` apart are identical,
bounded by ``timeout_s``.

Role: functions over a controller; no state. :func:`settle` also says how long the wait took and whether it hit
the timeout (each step's ``Step.settle_s`` and ``Step.settle_timed_out``: metrics.jsonl's ``stage_s.settle``).
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

from actors.desktop.controller_client import ControllerClient

__all__ = ["Settled", "settle", "settled_screenshot"]


class Settled(NamedTuple):
    """What :func:`settle` returns."""

    screenshot: bytes
    """The encoded screenshot of the settled screen (or the latest one at the timeout)."""
    seconds: float
    """Seconds from the call to the screenshot's return (the screenshots and the waits between them)."""
    timed_out: bool
    """True when no two screenshots ``interval_s`` apart were identical within ``timeout_s`` (never with
    ``interval_s == 0``)."""


async def settled_screenshot(controller: ControllerClient, format: str = "png", quality: int = 85, *,
                             interval_s: float = 0.1, timeout_s: float = 2.0) -> bytes:
    """A screenshot of a screen that stopped changing: the first of two, ``interval_s`` apart, that are
    byte-identical (the same pixels encode to the same bytes), or the latest one once ``timeout_s`` has passed
    (an animation, a blinking caret or a clock never settles: the episode goes on with the latest screen).

    ``interval_s == 0`` takes one screenshot right away (no wait: the behaviour before settling existed).

    Args:
        controller: the desktop's controller; format, quality: as :meth:`ControllerClient.screenshot`.
        interval_s: seconds between the screenshots compared (>= 0).
        timeout_s: the longest wait for a settled screen, seconds from the call (>= 0).
    Returns:
        the encoded screenshot.
    Raises:
        ValueError: a negative ``interval_s`` or ``timeout_s``, or a bad format or quality.
        DesktopError: the controller cannot be reached.
    """
    return (await settle(controller, format, quality, interval_s=interval_s, timeout_s=timeout_s)).screenshot


async def settle(controller: ControllerClient, format: str = "png", quality: int = 85, *,
                 interval_s: float = 0.1, timeout_s: float = 2.0) -> Settled:
    """:func:`settled_screenshot`, with how long it took and whether it hit the timeout (same arguments and
    errors)."""
    if interval_s < 0 or timeout_s < 0:
        raise ValueError(f"interval_s and timeout_s must be >= 0, got {interval_s} and {timeout_s}")
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + timeout_s
    shot = await controller.screenshot(format, quality)
    if interval_s == 0:
        return Settled(shot, loop.time() - started, False)
    while (left := deadline - loop.time()) > 0:
        await asyncio.sleep(min(interval_s, left))
        latest = await controller.screenshot(format, quality)
        if latest == shot:
            return Settled(latest, loop.time() - started, False)
        shot = latest
    return Settled(shot, loop.time() - started, True)
