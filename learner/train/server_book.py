"""Which inference servers a publisher must still reach: behind the policy version, holding part of one, or left
paused.

Role: the bookkeeping both weight publishers share (learner.train.publisher's WeightPublisher and
DistributedPublisher inherit :class:`ServerBook`), and the check the training loop's resync runs outside its lock
(learner.train.loop.TrainingLoop.keep_servers_current).

Invariants: a publication resumes every server it paused, whatever failed; a server whose resume did not go
through stays in ``paused`` and is resumed by the next resync; a server that failed after its update began may
hold part of the new weights, whatever version it reports, and stays in ``partial`` until a whole update of it
succeeds (the next resync sends it the whole current weights).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Sequence

from arpo_async.engine import InferenceEngine
from arpo_async.inference_client import PolicyRequestError, PolicyUnavailable

__all__ = ["CHECK_TIMEOUT_S", "ServerBook", "servers_behind"]

log = logging.getLogger("arpo.learner.publish")

CHECK_TIMEOUT_S = 10.0
"""The most seconds :func:`servers_behind` waits for one server's /health and /get_model_info together."""


async def servers_behind(engines: Sequence[InferenceEngine], version: int,
                         timeout_s: float = CHECK_TIMEOUT_S) -> list[InferenceEngine]:
    """The engines that answer now and serve a ``weight_version()`` below ``version`` (a restarted server serves
    the base weights as 0), asked together, each for at most ``timeout_s`` seconds. A server that does not answer
    is left out (logged at DEBUG); one that answers too slowly or with something this learner cannot read (a
    version of ``Infinity``, ``1e400``, a fraction; a body that is not JSON) is left out with one WARNING line
    naming it. Either way the next check asks again; nothing here raises for a server's answer."""
    async def check(engine: InferenceEngine) -> bool:
        try:
            async with asyncio.timeout(timeout_s):
                return await engine.healthy() and await engine.weight_version() < version
        except PolicyUnavailable as error:
            log.debug("weight version check of %s: %s", engine.url, error)
        except TimeoutError:
            log.warning("weight version check of %s skipped this round: no answer within %.0f s", engine.url,
                        timeout_s)
        except (PolicyRequestError, ValueError, TypeError, OverflowError) as error:
            log.warning("weight version check of %s skipped this round: %s", engine.url, str(error)[:300])
        return False

    flags = await asyncio.gather(*(check(engine) for engine in engines))
    return [engine for engine, behind in zip(engines, flags) if behind]



class ServerBook:
    """The servers of a publisher and the ones a publication left unfinished (see the module docstring).

    Args:
        engines: every inference server; kept as ``engines``.
    """

    def __init__(self, engines: Sequence[InferenceEngine]) -> None:
        self.engines = list(engines)
        self.paused: dict[str, InferenceEngine] = {}
        """Servers this publisher paused whose resume has not gone through, by URL."""
        self.partial: dict[str, InferenceEngine] = {}
        """Servers that may hold part of a version (an update began and did not end well), by URL."""

    async def behind(self, version: int) -> list[InferenceEngine]:
        """The servers to send the whole weights of ``version`` to: :func:`servers_behind`, plus every server in
        ``partial`` (whatever version it reports: the last bucket may have set it)."""
        found = await servers_behind(self.engines, version)
        return found + [engine for engine in self.partial.values() if engine not in found]

    async def pause(self, engine: InferenceEngine) -> None:
        """Pause ``engine`` for an update (noted in ``paused`` first: a pause whose answer was lost still holds)."""
        self.paused[engine.url] = engine
        await engine.pause()

    async def resume(self, engine: InferenceEngine) -> bool:
        """Resume ``engine``; never raises. False (it stays in ``paused``, logged) when the server did not answer
        or did not agree; the next resync (:meth:`lift_pauses`) tries again."""
        try:
            reply = await engine.resume()
        except (PolicyUnavailable, PolicyRequestError) as error:
            log.warning("%s could not be resumed (%s); the next resync resumes it", engine.url, error)
            return False
        if not reply.ok:
            log.warning("%s refused to resume (%s); the next resync resumes it", engine.url, reply.message)
            return False
        self.paused.pop(engine.url, None)
        return True

    async def lift_pauses(self) -> list[str]:
        """Resume every server in ``paused``; returns the URLs resumed now."""
        return [engine.url for engine in list(self.paused.values()) if await self.resume(engine)]
