"""Task-set coverage: which tasks of a file or folder load, set up in a real desktop, and evaluate untouched.

``arpo tasks check PATH`` and ``bench/osworld_coverage.py`` are built on this module. For one task file, or every
``*.json`` under a folder (OSWorld's layout: ``examples/<domain>/<id>.json``, so the domain is the file's parent
folder):

1. **load**: :func:`arpo_async.tasks.load_task_file` (format, caps, and the setup types, getters and metrics our
   evaluator implements). A task that does not load gets the rejection's kind (``format``, ``setup_type``,
   ``getter``, ``metric``, ...; :func:`rejection_kind`) and message.
2. **set up** (only with desktops): a fresh desktop per task, then :func:`actors.evaluation.run_setup` on the
   task's ``config``. A failure is classified (:func:`setup_failure_kind`): ``needs_network`` (a download
   that neither the local mirror nor the network could serve), ``app_missing`` (a command the image lacks),
   else ``setup_failed``, with the step's error.
3. **evaluate untouched**: :func:`actors.evaluation.evaluate` with no action taken (``last_action=None``),
   as OSWorld scores an agent that did nothing. An error is ``needs_network`` / ``app_missing`` when that is
   the cause (:func:`evaluate_failure_kind`), else ``eval_failed``; a score other than 0 is
   reported as ``scored_untouched`` (OSWorld's evaluator gives 0 to an untouched task, infeasible ones
   included: those score 1 only when the agent's last action is FAIL).

Nothing here changes a task file. Desktops are removed after each task, whatever happens.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from arpo_async.tasks import Task, TaskFormatError, read_task_json

from actors.desktop.controller_client import DesktopError
from actors.desktop.fleet import DesktopFleet
from actors.evaluation import EvaluationError, TaskSetupError, evaluate, metric_option_problems, run_setup
from actors.osworld.downloads import DownloadCache
from actors.osworld.setup import SetupContext

STAGES = ("load", "setup", "evaluate", "ok")
"""How far a task got: ``load`` (rejected when loading), ``setup``/``evaluate`` (failed there), ``ok``."""
TASK_TIMEOUT_S = 300.0
"""Longest one task's desktop start, setup and evaluation may take together before it is reported failed."""


@dataclass
class TaskReport:
    """What happened to one task file.

    Attributes:
        path: the task file.
        domain: its parent folder's name (OSWorld's domain: os, chrome, gimp, ...).
        task_id: the task's id (from the JSON when it parses, else the file's stem).
        stage: the furthest stage reached (:data:`STAGES`); ``load`` until desktops ran it.
        reason: why it stopped there: a kind such as ``format``, ``setup_type``, ``getter``, ``metric``,
            ``needs_network``, ``app_missing``, ``setup_failed``, ``desktop_failed``, ``timeout``, ``eval_failed``,
            ``scored_untouched``;
            None when nothing went wrong.
        detail: the error message (empty when none).
        score: the untouched score in [0, 1] once evaluated, else None.
        seconds: wall time of the desktop part (start, setup, evaluation), 0 when not run.
    """

    path: str
    domain: str
    task_id: str
    stage: str = "load"
    reason: str | None = None
    detail: str = ""
    score: float | None = None
    seconds: float = 0.0

    def progress_line(self) -> str:
        """One line for progress output: ``  domain/id: stage[: reason] (seconds)``."""
        return f"  {self.domain}/{self.task_id}: {self.stage}{': ' + self.reason if self.reason else ''} " \
               f"({self.seconds:.1f} s)"

    @property
    def loaded(self) -> bool:
        return not (self.stage == "load" and self.reason is not None)


def rejection_kind(exc: TaskFormatError) -> str:
    """The kind of a load-time rejection: ``format`` for a malformed file, else the missing part's kind
    (``setup_type``, ``getter``, ``metric``: arpo_async.task_checks.UnsupportedTask)."""
    return getattr(exc, "kind", "format") or "format"


def setup_failure_kind(exc: BaseException) -> str:
    """``needs_network``, ``app_missing`` or ``setup_failed`` for a failed setup: the kind the setup step gave
    (actors.osworld.setup.TaskSetupError.kind); ``setup_failed`` for anything else (a desktop that stopped
    answering)."""
    return getattr(exc, "kind", "setup_failed") or "setup_failed"


def evaluate_failure_kind(exc: BaseException) -> str:
    """``needs_network`` or ``app_missing`` for an evaluation that failed for that reason (a postconfig step or
    a ``cloud_file`` getter that needed a download, an app the image lacks), else ``eval_failed``."""
    kind = getattr(exc, "kind", None)
    if kind in ("needs_network", "app_missing"):
        return kind
    return "needs_network" if "needs network" in str(exc) else "eval_failed"


def task_files(path: str | Path) -> list[Path]:
    """The task files to check: ``path`` itself when it is a file, else every ``*.json`` under the folder
    ``path`` (recursively, sorted). Raises FileNotFoundError when ``path`` does not exist and ValueError for a
    folder with no ``*.json`` file."""
    root = Path(path)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such file or folder")
    files = sorted(p for p in root.rglob("*.json") if p.is_file())
    if not files:
        raise ValueError(f"{root}: no *.json task files in this folder")
    return files


def repeated_ids(files: Iterable[Path]) -> frozenset[str]:
    """The ``id`` fields more than one of ``files`` carries (files that do not parse, or carry no string id, are
    skipped). In OSWorld's examples 11 thunderbird files repeat chrome tasks' ids (4 of them in ARPO's 128:
    thunderbird/3f28fe4f-..., a10b69e1-..., a1af9f1c-..., dfac9ee8-...)."""
    counts = Counter()
    for path in files:
        try:
            data = read_task_json(path)
        except TaskFormatError:
            continue
        if isinstance(data, dict) and isinstance(data.get("id"), str):
            counts[data["id"]] += 1
    return frozenset(i for i, n in counts.items() if n > 1)


def check_load(files: Iterable[Path], repeated: frozenset[str] = frozenset()) -> tuple[list[TaskReport],
                                                                                        dict[str, Task]]:
    """Load every file; return one report per file (in order) and the loaded tasks by report path.

    A task whose ``id`` is one of ``repeated`` (:func:`repeated_ids` over the whole folder) and is not its file's
    name is named by its file, task id and ``raw["id"]`` alike, by the rule training, ``arpo eval`` and the
    mirror generators apply (:func:`arpo_async.task_sets.unique_ids`), so its setup looks its files up in a
    mirror where those put them (``<domain>/<file name>/<name>``)."""
    reports: list[TaskReport] = []
    tasks: dict[str, Task] = {}
    for path in files:
        report = TaskReport(path=str(path), domain=path.parent.name, task_id=path.stem)
        try:
            data = read_task_json(path)  # the loader's own bounded, hardened parse: never raises anything else
            if isinstance(data, dict) and isinstance(data.get("id"), str) and data["id"]:
                report.task_id = path.stem if data["id"] in repeated else data["id"]  # even when refused
            task = Task.from_dict(data, source=str(path), check_names=True, folder=path.parent)
            if task.id in repeated and task.id != path.stem:
                task = replace(task, id=path.stem, raw={**task.raw, "id": path.stem})
        except TaskFormatError as exc:
            report.reason, report.detail = rejection_kind(exc), str(exc)
        else:
            report.task_id = task.id
            if problems := metric_option_problems(task):  # a native metric would raise TypeError every episode
                report.reason, report.detail = "metric_options", "; ".join(problems)
                reports.append(report)
                continue
            tasks[report.path] = task
        reports.append(report)
    return reports, tasks


async def _run_one(fleet: DesktopFleet, task: Task, report: TaskReport, downloads: DownloadCache) -> None:
    t0 = time.monotonic()
    desktop = None
    try:
        async with asyncio.timeout(TASK_TIMEOUT_S):
            try:
                desktop = await fleet.start()
            except DesktopError as exc:
                report.stage, report.reason, report.detail = "setup", "desktop_failed", str(exc)
                return
            try:
                await run_setup(desktop.controller, task.config, SetupContext(downloads, task.id))
            except (TaskSetupError, DesktopError) as exc:
                report.stage, report.reason, report.detail = "setup", setup_failure_kind(exc), str(exc)
                return
            try:
                score = await evaluate(desktop.controller, task, None, downloads)
            except (EvaluationError, TaskSetupError, DesktopError) as exc:
                report.stage, report.reason, report.detail = "evaluate", evaluate_failure_kind(exc), str(exc)
                return
            report.score = score
            if score != 0.0:
                report.stage, report.reason = "evaluate", "scored_untouched"
                report.detail = f"scored {score:g} with no action taken (OSWorld gives 0)"
            else:
                report.stage = "ok"
    except TimeoutError:
        report.stage = "setup" if report.stage == "load" else report.stage
        report.reason, report.detail = "timeout", f"desktop start, setup and evaluation took over {TASK_TIMEOUT_S:g} s"
    finally:
        report.seconds = time.monotonic() - t0
        if desktop is not None:
            await fleet.remove(desktop)


async def check_in_desktops(fleet: DesktopFleet, reports: list[TaskReport], tasks: dict[str, Task], *,
                            desktops: int = 2, downloads: DownloadCache | None = None,
                            progress: Callable[[TaskReport], None] | None = None) -> None:
    """Set up and evaluate every loaded task in its own fresh desktop, ``desktops`` at a time; fills in the
    reports in place and calls ``progress(report)`` after each task. ``downloads``: where ``download`` steps
    fetch from (default ``DownloadCache()``: ~/.cache/arpo/downloads, no mirror). Raises ValueError for
    ``desktops`` < 1."""
    if desktops < 1:
        raise ValueError(f"desktops must be >= 1, got {desktops}")
    gate = asyncio.Semaphore(desktops)
    downloads = downloads or DownloadCache()

    async def one(report: TaskReport) -> None:
        async with gate:
            await _run_one(fleet, tasks[report.path], report, downloads)
        if progress is not None:
            progress(report)

    await asyncio.gather(*(one(r) for r in reports if r.path in tasks))


def domain_table(reports: list[TaskReport], *, ran_desktops: bool) -> list[dict]:
    """Per-domain counts, sorted by domain, plus a final ``all`` row: ``domain``, ``tasks``, ``load``, and
    with desktops ``setup`` (set up without an error) and ``evaluate`` (evaluated without an error, score 0)."""
    rows: dict[str, Counter] = {}
    for r in reports:
        for key in (r.domain, "all"):
            c = rows.setdefault(key, Counter())
            c["tasks"] += 1
            c["load"] += r.loaded
            if ran_desktops and r.loaded:
                c["setup"] += r.stage in ("evaluate", "ok")
                c["evaluate"] += r.stage == "ok"
    order = sorted(k for k in rows if k != "all") + ["all"]
    cols = ("tasks", "load", "setup", "evaluate") if ran_desktops else ("tasks", "load")
    return [{"domain": k, **{c: rows[k][c] for c in cols}} for k in order]


def format_report(reports: list[TaskReport], *, ran_desktops: bool) -> str:
    """The per-domain table, the reasons by kind, then one line per task that did not pass every stage."""
    table = domain_table(reports, ran_desktops=ran_desktops)
    cols = list(table[0])
    width = {c: max(len(c), *(len(str(row[c])) for row in table)) for c in cols}
    lines = ["  ".join(f"{c:<{width[c]}}" if c == "domain" else f"{c:>{width[c]}}" for c in cols)]
    lines += ["  ".join(f"{row[c]!s:<{width[c]}}" if c == "domain" else f"{row[c]!s:>{width[c]}}" for c in cols)
              for row in table]
    kinds = Counter(r.reason for r in reports if r.reason)
    if kinds:
        lines.append("")
        lines.append("reasons: " + ", ".join(f"{k} {n}" for k, n in kinds.most_common()))
        lines.append("")
        for r in reports:
            if r.reason:
                lines.append(f"{r.domain}/{r.task_id}: {r.stage}: {r.reason}: {r.detail}")
    return "\n".join(lines)


def write_json(reports: list[TaskReport], path: str | Path) -> None:
    """Every report as a JSON list (one object per task file)."""
    Path(path).write_text(json.dumps([asdict(r) for r in reports], indent=1) + "\n")


async def check_folder(path: str | Path, *, desktops: int = 0, image: str | None = None,
                       run_id: str = "tasks-check", memory_mb: int = 512, keep: set[str] | None = None,
                       downloads: DownloadCache | None = None,
                       progress: Callable[[TaskReport], None] | None = None) -> list[TaskReport]:
    """Load the task file ``path``, or every task under the folder ``path`` (:func:`task_files`), and, when
    ``desktops`` > 0, set up and evaluate each loaded one in a
    fresh desktop from ``image`` (``desktops`` at a time, containers of ``memory_mb`` MiB). Returns the reports
    in file order.

    Raises FileNotFoundError / ValueError for a missing path or an empty folder; ValueError when desktops > 0 and
    no image is given. A desktop that cannot start is reported per task (``desktop_failed``).
    """
    files = task_files(path)
    reports, tasks = check_load((f for f in files if keep is None or str(f) in keep), repeated_ids(files))
    if desktops > 0:
        if not image:
            raise ValueError("an image is needed to run tasks in desktops")
        fleet = DesktopFleet(image, run_id, memory_mb=memory_mb)
        try:
            await check_in_desktops(fleet, reports, tasks, desktops=desktops, downloads=downloads, progress=progress)
        finally:
            await fleet.remove_all()
            await fleet.close()
    return reports
