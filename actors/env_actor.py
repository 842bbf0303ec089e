"""EnvActor: one coroutine, one desktop at a time, rollouts until the learner says stop.

Owns: its current desktop (a container). Loop: ask for work -> run the episode on a fresh desktop ->
submit the trajectory (held until acked) -> replace the desktop. Every episode starts from a new container,
so no state leaks between rollouts; a desktop that died (ENV_ERROR) is simply not reused.
Invariant: the desktop is removed in ``finally``, whatever ends the actor.
"""

from __future__ import annotations

import logging

from actors.desktop.controller_client import DesktopError
from actors.desktop.fleet import Desktop, DesktopFleet
from actors.episode import EpisodeRunner
from actors.link import LearnerLink
from arpo_async.messages import Outcome, Trajectory

log = logging.getLogger(__name__)


class EnvActor:
    """One environment actor (see module docstring).

    Args:
        index: this actor's number within the process (for logs and trajectory ids).
        link: the process's learner link (shared).
        fleet: creates and removes desktops (shared).
        runner: runs one episode (shared, stateless).
    """

    def __init__(self, index: int, link: LearnerLink, fleet: DesktopFleet, runner: EpisodeRunner) -> None:
        self.index = index
        self.link = link
        self.fleet = fleet
        self.runner = runner
        self.episodes = 0
        self.actor_id = f"{link.actor_id}/{index}"

    async def run(self) -> None:
        """Run rollouts until the learner sends shutdown; always removes the desktop on the way out."""
        desktop: Desktop | None = None
        try:
            while True:
                if desktop is None:
                    desktop = await self._start_desktop()
                assignment = await self.link.request_work()
                if assignment is None:
                    return
                self.link.running += 1
                try:
                    traj = await self.runner.run(desktop.controller, assignment, self.actor_id, desktop.name)
                finally:
                    self.link.running -= 1
                self._log(traj)
                await self.link.submit(traj)
                self.episodes += 1
                await self.fleet.remove(desktop)  # a fresh container per episode
                desktop = None
        finally:
            if desktop is not None:
                await self.fleet.remove(desktop)

    async def _start_desktop(self) -> Desktop:
        """Start a desktop, retrying a few times; raises DesktopError when Docker keeps failing."""
        last: Exception | None = None
        for attempt in range(3):
            try:
                return await self.fleet.start()
            except DesktopError as e:
                last = e
                log.warning("actor %s: desktop start failed (try %d): %s", self.actor_id, attempt + 1, e)
        raise DesktopError(f"actor {self.actor_id} could not start a desktop: {last}")

    def _log(self, traj: Trajectory) -> None:
        level = logging.WARNING if traj.outcome in (Outcome.ENV_ERROR.value, Outcome.ABORTED.value) else logging.INFO
        log.log(level, "actor %s %s/%s #%d: %s score=%.2f steps=%d %.1fs %s", self.actor_id, traj.task_id,
                traj.group_id, traj.rollout_index, traj.outcome, traj.score, len(traj.steps),
                traj.timings.get("episode_s", 0.0), traj.error)
