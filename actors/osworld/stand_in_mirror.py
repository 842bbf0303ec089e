"""A stand-in mirror of OSWorld's files, for tests and measurement on machines that cannot reach OSWorld's file
host: for every file a task set names (:func:`actors.osworld.task_files.scan_task_files`), a small valid file
of the type its name says (:mod:`actors.osworld.stand_in_formats`), at ``MIRROR/<domain>/<task id>/<name>``,
the layout ``learner.osworld_files`` is read in (:class:`actors.osworld.downloads.DownloadCache`).

    python -m actors.osworld.stand_in_mirror --tasks OSWorld/evaluation_examples/examples --split arpo-128 \\
        --to ~/osworld-stand-in

Scores against stand-in files prove that the harness runs (setup steps, the apps that open the files, the
getters and the metrics), never that our evaluators agree with OSWorld's VM: the files are not OSWorld's.

Contents are deterministic: a file's seed is the SHA-256 of ``--seed`` and its URL, so one URL gives the same
bytes in every task (as the real file host does) and two URLs give different bytes (so an untouched task whose
expected file is another URL does not match it).

Invariants and safety:

- It writes only inside MIRROR, each file through directory file descriptors opened with ``O_NOFOLLOW``: a
  symbolic link anywhere under MIRROR (or MIRROR itself being one) stops the run with a :class:`StandInError`
  naming it; nothing is written through a link.
- MIRROR must be absent, empty, or a mirror this generator made (its manifest :data:`MANIFEST` is there): any
  other folder is refused, so it never mixes stand-ins into a real mirror or overwrites someone's files.
- Each file is written to a temporary name and renamed into place, so a crash never leaves a partial file under
  a mirror name; a file it did not list before (a foreign file) is never replaced.
- :data:`MANIFEST` records every file (path, URL, kind, type, bytes, SHA-256), every file left out with the
  reason, and every malformed reference of the task set; ``"stand_in": true`` marks the whole folder;
  ``earlier`` lists files an earlier run wrote that this one did not (an interrupted run, another split): they
  stay this generator's to replace. ``complete`` is false while a run is under way or after one that failed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import stat
import sys
from collections import Counter
from pathlib import Path

from arpo_async.task_sets import load_task_set
from arpo_async.tasks import TaskFormatError

from actors.osworld.mirror_fs import replace_file
from actors.osworld.stand_in_formats import MARK, LeftOut, extension, stand_in
from actors.osworld.task_files import TaskFile, scan_task_files

MANIFEST = "arpo-stand-in.json"
"""The manifest's name in MIRROR: what says the folder is a stand-in mirror this generator made."""
GENERATOR = "arpo stand-in mirror"
"""The manifest's ``generator`` field."""
NOTE = ("Stand-in files, not OSWorld's: scores against them prove that the harness runs, not that the evaluators "
        "agree with OSWorld's VM.")


class StandInError(Exception):
    """The mirror cannot be written (a foreign folder, a symbolic link, a bad task set); one line, naming it."""


def _open_dir(parent_fd: int | None, name: str, shown: str, create: bool) -> int:
    """A file descriptor of the folder ``name`` under ``parent_fd`` (an absolute path when None), never
    following a link; created when absent and ``create``."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        st = os.lstat(name, dir_fd=parent_fd)
    except FileNotFoundError:
        if not create:
            raise StandInError(f"{shown}: does not exist") from None
        os.mkdir(name, 0o755, dir_fd=parent_fd)
        st = os.lstat(name, dir_fd=parent_fd)
    if stat.S_ISLNK(st.st_mode):
        raise StandInError(f"{shown}: is a symbolic link; the stand-in mirror never writes through one")
    if not stat.S_ISDIR(st.st_mode):
        raise StandInError(f"{shown}: exists and is not a folder")
    try:
        return os.open(name, flags, dir_fd=parent_fd)
    except OSError as exc:  # replaced by a link between the check and the open
        raise StandInError(f"{shown}: cannot open as a folder without following links: {exc.strerror}") from exc


def _write(dir_fd: int, name: str, data: bytes, shown: str) -> None:
    """Write ``data`` as ``name`` in the folder ``dir_fd``: a temporary file made with O_EXCL|O_NOFOLLOW,
    renamed over ``name`` (which, when present, must be a regular file)."""
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISREG(st.st_mode):
            kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
            raise StandInError(f"{shown}: is {kind}; the stand-in mirror never writes through or over one")
    replace_file(dir_fd, name, data)


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


def _claim(mirror: Path) -> tuple[int, dict]:
    """Open MIRROR (created when absent; its parent must exist) and check it may be written: empty, or holding
    this generator's manifest. Returns its descriptor and the old manifest ({} when none)."""
    mirror = Path(os.path.abspath(mirror))
    if not mirror.parent.is_dir():
        raise StandInError(f"{mirror}: its parent folder {mirror.parent} does not exist")
    fd = _open_dir(None, str(mirror), str(mirror), create=True)
    try:
        names = os.listdir(fd)
        if not names:
            return fd, {}
        try:
            st = os.lstat(MANIFEST, dir_fd=fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError("not a regular file")
            mfd = os.open(MANIFEST, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd)
            with os.fdopen(mfd, "rb") as f:
                old = json.loads(f.read(64 << 20))
            if not isinstance(old, dict) or old.get("generator") != GENERATOR:
                raise ValueError("not this generator's manifest")
        except (OSError, ValueError) as exc:
            raise StandInError(f"{mirror}: a non-empty folder this generator did not make (no valid {MANIFEST}: "
                               f"{exc}); give an empty or new folder") from None
        return fd, old
    except BaseException:
        os.close(fd)
        raise


def _manifest(args: dict, written: list[dict], left_out: list[dict], problems: list[str], complete: bool,
              earlier: list[dict]) -> bytes:
    return (json.dumps({"generator": GENERATOR, "format": 1, "stand_in": True, "mark": MARK, "note": NOTE,
                        "complete": complete, **args, "files": written, "left_out": left_out,
                        "problems": problems, "earlier": earlier}, indent=1) + "\n").encode()


def seed_of(seed: str, url: str) -> bytes:
    """A file's content seed: SHA-256 of ``seed``, a NUL and ``url`` (module docstring)."""
    return hashlib.sha256(f"{seed}\0{url}".encode()).digest()


def write_mirror(files: list[TaskFile], mirror: Path, *, seed: str = "arpo", problems: list[str] | None = None,
                 source: dict | None = None) -> dict:
    """Write a stand-in for each of ``files`` under ``mirror`` and the manifest; return the manifest (a dict).

    Args:
        files: what to write (:func:`actors.osworld.task_files.scan_task_files`).
        mirror: the mirror folder (absent, empty, or made by this generator).
        seed: the content seed's prefix (:func:`seed_of`).
        problems: malformed references of the task set, recorded in the manifest.
        source: fields recorded in the manifest as given (the tasks folder and split).
    Raises:
        StandInError: the folder is foreign, or a symbolic link or non-file is in the way (module docstring).
    """
    fd, old = _claim(mirror)
    earlier = {f["path"]: f for f in [*old.get("files", []), *old.get("earlier", [])]
               if isinstance(f, dict) and isinstance(f.get("path"), str)}
    owned = set(earlier)
    args = {"seed": seed, **(source or {})}
    written: list[dict] = []
    left_out: list[dict] = []

    def record(complete: bool) -> bytes:  # files written earlier and not now stay listed: they are ours
        now = {w["path"] for w in written}
        return _manifest(args, written, left_out, problems or [], complete,
                         [e for p, e in earlier.items() if p not in now])
    try:
        _write(fd, MANIFEST, record(False), str(Path(mirror) / MANIFEST))
        for f in files:
            rel = f.relpath.as_posix()
            shown = str(Path(mirror) / rel)
            try:
                data = stand_in(f.name, seed_of(seed, f.url))
            except LeftOut as exc:
                left_out.append({"path": rel, "url": f.url, "kind": f.kind, "reason": str(exc)})
                continue
            dfd = _open_dir(fd, f.domain, str(Path(mirror) / f.domain), create=True)
            try:
                tfd = _open_dir(dfd, f.task_id, str(Path(mirror) / f.domain / f.task_id), create=True)
            finally:
                os.close(dfd)
            try:
                if rel not in owned and _exists(tfd, f.name):
                    raise StandInError(f"{shown}: a file this generator did not write; it is left alone (remove it "
                                       "or give a new folder)")
                _write(tfd, f.name, data, shown)
            finally:
                os.close(tfd)
            written.append({"path": rel, "url": f.url, "kind": f.kind, "type": extension(f.name) or "text",
                            "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
            owned.add(rel)
        manifest = record(True)
        _write(fd, MANIFEST, manifest, str(Path(mirror) / MANIFEST))
        return json.loads(manifest)
    except BaseException:
        try:  # keep a record of what was written, so a rerun may replace it
            _write(fd, MANIFEST, record(False), str(Path(mirror) / MANIFEST))
        except (OSError, StandInError):
            pass
        raise
    finally:
        os.close(fd)


def summary(manifest: dict) -> str:
    """Lines for the terminal: files written by type, files left out with the reason, malformed references."""
    types = Counter(f["type"] for f in manifest["files"])
    lines = [f"{len(manifest['files'])} stand-in files written ("
             + ", ".join(f"{t} {n}" for t, n in sorted(types.items())) + ")"]
    if manifest["left_out"]:
        lines.append(f"{len(manifest['left_out'])} left out:")
        lines += [f"  {x['path']}: {x['reason']}" for x in manifest["left_out"]]
    if manifest["problems"]:
        lines.append(f"{len(manifest['problems'])} references not usable:")
        lines += [f"  {p}" for p in manifest["problems"]]
    lines.append(NOTE)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring). Exit status 0 when the mirror was written, 2 for a bad task set or
    split or a mirror folder it may not write (one line on stderr naming it)."""
    parser = argparse.ArgumentParser(prog="python -m actors.osworld.stand_in_mirror",
                                     description="Write a stand-in mirror of OSWorld's files (valid files of the "
                                                 "right type, not OSWorld's content) for tests and measurement.")
    parser.add_argument("--tasks", required=True, type=Path,
                        help="OSWorld's evaluation_examples/examples (or any folder of task files)")
    parser.add_argument("--split", default=None, help="a split file or name (arpo-128, osworld-369, ...)")
    parser.add_argument("--to", required=True, type=Path, metavar="MIRROR",
                        help="the mirror folder: new, empty, or made by this command before")
    parser.add_argument("--seed", default="arpo", help="content seed (default arpo)")
    args = parser.parse_args(argv)
    try:
        entries = load_task_set(args.tasks, args.split)
        files, problems = scan_task_files(entries)
        manifest = write_mirror(files, args.to, seed=args.seed, problems=problems,
                                source={"tasks": str(args.tasks), "split": args.split})
    except (TaskFormatError, StandInError) as exc:
        print(f"stand-in mirror: {exc}", file=sys.stderr)
        return 2
    print(summary(manifest))
    print(f"mirror: {args.to} (learner.osworld_files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
