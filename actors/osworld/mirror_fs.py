"""The mirror folder of OSWorld's files as `arpo osworld fetch` writes it: its manifest and safe file operations.

Layout under the mirror ``M`` (what :class:`actors.osworld.downloads.DownloadCache` reads as
``learner.osworld_files``):

- ``M/<domain>/<task id>/<name>``: the files (:mod:`actors.osworld.task_files`);
- ``M/arpo-mirror.json``: the manifest, ``{"format": "arpo-osworld-mirror", "version": 1, "files": {relpath:
  {"url", "size", "sha256", "fetched_at"}}, "failed": {relpath: {"url", "kind", "error"}}, "left_alone":
  [relpath, ...], "updated_at"}`` (relpath is ``<domain>/<task id>/<name>``; ``size`` in bytes, ``sha256`` hex);
- ``M/.arpo-partial/``: downloads in progress (``*.part``), moved into place once complete.

Invariants: a file is ours when the manifest lists it; nothing else in the mirror is written, replaced or
removed (left alone and reported). Every path inside the mirror is opened one component at a time from a
directory descriptor with ``O_NOFOLLOW``, so nothing is read or written through a symlink, and a folder
cannot be swapped for a link while we hold it. The mirror folder itself is the one the user named (a link
there is followed, as any path the user gives). The manifest is replaced atomically (a temporary file,
then ``os.replace``).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

MANIFEST = "arpo-mirror.json"
PARTIAL_DIR = ".arpo-partial"
FORMAT = "arpo-osworld-mirror"
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
_SHA256 = re.compile(r"[0-9a-f]{64}")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


class MirrorError(Exception):
    """The mirror cannot be used at all (not a folder, a manifest that is not ours or is malformed): one line
    naming the path and what is wrong."""


class PlacementError(Exception):
    """One file's place in the mirror is taken or unsafe: a symlink or a file arpo did not write is there
    (left alone). ``kind``: ``symlink`` or ``foreign``."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


def now() -> str:
    """The time now, UTC, ISO 8601 to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def open_root(mirror: Path) -> int:
    """A directory descriptor of ``mirror`` (created, parents included, if missing).

    Raises:
        MirrorError: it exists and is not a folder, or cannot be created or opened.
    """
    try:
        mirror.mkdir(parents=True, exist_ok=True)
        return os.open(mirror, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise MirrorError(f"{mirror}: cannot use it as the mirror folder: {exc.strerror or exc}") from exc


def open_dir(parent_fd: int, name: str, where: str, *, create: bool) -> int | None:
    """The descriptor of the folder ``name`` in ``parent_fd`` (never through a symlink); created when missing
    and ``create``, else None when missing. ``where`` names it in errors.

    Raises:
        PlacementError: kind ``symlink`` (a symlink is there) or ``foreign`` (a file that is not a folder).
    """
    for _ in range(2):
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        except FileNotFoundError:
            if not create:
                return None
            try:
                os.mkdir(name, 0o755, dir_fd=parent_fd)
            except FileExistsError:
                pass  # made by someone else meanwhile: open it (still without following links)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                kind = "symlink" if _is_link(parent_fd, name) else "foreign"
                what = "a symlink" if kind == "symlink" else "not a folder"
                raise PlacementError(f"{where} is {what}: left alone, nothing written through it", kind) from exc
            raise
    raise PlacementError(f"{where}: cannot be created", "foreign")


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def entry_kind(dir_fd: int, name: str) -> str:
    """What is at ``name`` in ``dir_fd``, links not followed: ``missing``, ``file`` (regular), ``symlink`` or
    ``other``."""
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return "missing"
    return "file" if stat.S_ISREG(mode) else "symlink" if stat.S_ISLNK(mode) else "other"


def hash_file(dir_fd: int, name: str) -> tuple[int, str]:
    """(size in bytes, sha256 hex) of the regular file ``name`` in ``dir_fd``, opened without following links.
    Raises OSError (ELOOP for a symlink)."""
    digest, size = hashlib.sha256(), 0
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(1 << 20):
            size += len(chunk)
            digest.update(chunk)
    return size, digest.hexdigest()


def _check_manifest(data: Any, where: str) -> dict:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise MirrorError(f"{where}: not an arpo mirror manifest (no \"format\": \"{FORMAT}\"); a file arpo did "
                          "not write is left alone: give another --to folder or move it away")
    files, failed = data.get("files", {}), data.get("failed", {})
    if not isinstance(files, dict) or not isinstance(failed, dict):
        raise MirrorError(f"{where}: fields 'files' and 'failed' must be objects")
    for rel, rec in files.items():
        ok = (isinstance(rec, dict) and isinstance(rec.get("url"), str) and type(rec.get("size")) is int
              and rec["size"] >= 0 and isinstance(rec.get("sha256"), str) and _SHA256.fullmatch(rec["sha256"]))
        if not ok:
            raise MirrorError(f"{where}: field 'files.{rel[:200]}': needs url (string), size (integer >= 0) and "
                              "sha256 (64 lowercase hex digits)")
    return {"format": FORMAT, "version": 1, "files": dict(files), "failed": dict(failed),
            "left_alone": [], "updated_at": data.get("updated_at", "")}


def read_manifest(root_fd: int, mirror: Path) -> dict:
    """The mirror's manifest (a fresh one when there is none), checked.

    Raises:
        MirrorError: naming the file: a symlink or not a regular file, over MAX_MANIFEST_BYTES, not JSON, not
            our format, or a ``files`` record without url, size and sha256.
    """
    where = str(mirror / MANIFEST)
    kind = entry_kind(root_fd, MANIFEST)
    if kind == "missing":
        return {"format": FORMAT, "version": 1, "files": {}, "failed": {}, "left_alone": [], "updated_at": ""}
    if kind != "file":
        raise MirrorError(f"{where}: is a {'symlink' if kind == 'symlink' else 'non-regular file'}; left alone")
    fd = os.open(MANIFEST, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=root_fd)
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_MANIFEST_BYTES + 1)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise MirrorError(f"{where}: larger than {MAX_MANIFEST_BYTES} bytes; not an arpo mirror manifest")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MirrorError(f"{where}: not valid JSON ({exc}); left alone") from exc
    return _check_manifest(data, where)


def write_manifest(root_fd: int, manifest: dict) -> None:
    """Write ``manifest`` as the mirror's ``arpo-mirror.json``, atomically (:func:`replace_file`, flushed to disk)."""
    manifest["updated_at"] = now()
    replace_file(root_fd, MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode(), fsync=True)


def replace_file(dir_fd: int, name: str, data: bytes, *, fsync: bool = False) -> None:
    """Put ``data`` at ``name`` in the folder ``dir_fd`` atomically: a new temporary file there (O_EXCL|O_NOFOLLOW,
    mode 0644; flushed to disk with ``fsync``), then renamed over ``name``. A rename replaces a symbolic link at
    ``name``, it never writes through one; the temporary file is removed on any failure. Raises OSError."""
    tmp = f".{name[:200]}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise


def open_partial_dir(root_fd: int, mirror: Path, manifest: dict) -> int:
    """The descriptor of ``.arpo-partial`` (created when missing), after removing the ``*.part`` files an
    interrupted run left in it (ours: only this command writes there; anything else there is left alone).

    Raises:
        MirrorError: ``.arpo-partial`` is a symlink or not a folder.
    """
    try:
        fd = open_dir(root_fd, PARTIAL_DIR, str(mirror / PARTIAL_DIR), create=True)
    except PlacementError as exc:
        raise MirrorError(str(exc)) from exc
    assert fd is not None
    for name in os.listdir(fd):
        if name.endswith(".part") and entry_kind(fd, name) == "file":
            os.unlink(name, dir_fd=fd)
    return fd


def new_partial(partial_fd: int) -> tuple[str, int]:
    """A new, empty ``*.part`` file in the partial folder: (its name, a descriptor open for writing)."""
    name = f"{os.getpid()}-{os.urandom(8).hex()}.part"
    return name, os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=partial_fd)


def left_alone(mirror: Path, manifest: dict) -> list[str]:
    """The paths under ``mirror`` (relative, posix) the manifest does not list: files, symlinks and anything
    else arpo did not write; folders are not listed, links are not followed; the manifest and the partial
    folder are skipped. Sorted."""
    ours = set(manifest["files"])
    out = []
    for dirpath, dirnames, filenames in os.walk(mirror, followlinks=False):
        rel_dir = Path(dirpath).relative_to(mirror)
        if rel_dir == Path("."):
            dirnames[:] = [d for d in dirnames if d != PARTIAL_DIR]
            filenames = [f for f in filenames if f != MANIFEST and not f.startswith(f".{MANIFEST}.")]
        out += [(rel_dir / d).as_posix() for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        out += [r for f in filenames if (r := (rel_dir / f).as_posix()) not in ours]
    return sorted(out)
