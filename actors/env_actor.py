"""EnvActor: one coroutine running rollouts, each on a desktop from the pool, until the learner says stop.

Owns: the desktop of its current episode (from the process's DesktopPool). Loop: ask for work -> acquire a
desktop (a warm spare when the pool has one) -> run the episode -> release the desktop (the pool resets it in
place for another episode, or removes it and boots a replacement; see DesktopPool) -> submit the trajectory
(held until acked). A desktop whose episode ended in ENV_ERROR (it died, timed out, or a setup or evaluator
failed) is never reused: it is released with ``reusable=False`` and replaced by a fresh container.
Invariant: the desktop is released in ``finally``, whatever ends the episode or the actor.

The actor's work comes from a :class:`WorkSource`: in a run the ZeroMQ LearnerLink (actors.link); anything with
the same four members (e.g. a local queue of Assignments with a trajectory list) drives it the same way.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Protocol

from actors.desktop.controller_client import DesktopError
from actors.desktop.fleet import Desktop
from actors.desktop.pool import DesktopPool
from actors.episode import EpisodeRunner
from actors.sinks import TrajectorySink
from arpo_async.messages import Assignment, Outcome, Trajectory

log = logging.getLogger(__name__)

MAX_CONSECUTIVE_ACQUIRE_FAILURES = 3
"""The actor stops (raising DesktopError) after this many episodes in a row found no desktop; each of those
already retried the container start ``desktop_start_attempts`` times, so Docker is most likely broken."""


class WorkSource(TrajectorySink, Protocol):
    """What an EnvActor needs from its link to the learner (LearnerLink in a run).

    Attributes:
        actor_id: the process's id; an actor's id is ``<actor_id>/<index>``.
        running: episodes in flight (the actor adds 1 while it runs one; LearnerLink reports it in heartbeats).
    """

    actor_id: str
    running: int

    async def request_work(self) -> Assignment | None:
        """The next rollout to run; None when there is no more work (the actor returns)."""
        ...


class EnvActor:
    """One environment actor (see module docstring).

    Args:
        index: this actor's number within the process (for logs and trajectory ids).
        link: the process's learner link (shared): a LearnerLink, or any :class:`WorkSource`.
        pool: hands out booted desktops and removes used ones (shared).
        runner: runs one episode (shared, stateless).
    """

    def __init__(self, index: int, link: WorkSource, pool: DesktopPool, runner: EpisodeRunner) -> None:
        self.index = index
        self.link = link
        self.pool = pool
        self.runner = runner
        self.episodes = 0
        self.actor_id = f"{link.actor_id}/{index}"
        self._acquire_failures = 0

    async def run(self) -> None:
        """Run rollouts until the learner sends shutdown.

        Raises:
            DesktopError: no desktop could be started for ``MAX_CONSECUTIVE_ACQUIRE_FAILURES`` episodes in a row
                (each of those rollouts is first reported as ENV_ERROR).
        """
        while True:
            assignment = await self.link.request_work()
            if assignment is None:
                return
            traj = await self._episode(assignment)
            self._log(traj)
            await self.link.submit(traj)
            self.episodes += 1
            if self._acquire_failures >= MAX_CONSECUTIVE_ACQUIRE_FAILURES:
                raise DesktopError(f"actor {self.actor_id}: no desktop could be started for "
                                   f"{self._acquire_failures} episodes in a row: {traj.error}")

    async def _episode(self, assignment: Assignment) -> Trajectory:
        """One rollout on a desktop from the pool; the desktop is released whatever happens."""
        self.link.running += 1
        desktop: Desktop | None = None
        reusable = False
        try:
            t0 = time.perf_counter()
            try:
                desktop = await self.pool.acquire()
            except DesktopError as e:
                self._acquire_failures += 1
                return self._no_desktop(assignment, e)
            self._acquire_failures = 0
            reset_s = time.perf_counter() - t0
            traj = await self.runner.run(desktop.controller, assignment, self.actor_id, desktop.name)
            traj.timings["reset_s"] = reset_s
            reusable = traj.outcome is not Outcome.ENV_ERROR
            return traj
        finally:
            self.link.running -= 1
            if desktop is not None:
                await self.pool.release(desktop, reusable=reusable)

    def _no_desktop(self, assignment: Assignment, error: DesktopError) -> Trajectory:
        return Trajectory(
            trajectory_id=uuid.uuid4().hex, actor_id=self.actor_id, task_id=str(assignment.task.get("id", "")),
            group_id=assignment.group_id, rollout_index=assignment.rollout_index, outcome=Outcome.ENV_ERROR,
            score=0.0, format_ok=True, steps=[], screenshots=[], error=f"DesktopError: {error}",
            assigned_version=assignment.policy_version)

    def _log(self, traj: Trajectory) -> None:
        level = logging.WARNING if not traj.outcome.trainable else logging.INFO
        log.log(level, "actor %s %s/%s #%d: %s score=%.2f steps=%d %.1fs %s", self.actor_id, traj.task_id,
                traj.group_id, traj.rollout_index, traj.outcome, traj.score, len(traj.steps),
                traj.timings.get("episode_s", 0.0), traj.error)
