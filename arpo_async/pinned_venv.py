"""Cached virtualenvs of pinned packages, built once per requirement list and shared by concurrent builders.

Used by :mod:`actors.osworld.metric_env` (OSWorld's metric functions) and ``tests/sglang_env.py`` (SGLang's code
for tests); each keeps its own requirement list, cache folder, marker name, fingerprint and error class, and this
module owns only the build mechanics they share: the ``<cache>/bin/python`` layout, the marker check, the lock
file, the venv creation and the ``pip install --no-deps`` runs.

Invariants: an environment is ready only when its interpreter exists and its marker file (written last, after
every install and the caller's ``finish`` step succeeded) holds exactly the caller's fingerprint; a build
replaces whatever was at the folder; builders of one folder are serialised by an fcntl lock on
``<parent>/.<name>.lock``, and a builder that waited on the lock returns the environment the first one built.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path


def fingerprint(*parts: str) -> str:
    """The 16-hex-digit SHA-256 prefix of ``parts`` joined by newlines (what a marker file holds)."""
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def env_python(root: Path) -> Path:
    """The interpreter of the environment at ``root``; it may not exist."""
    return Path(root) / "bin" / "python"


def is_ready(root: Path, marker: str, expected: str) -> bool:
    """True when ``root``'s interpreter exists and its marker file ``root/marker`` holds ``expected``."""
    path = Path(root) / marker
    return env_python(root).exists() and path.exists() and path.read_text().strip() == expected


def run(cmd: list[str], log: Callable[[str], None], error: type[Exception], timeout_s: float) -> None:
    """Log ``cmd`` and run it, capturing its output.

    Raises:
        error: (the caller's exception class) the command timed out after ``timeout_s`` or exited non-zero; the
            message has the command's start and, for a failure, its exit status and the tail of its stderr.
    """
    log(" ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise error(f"{' '.join(cmd[:6])} ...: no result within {timeout_s:g} s") from exc
    if proc.returncode != 0:
        raise error(f"{' '.join(cmd[:6])} ... failed ({proc.returncode}): {proc.stderr[-2000:]}")


_SITE_DIRS = "import json, site; print(json.dumps(site.getsitepackages()))"


def _share_site_packages(base_python: str, python: Path, error: type[Exception], timeout_s: float) -> None:
    """Write ``_arpo_base_site.pth`` into the new environment ``python``'s site-packages: one
    ``site.addsitedir`` line per site-packages folder of ``base_python`` (see the ``site`` module)."""
    folders = []
    for interpreter in (base_python, str(python)):
        try:
            done = subprocess.run([interpreter, "-c", _SITE_DIRS], capture_output=True, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise error(f"{interpreter} did not list its site-packages within {timeout_s:g} s") from exc
        if done.returncode != 0:
            raise error(f"{interpreter} could not list its site-packages: {done.stderr.strip()[-500:]}")
        folders.append(json.loads(done.stdout))
    base, own = folders
    # "import" lines of a .pth file run at start-up: addsitedir also reads the .pth files of those folders
    # (an editable install's, for one), as the base environment itself does.
    lines = "".join(f"import site; site.addsitedir({folder!r})\n" for folder in base)
    (Path(own[0]) / "_arpo_base_site.pth").write_text(lines, encoding="utf-8")


def build(root: Path, *, marker: str, expected: str, installs: Sequence[Sequence[str]], base_python: str,
          error: type[Exception], timeout_s: float, log: Callable[[str], None] = lambda _msg: None,
          system_site_packages: bool = False, finish: Callable[[Path], None] | None = None) -> Path:
    """Create (once) the virtualenv at ``root`` and return its interpreter's path.

    Under the lock: if :func:`is_ready` holds, nothing is done; otherwise ``root`` is removed, a venv is created
    with ``base_python -m venv`` (``--system-site-packages`` if asked), each group of ``installs`` is installed in
    order with ``pip install --no-deps --prefer-binary``, ``finish(python)`` runs, and the marker is written.

    Args:
        root: the environment's folder (its parent is created if missing).
        marker: the marker file's name inside ``root``.
        expected: the fingerprint the marker must hold (see :func:`fingerprint`).
        installs: pip requirement groups, one ``pip install`` each.
        base_python: the interpreter whose ``venv`` module creates the environment.
        error: the exception class raised on failure.
        timeout_s: the limit for each command.
        log: called with each command run (e.g. ``print``).
        system_site_packages: let the venv see ``base_python``'s site-packages. When ``base_python`` is itself
            in a virtual environment (such as the checkout's ``.venv``), ``venv --system-site-packages`` would
            show only the interpreter it was made from, so a ``.pth`` file adds ``base_python``'s own
            site-packages folders too (after the new environment's, before the base interpreter's).
        finish: a last step before the marker is written (e.g. an import check); it raises to fail the build.
    Returns:
        The environment's interpreter.
    Raises:
        error: the venv or a pip install failed or timed out (see :func:`run`); whatever ``finish`` raises.
    """
    root = Path(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_ready(root, marker, expected):
            return env_python(root)
        if root.exists():
            shutil.rmtree(root)
        venv = ["--system-site-packages"] if system_site_packages else []
        run([base_python, "-m", "venv", *venv, str(root)], log, error, timeout_s)
        python = env_python(root)
        if system_site_packages:
            _share_site_packages(base_python, python, error, timeout_s)
        pip = [str(python), "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "--no-input",
               "--prefer-binary"]
        for group in installs:
            run([*pip, *group], log, error, timeout_s)
        if finish is not None:
            finish(python)
        (root / marker).write_text(expected + "\n")
        return python
