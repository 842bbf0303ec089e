"""Builds the desktop image ``arpo-desktop:<recipe hash>`` locally, without any image registry.

The recipe is the folder ``actors/desktop/image/`` (packages.txt, entrypoint.sh, controller.py, openbox
config, apps/). The tag's version is a short hash of that folder's content, so changing the recipe gives
a new tag and a rebuild. Two ways to build, chosen automatically:

* a Debian bookworm base image is present locally (``debian:bookworm``): ``docker build --network host``
  with a generated Dockerfile;
* otherwise: ``debootstrap --variant=minbase --include=<packages> bookworm ROOTFS <mirror>``, copy the recipe
  to ROOTFS/opt/arpo, trim caches and docs, then ``tar -C ROOTFS -c . | docker import --change ... - TAG``.
  Needs root and the debootstrap package; the rootfs is always removed afterwards.

Also tags the result ``arpo-desktop:latest``. Wired as ``arpo desktop build [--force]`` via :func:`main`.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

RECIPE_DIR = Path(__file__).resolve().parent / "image"
IMAGE_NAME = "arpo-desktop"
BASE_IMAGE = "debian:bookworm"
SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
ENTRYPOINT = '["/opt/arpo/entrypoint.sh"]'
ENV = {"DISPLAY": ":0", "LANG": "C.UTF-8", "HOME": "/root", "ARPO_SCREEN": "1280x720x24"}
# Paths trimmed from the debootstrap rootfs (relative to it): package caches, docs, translations.
TRIM = ["var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man",
        "usr/share/info", "usr/share/locale"]


class DesktopBuildError(RuntimeError):
    """The desktop image could not be built; the message says what failed and what to run."""


def _recipe_files() -> list[Path]:
    return sorted(p for p in RECIPE_DIR.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith(".pyc"))


def recipe_hash() -> str:
    """First 12 hex digits of sha256 over the recipe folder (relative paths, modes and contents)."""
    h = hashlib.sha256()
    for p in _recipe_files():
        h.update(p.relative_to(RECIPE_DIR).as_posix().encode() + b"\0")
        h.update(b"x" if os.access(p, os.X_OK) else b"-")
        h.update(p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def image_tag() -> str:
    """``arpo-desktop:<12-hex recipe hash>``; changes whenever any recipe file changes."""
    return f"{IMAGE_NAME}:{recipe_hash()}"


def packages() -> list[str]:
    """Debian packages from packages.txt (blank lines and '#' comments dropped)."""
    out = []
    for line in (RECIPE_DIR / "packages.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(line)
    return out


def _docker() -> str:
    exe = shutil.which("docker")
    if exe is None:
        raise DesktopBuildError("the docker CLI is not installed: run `apt-get install -y docker.io`")
    return exe


def check_engine() -> None:
    """Raise DesktopBuildError unless the docker CLI exists and the engine answers ``docker info``."""
    res = subprocess.run([_docker(), "info", "--format", "{{.ServerVersion}}"],
                         capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise DesktopBuildError(
            "the Docker engine is not running (`docker info` failed: "
            f"{res.stderr.strip() or res.stdout.strip()}); start it with "
            "`dockerd --iptables=false --bridge=none > /tmp/dockerd.log 2>&1 &` or `systemctl start docker`")


def image_exists(tag: str) -> bool:
    """True when the local engine holds an image called ``tag``."""
    res = subprocess.run([_docker(), "image", "inspect", tag], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, check=False)
    return res.returncode == 0


def apt_mirror() -> str:
    """The Debian mirror this host's apt uses for bookworm main ($ARPO_DEBIAN_MIRROR overrides)."""
    if os.environ.get("ARPO_DEBIAN_MIRROR"):
        return os.environ["ARPO_DEBIAN_MIRROR"]
    texts = []
    for p in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        try:
            texts.append(p.read_text())
        except OSError:
            continue
    for text in texts:
        for uri in re.findall(r"^\s*(?:deb\s+(?:\[[^\]]*\]\s+)?|URIs:\s*)(\S+)", text, re.MULTILINE):
            if re.search(r"/debian/?$", uri) and "security" not in uri:
                return uri.rstrip("/")
    return DEFAULT_MIRROR


def build_image(*, force: bool = False, log: Callable[[str], None] = print) -> str:
    """Build the desktop image if missing (or always when ``force``) and return its tag.

    Raises DesktopBuildError when docker or debootstrap is missing, the engine is not running, or a build
    step fails (with the step's last output lines).
    """
    check_engine()
    tag = image_tag()
    if image_exists(tag) and not force:
        log(f"desktop image {tag} already exists")
        return tag
    t0 = time.monotonic()
    if image_exists(BASE_IMAGE):
        _build_from_base(tag, log)
    else:
        _build_with_debootstrap(tag, log)
    subprocess.run([_docker(), "tag", tag, f"{IMAGE_NAME}:latest"], check=True)
    size = subprocess.run([_docker(), "image", "inspect", tag, "--format", "{{.Size}}"],
                          stdout=subprocess.PIPE, text=True, check=False).stdout.strip()
    log(f"built {tag} ({int(size or 0) / 1e6:.0f} MB) in {time.monotonic() - t0:.0f} s")
    return tag


def _run_logged(cmd: list[str], log: Callable[[str], None], *, what: str, quiet: re.Pattern | None = None,
                **kw) -> None:
    """Run ``cmd``, forwarding its output to ``log`` (lines matching ``quiet`` only counted)."""
    tail: list[str] = []
    counted = 0
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        tail = (tail + [line])[-20:]
        if quiet is not None and quiet.search(line):
            counted += 1
            if counted % 50 == 0:
                log(f"  {what}: {counted} package steps")
            continue
        log(f"  {line}")
    if proc.wait() != 0:
        raise DesktopBuildError(f"{what} failed (exit {proc.returncode}); last output:\n" + "\n".join(tail))


def _build_from_base(tag: str, log: Callable[[str], None]) -> None:
    log(f"building {tag} from local base image {BASE_IMAGE} with docker build")
    env_lines = "\n".join(f"ENV {k}={v}" for k, v in ENV.items())
    dockerfile = (
        f"FROM {BASE_IMAGE}\n"
        "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "
        f"{' '.join(packages())} && rm -rf /var/lib/apt/lists/* /usr/share/doc /usr/share/man\n"
        "COPY . /opt/arpo\n"
        "RUN chmod +x /opt/arpo/entrypoint.sh\n"
        f"{env_lines}\n"
        f"LABEL arpo.recipe={recipe_hash()}\n"
        f"ENTRYPOINT {ENTRYPOINT}\n")
    with tempfile.TemporaryDirectory(prefix="arpo-desktop-ctx-") as ctx:
        shutil.copytree(RECIPE_DIR, ctx, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        Path(ctx, "Dockerfile").write_text(dockerfile)
        _run_logged([_docker(), "build", "--network", "host", "-t", tag, ctx], log, what="docker build")


def _unmount_below(root: Path) -> None:
    """Unmount anything a failed debootstrap left mounted inside ``root`` (deepest first)."""
    prefix = str(root.resolve()) + "/"
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for m in sorted((m for m in mounts if m.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", m], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


def _build_with_debootstrap(tag: str, log: Callable[[str], None]) -> None:
    debootstrap = shutil.which("debootstrap") or ("/usr/sbin/debootstrap"
                                                  if Path("/usr/sbin/debootstrap").exists() else None)
    if debootstrap is None:
        raise DesktopBuildError(f"no local {BASE_IMAGE} image and debootstrap is not installed: run "
                                "`apt-get install -y debootstrap` (or load a debian:bookworm image)")
    if os.geteuid() != 0:
        raise DesktopBuildError("building the desktop image with debootstrap needs root")
    mirror = apt_mirror()
    workdir = Path(tempfile.mkdtemp(prefix="arpo-rootfs-", dir=os.environ.get("ARPO_BUILD_TMP", "/var/tmp")))
    rootfs = workdir / "rootfs"
    try:
        log(f"building {tag}: debootstrap {SUITE} from {mirror} into {rootfs} (about a minute)")
        _run_logged([debootstrap, "--variant=minbase", f"--include={','.join(packages())}", SUITE,
                     str(rootfs), mirror], log, what="debootstrap",
                    quiet=re.compile(r"^I: (Retrieving|Validating|Extracting|Unpacking|Configuring) "))
        _unmount_below(rootfs)
        for rel in TRIM:
            target = rootfs / rel
            if target.is_dir():
                shutil.rmtree(target)
                target.mkdir(parents=True)
        (rootfs / "var/lib/apt/lists/partial").mkdir(parents=True, exist_ok=True)
        shutil.copytree(RECIPE_DIR, rootfs / "opt/arpo", dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        (rootfs / "opt/arpo/entrypoint.sh").chmod(0o755)
        log(f"importing {rootfs} into docker as {tag}")
        changes = [f"ENTRYPOINT {ENTRYPOINT}", *(f"ENV {k}={v}" for k, v in ENV.items()),
                   f"LABEL arpo.recipe={recipe_hash()}"]
        cmd = [_docker(), "import"]
        for c in changes:
            cmd += ["--change", c]
        tar = subprocess.Popen(["tar", "--numeric-owner", "-C", str(rootfs), "-c", "."],
                               stdout=subprocess.PIPE)
        try:
            res = subprocess.run(cmd + ["-", tag], stdin=tar.stdout, capture_output=True, text=True,
                                 check=False)
        finally:
            assert tar.stdout is not None
            tar.stdout.close()
            tar_rc = tar.wait()
        if res.returncode != 0 or tar_rc != 0:
            raise DesktopBuildError(f"docker import failed (tar exit {tar_rc}, import exit {res.returncode}): "
                                    f"{res.stderr.strip()}")
    finally:
        _unmount_below(rootfs)
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """``arpo desktop build [--force] [--print-tag]``: build the desktop image; exit code 0 on success."""
    p = argparse.ArgumentParser(prog="arpo desktop build", description="Build the arpo desktop image locally.")
    p.add_argument("--force", action="store_true", help="rebuild even if the image exists")
    p.add_argument("--print-tag", action="store_true", help="print the image tag and exit")
    args = p.parse_args(argv)
    if args.print_tag:
        print(image_tag())
        return 0
    try:
        build_image(force=args.force)
    except DesktopBuildError as exc:
        print(f"error: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
