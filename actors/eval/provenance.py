"""Provenance of an evaluation: what produced a report, so two reports can be told apart and one reproduced.

``report.json`` carries it under ``"provenance"`` (and ``report.md`` in its header)::

    {"date": first session's date, "commit": ..., "version": ..., "image": ..., "image_id": ...,
     "sessions": [Session, ...],             the first session first, then one per resume
     "warnings": [str, ...],                 e.g. the sessions ran different commits or desktop images
     "policy": {"kind", "name", "weight_version", "weights" | "url", ...},
     "task_hash": how a task's hash is taken (below),
     "task_sha256": {"<domain>/<task id>": sha256}, "task_set_sha256": sha256,
     "settings": {"repeats": K, "seed": S, "actors.max_steps": N, ...}}

and each ``tasks_detail`` entry its ``"task_sha256"``. A Session is ``{"date", "commit", "dirty", "version",
"image", "image_id"}``:

- ``date``: when the session started, UTC ISO 8601 (``2025-01-31T12:00:00+00:00``);
- ``commit``: ``git rev-parse HEAD`` of the source tree this code runs from, when that folder is the top of a git
  checkout (``git`` is run if present, with a 5 s limit), else "unknown"; ``dirty``: that checkout has
  uncommitted changes to tracked files (None when unknown); ``version``: the installed ``arpo-async`` version;
- ``image``: the desktop image's name (``actors.image``, else the tag of ``actors.image_profile``, as
  ``actors.main.desktop_pool`` picks it); ``image_id``: the Docker image id (``sha256:...``) that name resolves to
  when the session starts (aiodocker's image inspect), else "unknown".

The sessions live in the results folder's manifest (``arpo-eval.json``, :meth:`actors.eval.folder.ResultsFolder.
add_session`), not in report.json: the manifest is written before any episode runs, is what a resume already reads
and trusts, and is ours alone, whereas report.json is written when a session ends (a killed session leaves none)
and is a file users copy and edit. A folder made before sessions were recorded starts its list at the resume.

A task's hash is the sha256 of its canonical JSON (the task as loaded, keys sorted, ASCII;
:func:`actors.eval.folder.task_digest`, the hash the manifest pins for a resume), not of its file's bytes: two
files that say the same task hash alike. A task that does not load is hashed by its load error. The set's hash is
the sha256 of the lines ``"<domain>/<task id> <sha256>\\n"`` in sorted order.

The settings that change a score (:func:`score_settings`), flat, by config key:

- what each episode is: ``repeats``, ``seed`` (episode order and arpo-serve's sampler), ``model`` (the prompt's
  tokenizer), ``learner.success_threshold`` (the success rate's threshold);
- what the policy sees and may say (the manifest's ``actors.eval.folder.RESULT_ACTORS_KEYS``): ``actors.``
  max_steps, history_images, max_new_tokens, temperature, top_p, constrained (the grammar on/off),
  grammar_actions, max_thought_chars, coordinate_mode, fixed_width_coordinates, prompt_style, screen_width,
  screen_height, image, image_profile, screenshot_format, screenshot_quality, action_backend;
- when an episode errors (an errored episode scores 0): ``actors.`` settle_interval_s, settle_timeout_s,
  policy_attempts, policy_timeout_s, setup_timeout_s, step_timeout_s, desktop_memory_mb, desktop_pids,
  desktop_max_episodes, download_max_mb, download_timeout_s;
- for a policy served by ``arpo eval --model``: ``serve.dtype`` and ``serve.device`` (the numerics of sampling).

Desktops at once, warm spares, start slots and ports change how fast an evaluation runs, not its scores.
"""
from __future__ import annotations

import asyncio
import datetime
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

from actors.eval.folder import RESULT_ACTORS_KEYS, task_digest

log = logging.getLogger(__name__)

SOURCE_ROOT = Path(__file__).resolve().parents[2]
"""The folder this code runs from (the repository root of a checkout; site-packages when installed)."""
UNKNOWN = "unknown"
GIT_TIMEOUT_S = 5.0
DOCKER_TIMEOUT_S = 10.0
TASK_HASH = ("sha256 of the task's canonical JSON (the task as loaded, keys sorted, ASCII), of its load error when "
             "it does not load; set: sha256 of the sorted lines '<domain>/<task id> <sha256>\\n'")
ERROR_ACTORS_KEYS = ("settle_interval_s", "settle_timeout_s", "policy_attempts", "policy_timeout_s",
                     "setup_timeout_s", "step_timeout_s", "desktop_memory_mb", "desktop_pids",
                     "desktop_max_episodes", "download_max_mb", "download_timeout_s")
"""The ``[actors]`` keys that decide whether an episode errors (module docstring)."""
SESSION_CHECKS = (("commit", "commit"), ("image_id", "desktop image"))
"""Session fields that must agree across the sessions of one evaluation, and their names in the warning."""


def utc_now() -> str:
    """The current time, UTC, ISO 8601 to the second (``2025-01-31T12:00:00+00:00``)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _git(root: Path, *args: str) -> str | None:
    git = shutil.which("git")
    if git is None:
        return None
    try:  # no optional locks: never take the index lock of a checkout someone is committing in
        done = subprocess.run([git, "--no-optional-locks", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def source_commit(root: Path = SOURCE_ROOT) -> tuple[str, bool | None]:
    """``(commit, dirty)`` of the git checkout whose top folder is ``root``: ``git rev-parse HEAD`` and whether
    tracked files differ from it; ``("unknown", None)`` when ``root`` is not the top of a checkout (an installed
    package inside some other repository's folder is not that repository's code), git is missing, or it fails or
    takes over :data:`GIT_TIMEOUT_S` seconds."""
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or os.path.realpath(top) != os.path.realpath(root):
        return UNKNOWN, None
    commit = _git(root, "rev-parse", "HEAD")
    if not commit:
        return UNKNOWN, None
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    return commit, None if status is None else bool(status)


def package_version() -> str:
    """The installed ``arpo-async`` version, or "unknown"."""
    from importlib import metadata

    try:
        return metadata.version("arpo-async")
    except metadata.PackageNotFoundError:
        return UNKNOWN


async def image_id(image: str, timeout_s: float = DOCKER_TIMEOUT_S) -> str:
    """The Docker image id (``sha256:...``) of the image called ``image`` on the local engine (aiodocker's
    ``images.inspect``, the API ``docker image inspect`` uses), or "unknown" when there is no such image or the
    engine does not answer within ``timeout_s`` (a warning says why)."""
    import aiodocker
    import aiohttp

    try:
        async with asyncio.timeout(timeout_s):
            async with aiodocker.Docker() as docker:
                found = await docker.images.inspect(image)
        ident = found.get("Id") if isinstance(found, dict) else None
        if isinstance(ident, str) and ident:
            return ident
        raise ValueError("the engine's answer has no Id")
    except (aiodocker.exceptions.DockerError, aiohttp.ClientError, OSError, ValueError, TimeoutError) as exc:
        log.warning("desktop image %s: its id is unknown (%s); the report records 'unknown'", image, exc)
        return UNKNOWN


async def collect_session(image: str) -> dict:
    """This session's entry (module docstring): date, commit, dirty, version, image, image_id."""
    date = utc_now()
    commit, dirty = await asyncio.to_thread(source_commit)
    return {"date": date, "commit": commit, "dirty": dirty, "version": package_version(), "image": image,
            "image_id": await image_id(image)}


def task_hashes(entries) -> dict[str, str]:
    """``{"<domain>/<task id>": sha256}`` of a task set (:class:`arpo_async.task_sets.TaskEntry` list), as the
    manifest pins them (:func:`actors.eval.folder.task_digest`)."""
    return {f"{e.domain}/{e.task_id}": task_digest(e) for e in entries}


def task_set_hash(hashes: dict[str, str]) -> str:
    """sha256 of the lines ``"<name> <sha256>\\n"`` of ``hashes`` in sorted order."""
    return hashlib.sha256("".join(f"{n} {h}\n" for n, h in sorted(hashes.items())).encode()).hexdigest()


def score_settings(config, *, repeats: int, seed: int, policy_kind: str | None) -> dict:
    """The settings that change a score (module docstring), ``{config key: value}``, of the effective ``config``
    (:class:`arpo_async.config.RunConfig` with the flags applied); ``serve.*`` only for ``policy_kind`` "model"."""
    ac = config.actors
    settings = {"repeats": repeats, "seed": seed, "model": str(config.model_path),
                "learner.success_threshold": config.learner.success_threshold}
    for key in (*RESULT_ACTORS_KEYS, *ERROR_ACTORS_KEYS):
        value = getattr(ac, key)
        settings[f"actors.{key}"] = list(value) if isinstance(value, tuple) else value
    if policy_kind == "model":
        settings.update({"serve.dtype": config.serve.dtype, "serve.device": config.serve.device})
    return settings


def session_warnings(sessions: list) -> list[str]:
    """One line for each field of :data:`SESSION_CHECKS` whose value differs between ``sessions``: the report's
    episodes did not all run on one commit or one desktop image."""
    lines = []
    for key, what in SESSION_CHECKS:
        seen = [(i + 1, s.get(key), s.get("date")) for i, s in enumerate(sessions) if isinstance(s, dict)]
        if len({str(v) for _, v, _ in seen}) > 1:
            listed = "; ".join(f"session {i} ({date}): {value}" for i, value, date in seen)
            lines.append(f"the sessions of this evaluation ran different {what}s, so its episodes do not all come "
                         f"from one {what}: {listed}")
    return lines


def build_provenance(sessions: list[dict], policy: dict, settings: dict, hashes: dict[str, str]) -> dict:
    """The report's ``provenance`` (module docstring) from every session (first first), the policy's identity,
    :func:`score_settings` and :func:`task_hashes`."""
    first = sessions[0] if sessions else {}
    return {**{k: first.get(k, UNKNOWN) for k in ("date", "commit", "version", "image", "image_id")},
            "sessions": sessions, "warnings": session_warnings(sessions), "policy": policy, "task_hash": TASK_HASH,
            "task_sha256": hashes, "task_set_sha256": task_set_hash(hashes), "settings": settings}


async def evaluation_provenance(folder, entries, config, *, repeats: int, seed: int, policy: dict) -> dict:
    """The report's provenance of an evaluation starting now: this session (:func:`collect_session` for the
    desktops' image, ``actors.image`` or ``actors.image_profile``'s tag as ``actors.main.desktop_pool`` picks it)
    is appended to the sessions in ``folder``'s manifest (an :class:`actors.eval.folder.ResultsFolder`; None: this
    session alone); each warning (:func:`session_warnings`) is logged, so ``arpo eval`` prints it on stderr.

    Args:
        entries: the task set; config: the effective RunConfig; repeats, seed: the evaluation's;
        policy: the policy's identity (``kind``, ``name``, ``weight_version`` and what else the caller knows).
    Raises OSError (the manifest cannot be written)."""
    from actors.desktop.build import image_tag

    session = await collect_session(config.actors.image or image_tag(config.actors.image_profile))
    sessions = folder.add_session(session) if folder is not None else [session]
    settings = score_settings(config, repeats=repeats, seed=seed, policy_kind=policy.get("kind"))
    provenance = build_provenance(sessions, policy, settings, task_hashes(entries))
    for line in provenance["warnings"]:
        log.warning("%s", line)
    return provenance


def attach_task_hashes(report: dict) -> dict:
    """Put each task's hash from ``report["provenance"]`` into its ``tasks_detail`` entry (``"task_sha256"``);
    returns ``report``."""
    hashes = (report.get("provenance") or {}).get("task_sha256") or {}
    for name, detail in report.get("tasks_detail", {}).items():
        detail["task_sha256"] = hashes.get(name)
    return report


def provenance_lines(report: dict) -> list[str]:
    """The header lines of ``report.md`` that say where the report comes from (none for a report without
    provenance), a ``WARNING`` line for each of its warnings."""
    p = report.get("provenance")
    if not isinstance(p, dict):
        return []
    sessions = p.get("sessions") if isinstance(p.get("sessions"), list) else []
    dirty = any(isinstance(s, dict) and s.get("dirty") for s in sessions)
    lines = [f"- started {p.get('date')} (UTC); {len(sessions)} session(s)"
             + (f", the last {sessions[-1].get('date')}" if len(sessions) > 1 and isinstance(sessions[-1], dict)
                else ""),
             f"- code: commit `{p.get('commit')}`" + (" with uncommitted changes" if dirty else "")
             + f", arpo-async {p.get('version')}",
             f"- desktop image: `{p.get('image')}`, id `{p.get('image_id')}`",
             f"- task set sha256 `{p.get('task_set_sha256')}` ({len(p.get('task_sha256') or {})} tasks)"]
    settings = p.get("settings") if isinstance(p.get("settings"), dict) else {}
    if settings:
        lines.append("- settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    return lines + [f"- **WARNING**: {w}" for w in p.get("warnings") or []]
