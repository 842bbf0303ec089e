"""``evaluate``: run a policy on every (task, repeat) of a task set on a pool of real desktops and report.

The same code path as training rollouts: each desktop is driven by an :class:`actors.env_actor.EnvActor` (pool,
in-place reset, a fresh container after an environment error) running :class:`actors.episode.EpisodeRunner`; only
the work source differs (a local queue instead of the learner) and the trajectories go to the results folder
(:mod:`actors.eval.results`) instead of a learner. Nothing is trained.

Every planned episode ends with a record: a task that does not load, and every episode that ends in ENV_ERROR,
TASK_ERROR or ABORTED (setup failed, desktop died, deadline passed, server unreachable), is a failure with its
reason; if no desktop can be started at all, the episodes still queued are recorded as such errors. With ``out``,
each record is written as its episode ends, so an evaluation cut short (Ctrl-C, a crash) keeps what finished;
``resume=True`` runs only the missing episodes, and the report covers all of them. The results folder is claimed
first (:class:`actors.eval.folder.ResultsFolder`): a resume takes only a folder ``arpo eval`` made, evaluated with
the same parameters, trusts only finished episodes whose files agree, and deletes only its own episode folders.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import random
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from actors.desktop.controller_client import DesktopError
from actors.env_actor import EnvActor
from actors.episode import EpisodeRunner
from actors.eval.report import build_report, write_report
from actors.eval.folder import ResultsFolder, run_params
from actors.eval.provenance import attach_task_hashes, evaluation_provenance
from actors.eval.results import ERROR_OUTCOMES, EpisodeRecord, parse_prefix
from actors.osworld.downloads import run_download_cache
from actors.policy import GenerateFn, Policy
from arpo_async.benchmark_sets import step_budget
from arpo_async.config import RunConfig
from arpo_async.messages import Assignment, Outcome, Trajectory
from arpo_async.model.inputs import PromptEncoder
from arpo_async.task_sets import TaskEntry, duplicate_listings, duplicates_line, load_task_set

log = logging.getLogger(__name__)

DEFAULT_TEMPERATURE = 0.0
"""Greedy decoding by default: the policy's single most likely answer, as OSWorld's UI-TARS agent samples
(``temperature=0.0`` in mm_agents/uitars_agent.py, https://github.com/xlang-ai/OSWorld), so a score does not move
with the sampler's seed. With ``repeats`` > 1, set a temperature above 0 for pass@k to mean anything."""
DEFAULT_REPLY_RETRIES = 2
"""Re-asks after a reply that does not parse (``actors.reply_retries``): 3 tries in all, as OSWorld's UI-TARS agent
(``try_times = 3`` in mm_agents/uitars_agent.py, https://github.com/xlang-ai/OSWorld), so a model that slips once
in its output format is scored as OSWorld's harness scores it; training keeps ARPO's 0 (actors.episode)."""


@dataclass(frozen=True)
class EvalSettings:
    """What to evaluate on, and how (the flags of ``arpo eval``).

    Attributes:
        tasks: a task folder or file, a built-in task/family name, or None for the built-in suite
            (:func:`arpo_async.task_sets.load_task_set`).
        split: a split file ``{domain: [task id]}`` or a built-in split name (None = every task).
        desktops: desktops (EnvActors) at once (>= 1).
        repeats: episodes per task (>= 1).
        max_steps: policy steps per episode (None = the config's ``actors.max_steps``).
        temperature: sampling temperature (:data:`DEFAULT_TEMPERATURE`).
        seed: seeds the order the episodes run in.
        reply_retries: re-asks after a reply that does not parse (:data:`DEFAULT_REPLY_RETRIES`, 0..10); replaces
            ``actors.reply_retries``.
        results_prefix: OSWorld's ``<action space>/<observation type>/<model>`` to write each repeat's episodes
            under (``arpo eval --osworld-prefix``; "" = none), so the folder reads as OSWorld's ``results/`` does
            (:mod:`actors.eval.results`). ValueError for one that is not three plain folder names.
    """

    tasks: str | Path | None = None
    split: str | Path | None = None
    desktops: int = 8
    repeats: int = 1
    max_steps: int | None = None
    temperature: float = DEFAULT_TEMPERATURE
    seed: int = 0
    reply_retries: int = DEFAULT_REPLY_RETRIES
    results_prefix: str = ""

    def __post_init__(self) -> None:
        parse_prefix(self.results_prefix)  # ValueError: one line naming it
        if self.desktops < 1 or self.repeats < 1 or (self.max_steps is not None and self.max_steps < 1):
            raise ValueError(f"desktops, repeats and max_steps must be >= 1; got {self.desktops}, {self.repeats}, "
                             f"{self.max_steps}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0; got {self.temperature}")
        if not 0 <= self.reply_retries <= 10:
            raise ValueError(f"reply_retries must be 0..10; got {self.reply_retries}")

    def apply(self, config: RunConfig) -> RunConfig:
        """``config`` with ``actors.actors``, ``max_steps``, ``temperature`` and ``reply_retries`` replaced by these
        settings."""
        ac = config.actors
        return dataclasses.replace(config, actors=dataclasses.replace(
            ac, actors=self.desktops, max_steps=self.max_steps or ac.max_steps, temperature=self.temperature,
            reply_retries=self.reply_retries))


def claim_results(out: Path, policy: dict, settings: EvalSettings, config: RunConfig, *, resume: bool,
                  entries: list[TaskEntry] | None = None, check_only: bool = False) -> ResultsFolder:
    """Claim the results folder ``out`` for this evaluation (:meth:`actors.eval.folder.ResultsFolder.claim`) with
    its parameters: ``policy`` (kind, name, weight_version), the task set (``entries``, loaded from ``settings``
    when None), ``settings`` and the effective ``config`` (:meth:`EvalSettings.apply`). ``arpo eval`` calls it
    with ``check_only`` (:meth:`ResultsFolder.check <actors.eval.folder.ResultsFolder.check>`: every refusal,
    nothing written) before it builds or starts anything, then to claim the folder before arpo-serve writes its
    log there; :func:`evaluate` again (the same parameters: nothing changes).

    Raises as ``ResultsFolder.claim`` (ResultsFolderError, FileExistsError, OSError) and TaskFormatError."""
    entries = load_task_set(settings.tasks, settings.split) if entries is None else entries
    config = settings.apply(config)
    params = run_params(policy, entries, repeats=settings.repeats, seed=settings.seed,
                        tokenizer=str(config.model_path), success_threshold=config.learner.success_threshold,
                        actors=config.actors, results_prefix=settings.results_prefix)
    return (ResultsFolder.check if check_only else ResultsFolder.claim)(out, params, resume=resume)


def episode_plan(entries: list[TaskEntry], repeats: int, seed: int) -> list[tuple[TaskEntry, int]]:
    """Every (task, repeat) of the evaluation, repeat by repeat, each repeat's tasks in an order shuffled by
    ``seed`` (so the desktops do not run one task's repeats side by side)."""
    plan = []
    rng = random.Random(seed)
    for repeat in range(repeats):
        order = list(entries)
        rng.shuffle(order)
        plan += [(entry, repeat) for entry in order]
    return plan


def record_of(entry: TaskEntry, repeat: int, traj: Trajectory) -> EpisodeRecord:
    """The record of a finished episode of ``entry``."""
    versions = [int(s.versions.max()) for s in traj.steps if len(s.versions)]
    error = ""
    if traj.outcome in ERROR_OUTCOMES:
        error = f"{traj.outcome.value}: {traj.error or 'no reason given'}"
    return EpisodeRecord(
        domain=entry.domain, task_id=entry.task_id, repeat=repeat,
        score=float(traj.score) if not error else 0.0, success=traj.outcome is Outcome.SUCCESS,
        outcome=traj.outcome.value, error=error, steps=len(traj.steps),
        policy_version=max(versions) if versions else None,
        seconds=traj.timings.get("episode_s", 0.0) + traj.timings.get("reset_s", 0.0),
        instruction=entry.task.instruction if entry.task is not None else "")


def error_record(entry: TaskEntry, repeat: int, outcome: Outcome, error: str) -> EpisodeRecord:
    """The record of an episode that could not run (its task did not load, no desktop could be started)."""
    return EpisodeRecord(domain=entry.domain, task_id=entry.task_id, repeat=repeat, score=0.0, success=False,
                         outcome=outcome.value, error=f"{outcome.value}: {error}",
                         instruction=entry.task.instruction if entry.task is not None else "")


class _LocalWork:
    """The EnvActors' work source: the queue of planned episodes; trajectories come back to ``finish``."""

    def __init__(self, plan: list[tuple[TaskEntry, int]], finish: Callable[[TaskEntry, int, Trajectory], Any]):
        self.actor_id = "eval"
        self.running = 0
        self._queue = collections.deque(enumerate(plan))
        self._issued: dict[str, tuple[TaskEntry, int]] = {}
        self._finish = finish

    def take_rest(self) -> list[tuple[TaskEntry, int]]:
        """Remove and return the episodes never handed out."""
        rest = [item for _, item in self._queue]
        self._queue.clear()
        return rest

    async def request_work(self) -> Assignment | None:
        if not self._queue:
            return None
        index, (entry, repeat) = self._queue.popleft()
        group_id = f"eval-{index}"
        self._issued[group_id] = (entry, repeat)
        assert entry.task is not None
        return Assignment(request_id=group_id, task=entry.task.to_dict(), group_id=group_id, rollout_index=repeat,
                          policy_version=0)

    async def submit(self, trajectory: Trajectory) -> None:
        entry, repeat = self._issued.pop(trajectory.group_id)
        await self._finish(entry, repeat, trajectory)


RATE_AFTER_S = 10.0
"""The progress line shows a rate (and an ETA) once the session has run this long."""


class Progress:
    """Counts of a running evaluation, given to the ``progress`` callback after each episode.

    Attributes:
        planned: episodes in the evaluation; done: finished (including those finished before a resume);
        successes, errors: of the finished; started: monotonic start of this session;
        session_done: episodes finished in this session; busy_s: desktop-seconds spent in this session's
        episodes (reset + setup + steps + evaluation).
    """

    def __init__(self, planned: int, done: list[EpisodeRecord], desktops: int) -> None:
        self.planned, self.desktops = planned, desktops
        self.done = len(done)
        self.successes = sum(r.success for r in done)
        self.errors = sum(r.errored for r in done)
        self.started = time.monotonic()
        self.session_done = 0
        self.busy_s = 0.0

    def add(self, record: EpisodeRecord) -> None:
        self.done += 1
        self.session_done += 1
        self.successes += record.success
        self.errors += record.errored
        self.busy_s += record.seconds

    def line(self) -> str:
        """``[12/40] success 7/12 (58%) | errors 1 | 3.2 episodes/min | ETA 9 min``."""
        elapsed = time.monotonic() - self.started
        rate = self.session_done / elapsed * 60 if elapsed >= RATE_AFTER_S else 0.0
        left = self.planned - self.done
        eta = f"{left / rate:.0f} min" if rate > 0 else "?"
        pct = f"{100 * self.successes / self.done:.0f}%" if self.done else "-"
        speed = f"{rate:.1f} episodes/min" if rate > 0 else "episodes/min: measuring"
        return (f"[{self.done}/{self.planned}] success {self.successes}/{self.done} ({pct}) | errors {self.errors} | "
                f"{speed} | ETA {eta}")

    def throughput(self) -> dict:
        """This session's episodes per minute and desktop utilisation (busy desktop-seconds over desktops x wall
        seconds; 1.0 = every desktop always in an episode)."""
        wall = time.monotonic() - self.started
        return {"episodes": self.session_done, "wall_s": round(wall, 2),
                "episodes_per_min": round(self.session_done / wall * 60, 3) if wall > 0 else None,
                "desktops": self.desktops,
                "desktop_busy": round(self.busy_s / (self.desktops * wall), 3) if wall > 0 else None}


def policy_identity(policy: Policy | GenerateFn) -> dict:
    """The policy's identity recorded in the results folder when ``meta`` names none: its class (or function)."""
    kind = policy if callable(policy) and not hasattr(policy, "generate") else type(policy)
    return {"kind": "python", "name": f"{kind.__module__}.{kind.__qualname__}", "weight_version": None}


async def evaluate(policy: Policy | GenerateFn, tasks: str | Path | None = None, *, split: str | Path | None = None,
                   desktops: int = 8, repeats: int = 1, max_steps: int | None = None,
                   temperature: float = DEFAULT_TEMPERATURE, seed: int = 0, out: str | Path | None = None,
                   resume: bool = False, config: RunConfig | None = None, encoder: PromptEncoder | None = None,
                   meta: dict | None = None, progress: Callable[[Progress], None] | None = None,
                   retry_errors: bool = False, reply_retries: int = DEFAULT_REPLY_RETRIES,
                   results_prefix: str = "") -> dict:
    """Score ``policy`` on a task set with real desktops; returns the report (:mod:`actors.eval.report`).

    Args:
        policy: a Policy (PolicyClient, OpenAIChatPolicy, your own) or an async callable
            (:func:`actors.policy.as_policy`).
        tasks, split, desktops, repeats, max_steps, temperature, seed, reply_retries: see :class:`EvalSettings`.
        out: the results folder (:mod:`actors.eval.results`: OSWorld's layout, one root per repeat when
            ``repeats`` > 1; plus report.json and report.md over every repeat); None = keep nothing on disk.
        results_prefix: see :class:`EvalSettings`.
        resume: keep the finished episodes in ``out`` and run only the missing ones (without it, an ``out`` that
            holds results is refused). Only a folder that ``evaluate`` created (its ``arpo-eval.json``), evaluated
            with the same parameters (:func:`actors.eval.folder.run_params`), is resumed; a finished episode whose
            files disagree is run again, with a warning naming it.
        config: the run config whose ``actors`` section sets the desktops (image, screen, memory), the prompt and
            the grammar (default: every key's default); ``actors.actors``, ``max_steps`` and ``temperature`` are
            replaced by the arguments.
        encoder: the policy's prompt encoder (default: ``PromptEncoder(config.model_path)``).
        meta: copied into the report (``policy``, ``command``: what ``arpo eval`` records).
        progress: called after each finished episode.
        retry_errors: with ``resume``, also run again the finished episodes that ended in an error outcome
            (ENV_ERROR, TASK_ERROR, ABORTED: e.g. the server was down).

    Raises:
        arpo_async.tasks.TaskFormatError: the task folder or split cannot be read (a single task that does not
            load is not an error: it is a failed episode).
        FileExistsError: ``out`` holds results and ``resume`` is False.
        actors.eval.folder.ResultsFolderError: ``out`` is not ours (``resume`` on a folder without a manifest, or a
            non-empty foreign folder), its parameters differ, or an episode would be written through a symbolic
            link (a ValueError: ``arpo eval`` exits 2); nothing in ``out`` is changed.
        ValueError: a bad setting.
        asyncio.CancelledError: cancelled (Ctrl-C): the finished episodes are on disk and the report of them is
            written first.
    """
    settings = EvalSettings(tasks, split, desktops, repeats, max_steps, temperature, seed, reply_retries,
                            results_prefix)
    entries = load_task_set(settings.tasks, settings.split)
    if deduplicated := duplicate_listings(entries):
        log.warning("%s", duplicates_line(deduplicated))  # once per evaluation, on stderr
    config = settings.apply(config or RunConfig())
    config = dataclasses.replace(config, run_id=config.run_id or f"eval-{secrets.token_hex(3)}")
    ac = config.actors
    out_path = Path(out) if out is not None else None
    done: dict[tuple[str, str, int], EpisodeRecord] = {}
    folder = None
    if out_path is not None:
        folder = claim_results(out_path, (meta or {}).get("policy") or policy_identity(policy), settings, config,
                               resume=resume, entries=entries)
        folder.clear_unfinished()
        done = folder.finished(ac.max_steps) if resume else {}
        if retry_errors:
            done = {key: record for key, record in done.items() if not record.errored}
    planned = episode_plan(entries, settings.repeats, settings.seed)
    keys = {(e.domain, e.task_id, r) for e, r in planned}
    done = {key: record for key, record in done.items() if key in keys}
    plan = [(e, r) for e, r in planned if (e.domain, e.task_id, r) not in done]
    for entry, repeat in plan if folder is not None else []:
        folder.check_writable((entry.domain, entry.task_id, repeat))  # before any episode runs
    provenance = await evaluation_provenance(folder, entries, config, repeats=settings.repeats, seed=settings.seed,
                                             policy=(meta or {}).get("policy") or policy_identity(policy))
    records = dict(done)
    counts = Progress(len(entries) * settings.repeats, list(done.values()), settings.desktops)
    report_meta = {"tasks": str(settings.tasks or "builtin"), "split": None if settings.split is None
                   else str(settings.split), "settings": {
                       "desktops": settings.desktops, "repeats": settings.repeats, "max_steps": ac.max_steps,
                       "temperature": settings.temperature, "seed": settings.seed,
                       "reply_retries": settings.reply_retries},
                   "step_budget": step_budget(ac.max_steps), "deduplicated": deduplicated, **(meta or {}),
                   "provenance": provenance}

    async def finish(record: EpisodeRecord, traj: Trajectory | None) -> None:
        if folder is not None:
            await asyncio.to_thread(folder.write_episode, record, traj)
        records[record.key] = record
        counts.add(record)
        if progress is not None:
            progress(counts)

    try:
        for entry, repeat in [item for item in plan if item[0].task is None]:
            await finish(error_record(entry, repeat, Outcome.TASK_ERROR, entry.error), None)
        runnable = [item for item in plan if item[0].task is not None]
        if runnable:
            await _run_episodes(runnable, config, encoder or PromptEncoder(config.model_path), policy,
                                lambda e, r, t: finish(record_of(e, r, t), t))
    finally:
        report = build_report(records.values(), repeats=settings.repeats, planned=counts.planned,
                              meta={**report_meta, "throughput": counts.throughput()},
                              tasks=[(e.domain, e.task_id) for e in entries],
                              threshold=config.learner.success_threshold)
        attach_task_hashes(report)
        if out_path is not None:
            write_report(out_path, report)
    return report


async def _run_episodes(plan: list[tuple[TaskEntry, int]], config: RunConfig, encoder: PromptEncoder,
                        policy: Policy | GenerateFn, finish: Callable[[TaskEntry, int, Trajectory], Any]) -> None:
    """Run ``plan`` on ``config.actors.actors`` EnvActors over one desktop pool; record the episodes no desktop
    could be found for as ENV_ERROR; remove every desktop on the way out."""
    from actors.main import desktop_pool  # the actor host's own pool, as the run config says

    ac = config.actors
    downloads = run_download_cache(config.run_dir, config.learner.osworld_files, ac.download_max_mb,
                                   ac.download_timeout_s)
    runner = EpisodeRunner(encoder, policy, ac, downloads, config.learner.success_threshold,
                           keep_final_screenshot=True)  # the last action's after-screen, for traj.jsonl
    work = _LocalWork(plan, finish)
    pool = desktop_pool(config)
    fleet = pool.fleet
    failures: list[str] = []

    async def actor(index: int) -> None:
        try:
            await EnvActor(index, work, pool, runner).run()
        except DesktopError as exc:  # this actor found no desktop several times in a row; the others go on
            failures.append(str(exc))
            log.error("evaluation actor %d stopped: %s", index, exc)

    pool.start()
    try:
        async with asyncio.TaskGroup() as actors:
            for index in range(min(ac.actors, len(plan))):
                actors.create_task(actor(index))
        for entry, repeat in work.take_rest():
            await finish(entry, repeat, Trajectory(
                trajectory_id="", actor_id="eval", task_id=entry.task_id, group_id="", rollout_index=repeat,
                outcome=Outcome.ENV_ERROR, score=0.0, format_ok=True, steps=[], screenshots=[],
                error=f"DesktopError: no desktop could be started: {failures[-1] if failures else ''}"))
    finally:
        try:
            await pool.close()
        finally:
            await fleet.remove_all()
            await fleet.close()
