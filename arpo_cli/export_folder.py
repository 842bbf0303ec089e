"""What ``arpo export`` may read and replace: regular input files, and an ``--out`` that is its own earlier export.

Owns the export's marker file (:data:`MANIFEST`, ``arpo-export.json``: the source run, checkpoint, step and the
files written) and the rules that keep ``arpo export --overwrite`` from destroying anything it did not write:

- ``--out`` is never a symbolic link, never a run folder nor anything inside one (checked on the path as given and
  as resolved, so a symlinked parent that leads into a run is caught too), never the run or base model folder or a
  folder above them;
- a non-empty ``--out`` is replaced only when it is an earlier export: it holds a readable :data:`MANIFEST` and
  nothing but regular files that manifest lists; anything else is refused with one line naming it, and nothing
  is touched (the replacement itself is atomic: learner.train.weights_export.write_folder);
- every input file is read only when it is a regular file (:func:`check_regular`): a FIFO or a device file
  (``/dev/zero``, directly or through a symlink) would hang the read or never end it.

A run folder is recognised by what ``arpo run`` writes at its top (arpo_cli.launcher.prepare_run, docs/guides/runs.md):
``config.toml`` beside one of :data:`RUN_ENTRIES`.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

MANIFEST = "arpo-export.json"
"""The marker file every export writes into its folder (format ``arpo-export``, schema 1)."""

RUN_ENTRIES = ("metrics.jsonl", "status.json", "summary.json", "checkpoints", "weights", "logs", "trajectories",
               "cluster.json")
"""Entries that, beside ``config.toml``, make a folder a run folder (what ``arpo run`` / ``arpo launch`` write)."""

_FORMAT, _SCHEMA = "arpo-export", 1


class ExportError(RuntimeError):
    """The export cannot be made; the message says why. ``code`` is the exit status (1 or 2,
    arpo_cli.export_command's module docstring)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def is_run_folder(folder: Path) -> bool:
    """True when ``folder`` holds ``config.toml`` and one of :data:`RUN_ENTRIES` (only names are looked at;
    nothing is opened)."""
    try:
        return (folder / "config.toml").exists() and any(os.path.lexists(folder / name) for name in RUN_ENTRIES)
    except OSError:
        return False


def check_out(out: Path, overwrite: bool, run_dir: Path, base: Path) -> None:
    """Refuse an ``--out`` that the export must not write or replace (the rules of the module docstring).

    Args:
        out: the ``--out`` folder as given.
        overwrite: ``--overwrite`` was passed.
        run_dir: the run folder exported from.
        base: the base model folder (config and processor files are read from it).

    Raises:
        ExportError: (code 2) ``out`` is a symlink, a file, a run folder or inside one, the run or base model
            folder or above them, non-empty without ``overwrite``, or non-empty and not wholly an earlier export.
    """
    resolved = out.resolve()
    for keep, what in ((run_dir, "the run folder"), (base, "the base model folder")):
        if resolved == keep.resolve() or keep.resolve().is_relative_to(resolved):
            raise ExportError(f"--out {out} would replace {what} {keep}; choose another folder", 2)
    if out.is_symlink():
        raise ExportError(f"--out {out} is a symbolic link (to {os.readlink(out)}); export writes only into a "
                          "real folder: pass the folder itself", 2)
    lexical = Path(os.path.abspath(out))
    if resolved.is_relative_to(run_dir.resolve()):
        raise ExportError(f"--out {out} is inside the run folder {run_dir}; choose a folder outside it", 2)
    for path in (lexical, resolved):
        for folder in (path, *path.parents):
            if is_run_folder(folder):
                inside = "is the run folder" if folder == path else f"is inside the run folder {folder}"
                raise ExportError(f"--out {out} {inside} (it holds config.toml and what arpo run writes); "
                                  "choose a folder outside any run folder", 2)
    if os.path.lexists(out) and not out.is_dir():
        raise ExportError(f"--out {out} exists and is not a folder", 2)
    if not out.is_dir() or not any(out.iterdir()):
        return
    files = _earlier_export(out)
    if not overwrite:
        raise ExportError(f"--out {out} exists and is not empty; pass --overwrite to replace it, or choose another "
                          "folder", 2)
    for entry in os.scandir(out):
        if entry.name != MANIFEST and (entry.name not in files or not entry.is_file(follow_symlinks=False)):
            raise ExportError(f"--out {out} holds {entry.name}, which the earlier export did not write; not "
                              f"replacing it (move it away, or choose another folder)", 2)


def _earlier_export(out: Path) -> set[str]:
    """The file names the :data:`MANIFEST` of ``out`` lists; refuses a folder without a readable one."""
    marker = out / MANIFEST
    if not marker.is_file() or marker.is_symlink():
        raise ExportError(f"--out {out} is not empty and is not an earlier arpo export (no {MANIFEST}); "
                          "choose another folder, or an empty one", 2)
    try:
        manifest = json.loads(marker.read_text())
        files = manifest["files"] if manifest.get("format") == _FORMAT else None
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        files = None
    if not isinstance(files, list) or not all(isinstance(name, str) for name in files):
        raise ExportError(f"--out {out}: {marker} is not an arpo export manifest (no list of files); "
                          "choose another folder", 2)
    return set(files)


def write_manifest(folder: Path, record: dict[str, Any]) -> None:
    """Write :data:`MANIFEST` into ``folder`` (the export's temporary folder): ``record`` (run, checkpoint, step,
    policy version, base model, dtype) plus ``format``, ``schema`` and ``files``, the names in ``folder``."""
    files = sorted(p.name for p in folder.iterdir() if p.name != MANIFEST)
    body = {"format": _FORMAT, "schema": _SCHEMA, **record, "files": files}
    (folder / MANIFEST).write_text(json.dumps(body, indent=1) + "\n")


def check_regular(path: Path, what: str) -> None:
    """Refuse ``path`` unless it is a regular file (a symlink to one is fine): a FIFO blocks ``open`` until a
    writer comes, a device such as ``/dev/zero`` never ends. ``stat`` opens nothing, so this never hangs.

    Raises:
        ExportError: (code 1) ``path`` cannot be stat'ed or is not a regular file; the message names it.
    """
    try:
        mode = os.stat(path).st_mode
    except OSError as error:
        raise ExportError(f"cannot read {what} {path}: {error.strerror}") from error
    if not stat.S_ISREG(mode):
        kind = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
                stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a folder"}.get(stat.S_IFMT(mode), "not a regular file")
        raise ExportError(f"{what} {path} is {kind}, not a regular file; export reads regular files only")


def check_inputs(trainer_part: Path, meta: Path, base: Path, processor_files: tuple[str, ...]) -> None:
    """:func:`check_regular` on every file the export will read: the checkpoint's ``trainer.pt`` (or every file
    of ``trainer.dcp``), its ``meta.json`` when present, and the base model's ``config.json``,
    ``generation_config.json`` and ``processor_files`` that are present.

    Raises:
        ExportError: (code 1) one of them is not a regular file.
    """
    if trainer_part.is_dir():
        for entry in sorted(trainer_part.iterdir()):
            check_regular(entry, "checkpoint file")
    else:
        check_regular(trainer_part, "checkpoint file")
    if os.path.lexists(meta):
        check_regular(meta, "checkpoint file")
    for name in ("config.json", "generation_config.json", *processor_files):
        if os.path.lexists(base / name) or name == "config.json":
            check_regular(base / name, "base model file")
