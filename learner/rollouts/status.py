"""Status assembly: the learner's counters for metrics records and its snapshot for status.json.

Role: reads, never changes, what the rollouts room holds (learner.rollouts.service.LearnerService builds one as
``service.report``): the run's state (learner.state.RunState: step, counters, drops), the statistics
(learner.rollouts.run_stats.RunStats: rejections, queue peaks, loop lag, the stall), the actors
(learner.rollouts.peers.Peers), the admission rule, the round control (learner.rollouts.rounds.RoundControl: the
task selector, the task pre-pass, the evaluation rounds) and the queues around the service. The training loop takes
:meth:`StatusReport.counters` into each metrics record (learner.train.records.step_record); the run writes
:meth:`StatusReport.status` to <run>/status.json (learner.run.Run.status).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from arpo_async.transport import Envelope, Outbox
from learner.rollouts.peers import Admission, Peers
from learner.rollouts.rounds import RoundControl
from learner.rollouts.run_stats import RunStats
from learner.state import RunState


class StatusReport:
    """Assembles the learner's counters and status snapshot; see the module docstring.

    Args:
        learner_id: this learner's id (status.json ``learner_id``).
        state: the run's state.
        stats: the service's statistics.
        peers: the service's actors (depths, waiting requests, the announced version).
        admission: the admission rule (``running``).
        rounds: the round control (task selector, task pre-pass, evaluation rounds).
        outbox: the ROUTER pump's outbox (its depth and full waits).
        ready_groups: how many complete groups wait to be trained on.
        message_counts: the ROUTER pump's messages by type (``messages``; None: left out).
    """

    def __init__(self, learner_id: str, state: RunState, stats: RunStats, peers: Peers, admission: Admission,
                 rounds: RoundControl, outbox: Outbox, ready_groups: Callable[[], int],
                 message_counts: Callable[[], dict[str, dict[str, int]]] | None = None) -> None:
        self.learner_id = learner_id
        self.state = state
        self.stats = stats
        self.peers = peers
        self.admission = admission
        self.rounds = rounds
        self.outbox = outbox
        self._ready_groups = ready_groups
        self.message_counts = message_counts
        self.inbox: asyncio.Queue[Envelope] | None = None
        """The inbox the service consumes (for its depth; set by learner.rollouts.service.LearnerService.serve)."""
        self.stopped = ""
        """Why the run ended early (the training loop's solved line; in status.json as ``stopped``), else ""."""

    def queue_depths(self) -> dict[str, int]:
        """Queue depths now (metrics.jsonl ``queues``): the learner's ``inbox`` (messages received, not yet
        handled), ``waiting_requests`` (work requests not yet admitted) and ``waiting_max_peer`` (the longest
        single peer's), ``running`` (rollouts out), ``ready_groups`` (complete groups not yet trained on),
        ``outbox`` (messages queued for the socket) and ``outbox_full_waits`` (sends that found it full), and,
        over the actors heard from, their last Heartbeat's ``actor_running``, ``actor_waiting``, ``actor_unacked``
        (trajectories not yet acked) and ``actor_outbox`` (summed), and ``actor_outbox_max``
        (learner.rollouts.peers.Peers.depths)."""
        return {"inbox": self.inbox.qsize() if self.inbox is not None else 0, **self.peers.depths(),
                "ready_groups": self._ready_groups(), "outbox": self.outbox.qsize(),
                "outbox_full_waits": self.outbox.full_waits}

    def counters(self) -> dict[str, Any]:
        """The counters a metrics record carries now (learner.train.records.step_record's ``counters``); takes the
        window of the loop-lag probe (``loop_lag_ms``) and of the queue peaks (``queues_max``), so each record
        covers the time since the previous one."""
        selector = self.rounds.selector
        return {"task_selection": selector.stats() if selector is not None else {},
                "drops": dict(self.state.drops), "totals": dict(self.state.totals),
                "rejections": dict(self.stats.rejections), "queues": self.queue_depths(),
                "queues_max": self.stats.take_peaks(), "loop_lag_ms": self.stats.lag.take(),
                **({"messages": self.message_counts()} if self.message_counts is not None else {})}

    def status(self) -> dict:
        """A snapshot for progress displays (written to <run>/status.json by
        learner.rollouts.run_stats.write_status)."""
        totals, prepass, selector = self.state.totals, self.rounds.prepass, self.rounds.selector
        return {"learner_id": self.learner_id, "policy_version": self.peers.announced_version,
                "stall": self.stats.stall,
                "trajectories": totals["trajectories"],
                "from_desktop": totals["from_desktop"], "running": self.admission.running,
                "step": self.state.step,
                "waiting_requests": self.peers.waiting_count, "actors": len(self.peers.actors),
                "outcomes": {k: v for k, v in totals.items() if k.isupper()},
                "drops": dict(self.state.drops), "ready_groups": self._ready_groups(),
                "queues": self.queue_depths(), "queues_max": dict(self.stats.run_peak_depths),
                "loop_lag_ms": self.stats.lag.summary(), "loop_lag_buckets": self.stats.lag.buckets(),
                **({"messages": self.message_counts()} if self.message_counts is not None else {}),
                "totals": dict(totals), "wall_s": self.stats.wall_s,
                "set_aside": selector.set_aside if selector is not None else [],
                "solved": selector.retired if selector is not None else [],
                "zero_variance_since_step": self.stats.zero_variance_since_step,
                **({"stopped": self.stopped} if self.stopped else {}),
                **({"evaluation": self.rounds.evaluation.status()} if self.rounds.evaluation is not None else {}),
                # the task pre-pass's progress (status.json files of runs before issue 52 named it "baseline")
                **({"prepass": {"groups_recorded": prepass.recorded_groups,
                                 "groups_planned": prepass.planned_groups}} if prepass else {})}
