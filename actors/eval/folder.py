"""The results folder of an evaluation, and the rule for what ``arpo eval`` may change in it.

Owns ``OUT/arpo-eval.json`` (:data:`MANIFEST`), which marks a folder as one ``arpo eval`` created::

    {"format": 2,
     "params": {...},                       what determines the results (:func:`run_params`); a resume must match
     "episodes": ["[repeat-<k>/][<prefix>/]<domain>/<task id>", ...],   every episode folder this evaluation
                                            created, as its :class:`actors.eval.results.Layout` places it
     "sessions": [{"date", "commit", "image_id", ...}]}  each run of it, the first first (actors.eval.provenance)

Invariants:

- the manifest is written only into a folder that did not exist or was empty, or that already holds a manifest;
  it is replaced atomically (temporary file + ``os.replace``), never written through a symbolic link;
- an episode folder is listed before it is made, so a crash never leaves a folder of ours unlisted;
- nothing is deleted but an episode folder listed in the manifest, and only when it is a real directory reached
  through real directories (``os.lstat`` on every component below OUT); a symbolic link on the way is left alone
  with a warning, and an episode that would have to be written through one is refused;
- ``resume`` refuses a folder without a manifest (one line naming the folder, nothing touched), and a folder whose
  recorded parameters differ from this run's (one line naming the first difference).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import tempfile
import threading
from pathlib import Path

from actors.eval.results import (RECORD_FILE, EpisodeRecord, Layout, episode_dir, parse_prefix, read_record,
                                 read_regular, record_problem, remove_tree_below, safe_name, write_episode)
from arpo_async.messages import Trajectory

log = logging.getLogger(__name__)

MANIFEST = "arpo-eval.json"
FORMAT = 2
"""2: OSWorld's layout (one folder per episode, ``<domain>/<task id>`` under a root per repeat); 1 had a
``<domain>/<task id>/<repeat>`` folder per episode."""
MANIFEST_MAX_BYTES = 64 << 20
"""A manifest larger than this is refused as damaged (about a million episodes' paths)."""

RESULT_ACTORS_KEYS = ("max_steps", "history_images", "max_new_tokens", "temperature", "top_p", "constrained",
                      "grammar_actions", "max_thought_chars", "coordinate_mode", "fixed_width_coordinates",
                      "prompt_style", "screen_width", "screen_height", "image", "image_profile", "screenshot_format",
                      "screenshot_quality", "action_backend", "reply_retries")
"""The ``[actors]`` keys that change what an episode does (prompt, sampling, screen, desktop, actions), recorded
in the manifest; the others (desktops at once, timeouts, retries, pool sizes) change how fast, not what."""


class ResultsFolderError(ValueError):
    """The results folder cannot be used as asked; the message is one line naming the folder or file (``arpo
    eval`` exits 2)."""


def task_digest(entry) -> str:
    """sha256 of a task set entry (:class:`arpo_async.task_sets.TaskEntry`): of its task's canonical JSON, or of its
    load error when it does not load, so an edited task file changes it."""
    body = entry.task.to_dict() if entry.task is not None else {"error": entry.error}
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=True).encode()).hexdigest()


def run_params(policy: dict, entries: list, *, repeats: int, seed: int, tokenizer: str, success_threshold: float,
               actors, results_prefix: str = "") -> dict:
    """What determines an evaluation's results, as recorded in the manifest and compared on resume.

    Args:
        policy: the policy's identity (``kind``, ``name``, ``weight_version``: what ``arpo eval`` reports).
        entries: the task set (:class:`arpo_async.task_sets.TaskEntry` list); recorded as
            ``{"<domain>/<task id>": sha256}`` (:func:`task_digest`).
        repeats, seed: episodes per task and the order's seed.
        tokenizer: the model folder whose tokenizer builds the prompt (``model``).
        success_threshold: ``learner.success_threshold``; an episode scored above it is a success.
        actors: the effective ``ActorConfig`` (step budget and temperature already replaced by the flags); the
            :data:`RESULT_ACTORS_KEYS` are recorded.
        results_prefix: OSWorld's ``<action space>/<observation type>/<model>`` below each root ("" = none;
            :func:`actors.eval.results.parse_prefix`), which with ``repeats`` fixes the layout (:func:`layout_of`).
    """
    return {"policy": {k: policy.get(k) for k in ("kind", "name", "weight_version")},
            "repeats": repeats, "seed": seed, "tokenizer": tokenizer, "success_threshold": success_threshold,
            "results_prefix": results_prefix,
            "actors": {k: _jsonable(getattr(actors, k)) for k in RESULT_ACTORS_KEYS},
            "tasks": {f"{e.domain}/{e.task_id}": task_digest(e) for e in entries}}


def _jsonable(value):
    return list(value) if isinstance(value, tuple) else value


def param_difference(old: dict, new: dict) -> str | None:
    """The first difference between recorded parameters ``old`` and this run's ``new``, in words; None if equal."""
    if old.get("policy") != new["policy"]:
        return f"policy {_policy_words(old.get('policy'))}, this run asks {_policy_words(new['policy'])}"
    for key in ("max_steps", "temperature"):
        was, now = (old.get("actors") or {}).get(key), new["actors"][key]
        if was != now:
            return f"{key.replace('_', ' ')} {was}, this run asks {now}"
    old_tasks, new_tasks = old.get("tasks") or {}, new["tasks"]
    if set(old_tasks) != set(new_tasks):
        extra, missing = sorted(set(new_tasks) - set(old_tasks)), sorted(set(old_tasks) - set(new_tasks))
        example = f"adds {extra[0]}" if extra else f"lacks {missing[0]}"
        return f"a task set of {len(old_tasks)} tasks, this run asks {len(new_tasks)} ({example}, ...)"
    changed = sorted(t for t in new_tasks if old_tasks[t] != new_tasks[t])
    if changed:
        return f"task {changed[0]} as it was then (its task file changed since; {len(changed)} changed)"
    for key in ("repeats", "seed", "tokenizer", "success_threshold", "results_prefix"):
        if old.get(key, "" if key == "results_prefix" else None) != new[key]:
            was, now = (repr(old.get(key)), repr(new[key])) if key == "results_prefix" else (old.get(key), new[key])
            return f"{key.replace('_', ' ')} {was}, this run asks {now}"
    for key, now in new["actors"].items():
        was = (old.get("actors") or {}).get(key)
        if was != now:
            return f"actors.{key} {was!r}, this run asks {now!r}"
    return None


def _policy_words(policy) -> str:
    if not isinstance(policy, dict):
        return repr(policy)
    version = f" (weight version {policy['weight_version']})" if policy.get("weight_version") is not None else ""
    return f"{policy.get('kind')} {policy.get('name')!r}{version}"


def link_on_the_way(out: Path, rel: str) -> Path | None:
    """The first component of ``out/rel`` below ``out`` that is a symbolic link or not a directory (the last
    component may be missing); None when every existing one is a real directory."""
    path = out
    for part in rel.split("/"):
        path = path / part
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return None
        if not stat.S_ISDIR(mode):
            return path
    return None


def _valid_rel(rel) -> bool:
    """``rel`` has the shape of an episode folder of some layout: 2 to 6 plain folder names (``safe_name`` keeps
    each as it is: no "..", "/", empty or unprintable name), so a listed folder is always inside OUT."""
    parts = rel.split("/") if isinstance(rel, str) else []
    return 2 <= len(parts) <= 6 and all(p == safe_name(p) for p in parts)


def layout_of(params: dict) -> Layout:
    """The :class:`actors.eval.results.Layout` recorded parameters (:func:`run_params`) give: their ``repeats``
    and ``results_prefix``. Raises ValueError when either is not one (a damaged or forged manifest)."""
    prefix = params.get("results_prefix", "")
    if not isinstance(prefix, str):
        raise ValueError(f"results_prefix {prefix!r} is not a string")
    return Layout(params.get("repeats"), parse_prefix(prefix))


def read_manifest(out: Path) -> dict | None:
    """The manifest of ``out``, or None when ``out`` has none (it does not exist, or holds no ``arpo-eval.json``).

    Raises:
        ResultsFolderError: the manifest is a link, not a regular file, too large, not JSON of the documented
            shape, or of another format version.
    """
    path = out / MANIFEST
    if not os.path.lexists(path):
        return None
    try:
        data = json.loads(read_regular(path, MANIFEST_MAX_BYTES))
    except (OSError, ValueError, RecursionError) as exc:
        raise ResultsFolderError(f"{path}: unreadable ({exc}); arpo eval uses no folder it cannot tell is its "
                                 "own") from None
    if isinstance(data, dict) and data.get("format") == 1:
        raise ResultsFolderError(f"{path}: made by an earlier arpo eval (format 1: a <domain>/<task id>/<repeat> "
                                 f"folder per episode, not OSWorld's layout); keep it as it is and choose a new "
                                 "folder for this evaluation")
    try:
        layout = layout_of(data["params"]) if isinstance(data, dict) and isinstance(data.get("params"), dict) \
            else None
    except ValueError:
        layout = None
    if not isinstance(data, dict) or data.get("format") != FORMAT or layout is None \
            or not isinstance(data.get("episodes"), list) or not all(_valid_rel(r) for r in data["episodes"]):
        raise ResultsFolderError(f"{path}: not an arpo eval manifest of format {FORMAT} (params with repeats and "
                                 "results_prefix, episodes as [repeat-<k>/][<prefix>/]<domain>/<task id>)")
    return data


def check_owned(out: Path, resume: bool) -> dict | None:
    """Refuse a folder ``arpo eval`` may not use; nothing is written. Returns its manifest (None: a new folder).

    Raises:
        ResultsFolderError: ``resume`` and ``out`` has no manifest; ``out`` exists, is not empty and has no
            manifest; ``out`` is not a directory; ``out`` does not exist and cannot be made (its nearest existing
            parent is not a folder, or not one this process may write in); the manifest is damaged
            (:func:`read_manifest`).
    """
    if os.path.lexists(out) and not out.is_dir():
        raise ResultsFolderError(f"{out} is not a folder")
    if not os.path.lexists(out):
        parent = _nearest_existing(out)
        if not parent.is_dir():
            raise ResultsFolderError(f"{out} cannot be made: {parent} is not a folder")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise ResultsFolderError(f"{out} cannot be made: {parent} is not writable")
    manifest = read_manifest(out)
    if manifest is None and resume:
        raise ResultsFolderError(f"{out} is not an arpo eval results folder (no {MANIFEST}); --resume finishes only "
                                 "a folder arpo eval created, and changes nothing here")
    if manifest is None and out.is_dir() and any(out.iterdir()):
        raise ResultsFolderError(f"{out} is not empty and not an arpo eval results folder (no {MANIFEST}); choose "
                                 "a new or empty folder for the results")
    return manifest


def _nearest_existing(path: Path) -> Path:
    """``path``'s nearest ancestor that exists (a link counts: it is what ``mkdir`` would meet)."""
    for parent in Path(os.path.abspath(path)).parents:
        if os.path.lexists(parent):
            return parent
    return Path("/")


class ResultsFolder:
    """An evaluation's results folder, claimed: its manifest, kept up to date as episode folders are made.

    Thread-safe: :meth:`write_episode` runs in worker threads, one per finishing episode.
    """

    def __init__(self, out: Path, manifest: dict) -> None:
        self.out = out
        self.layout = layout_of(manifest["params"])
        self._manifest = manifest
        self._listed = set(manifest["episodes"])
        self._lock = threading.Lock()

    @classmethod
    def check(cls, out: Path, params: dict, *, resume: bool) -> ResultsFolder:
        """Every refusal of :meth:`claim`, with nothing written: ``arpo eval`` calls it before it builds or starts
        anything. Returns the folder as :meth:`claim` would take it over (not yet saved).

        Raises:
            ResultsFolderError: as :func:`check_owned`; or ``resume`` and the recorded parameters differ from
                ``params`` (the message names the first difference).
            FileExistsError: not ``resume`` and ``out`` holds finished episodes.
        """
        manifest = check_owned(out, resume)
        if manifest is not None and resume:
            difference = param_difference(manifest["params"], params)
            if difference:
                raise ResultsFolderError(f"{out} was evaluated with {difference}; resume with the same settings, "
                                         "or choose another folder")
        folder = cls(out, manifest or {"format": FORMAT, "params": params, "episodes": []})
        if manifest is not None and not resume and any(folder._finished_file(rel) for rel in folder._listed):
            raise FileExistsError(f"{out} holds the results of an evaluation; pass --resume (resume=True) to "
                                  "finish it, or choose another folder")
        return folder

    @classmethod
    def claim(cls, out: Path, params: dict, *, resume: bool) -> ResultsFolder:
        """Check ``out`` (:meth:`check`), then create it or take it over with ``params`` recorded.

        Raises:
            ResultsFolderError, FileExistsError: as :meth:`check`.
            OSError: the folder or its manifest cannot be written.
        """
        folder = cls.check(out, params, resume=resume)
        out.mkdir(parents=True, exist_ok=True)
        folder._manifest["params"] = params
        folder.layout = layout_of(params)
        folder._save()
        return folder

    def _finished_file(self, rel: str) -> bool:
        return link_on_the_way(self.out, rel) is None and os.path.lexists(self.out / rel / RECORD_FILE)

    def _save(self) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.out, prefix=f".{MANIFEST}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self._manifest, f, indent=1)
            os.chmod(tmp, 0o644)  # as the results beside it (mkstemp makes 0600)
            os.replace(tmp, self.out / MANIFEST)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def add_session(self, session: dict) -> list[dict]:
        """Append ``session`` (this run's date, commit and desktop image id: :mod:`actors.eval.provenance`) to the
        manifest's ``sessions`` and save it; returns every session, the first one first. A ``sessions`` that is not
        a list of objects is started anew, with a warning. Raises OSError."""
        with self._lock:
            sessions = self._manifest.get("sessions", [])
            if not isinstance(sessions, list) or not all(isinstance(s, dict) for s in sessions):
                log.warning("%s: its sessions are not a list of objects; the list starts again here",
                            self.out / MANIFEST)
                sessions = []
            self._manifest["sessions"] = [*sessions, session]
            self._save()
            return list(self._manifest["sessions"])

    def clear_unfinished(self) -> int:
        """Delete the listed episode folders that have no ``episode.json`` (cut short); returns how many.

        A listed path with a symbolic link (or a file) on the way is left alone, with a warning."""
        removed = 0
        for rel in sorted(self._listed):
            path = self.out / rel
            link = link_on_the_way(self.out, rel)
            if link is not None:
                log.warning("%s is a symbolic link or not a folder: left alone, nothing deleted through it", link)
            elif os.path.lexists(path) and not os.path.lexists(path / RECORD_FILE):
                remove_tree_below(self.out, rel.split("/"))
                removed += 1
        return removed

    def finished(self, max_steps: int) -> dict[tuple[str, str, int], EpisodeRecord]:
        """The finished episodes that can be trusted, by key: listed, reached through real folders, with an
        ``episode.json`` whose fields agree with each other, with ``result.txt`` and with the step budget
        (:func:`actors.eval.results.record_problem`). Each other finished episode gets a warning naming it and is
        left out (it runs again, its folder replaced)."""
        threshold = self._manifest["params"]["success_threshold"]
        records = {}
        for rel in sorted(self._listed):
            path = self.out / rel / RECORD_FILE
            if link_on_the_way(self.out, rel) is not None or not os.path.lexists(path):
                continue
            record = read_record(path)
            problem = "unreadable, or a field of the wrong type" if record is None else (
                "it names another episode" if self._rel_of(record) != rel
                else record_problem(record, path.parent, success_threshold=threshold, max_steps=max_steps))
            if problem:
                log.warning("%s: %s; the episode runs again", path, problem)
            else:
                records[record.key] = record
        return records

    def check_writable(self, key: tuple[str, str, int]) -> None:
        """Refuse to write episode ``key`` where it would go through a symbolic link or replace a folder this
        evaluation did not create. Raises ResultsFolderError."""
        rel = self.rel(key)
        link = link_on_the_way(self.out, rel)
        if link is not None:
            raise ResultsFolderError(f"{link} is a symbolic link or not a folder; arpo eval writes no episode "
                                     "through it: remove it, or choose another folder")
        if rel not in self._listed and os.path.lexists(self.out / rel):
            raise ResultsFolderError(f"{self.out / rel} was not made by this evaluation (not in {MANIFEST}); arpo "
                                     "eval replaces only its own episode folders: move it away")

    def rel(self, key: tuple[str, str, int]) -> str:
        """The episode folder of ``key`` relative to OUT, as listed (:meth:`actors.eval.results.Layout.rel`)."""
        return self.layout.rel(*key)

    def _rel_of(self, record: EpisodeRecord) -> str | None:
        """Where this layout puts ``record`` (None: a repeat outside it)."""
        try:
            return self.rel(record.key)
        except ValueError:
            return None

    def episode_dir(self, key: tuple[str, str, int]) -> Path:
        """The folder of episode ``key``."""
        return episode_dir(self.out, *key, self.layout)

    def write_episode(self, record: EpisodeRecord, trajectory: Trajectory | None) -> Path:
        """List the episode's folder in the manifest, then write it (:func:`actors.eval.results.write_episode`,
        which replaces an earlier try). Raises ResultsFolderError (:meth:`check_writable`) or OSError."""
        self.check_writable(record.key)
        rel = self.rel(record.key)
        with self._lock:
            if rel not in self._listed:
                self._listed.add(rel)
                self._manifest["episodes"].append(rel)
                self._save()
        return write_episode(self.out, record, trajectory, self.layout)


__all__ = ["MANIFEST", "ResultsFolder", "ResultsFolderError", "check_owned", "param_difference", "read_manifest",
           "run_params"]
