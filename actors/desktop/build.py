"""Builds the desktop images locally, without any image registry: ``arpo-desktop:<hash>`` (profile "default")
and ``arpo-desktop-osworld:<hash>`` (profile "osworld", OSWorld's apps and session).

Profile "default" (small; the default for ``arpo run``). The recipe is the folder ``actors/desktop/image/``
(packages.txt, python-wheels.txt, entrypoint.sh, controller.py and its modules, openbox config, apps/). The tag's
version is a short hash of that folder's content, so changing the recipe gives a new tag and a rebuild.
python-wheels.txt pins pure-Python packages from PyPI (pyautogui and its dependencies, for OSWorld's pyautogui
action strings); the host's pip installs them into the image's /usr/lib/python3/dist-packages
(:func:`install_wheels`), on both build paths. Two ways to build, chosen automatically:

* a Debian bookworm base image is present locally (``debian:bookworm``): ``docker build --network host``
  with a generated Dockerfile;
* otherwise: ``debootstrap --variant=minbase bookworm ROOTFS <mirror>``, then ``apt-get install
  --no-install-recommends <packages>`` in a chroot of it (apt, unlike debootstrap's --include, resolves
  alternatives such as dconf-service's ``dbus-session-bus``), copy the recipe to ROOTFS/opt/arpo, trim caches
  and docs, then ``tar -C ROOTFS -c . | docker import --change ... - TAG``. Needs root and the debootstrap
  package; the rootfs is always removed afterwards.

Profile "osworld" (``actors/desktop/profiles/osworld/``: packages.txt, setup.sh) is built in two
layers, so that editing the controller does not reinstall ~2 GB of apps:

* the base ``arpo-desktop-osworld-base:<hash of the package and wheel lists>``: the default image's packages
  plus the profile's (chromium, LibreOffice calc/writer/impress, GIMP, VLC, Thunderbird, gnome-terminal, gedit,
  nautilus, ffmpeg, fonts, D-Bus + dconf + GNOME schemas, AT-SPI, pulseaudio, tools), the wheels, no recipe;
  built as above;
* VS Code's layer ``arpo-desktop-osworld-vscode:<hash>``, ``FROM`` the base: code-server and Node 24 from npm
  and PyPI (:mod:`actors.desktop.vscode_layer`), built only when missing, as the base;
* the final image, ``FROM`` VS Code's layer, with the recipe at /opt/arpo and the profile at /opt/arpo-profile, made
  by a small ``docker build --network none`` that runs setup.sh (home folders, /home/user, google-chrome,
  dconf defaults, the `code` launcher); its tag hashes the recipe, the profile folder and VS Code's layer's tag.
  Same entrypoint, controller, reset and hardening as the default image; HOME=/home/user and
  XDG_RUNTIME_DIR=/run/user/1000 (the session D-Bus at /run/user/1000/bus, OSWorld's address).

No Debian package: Google Chrome (Debian's chromium runs as ``google-chrome``, with --no-sandbox, see setup.sh)
and VS Code (code-server, from npm, runs as ``code``: the profile's ``code`` script).

Also tags the result ``<image name>:latest``. Wired as ``arpo desktop build [--force] [--profile P]`` (:func:`main`).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from actors.desktop.vscode_layer import build_layer, layer_tag

RECIPE_DIR = Path(__file__).resolve().parent / "image"
PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
PROFILES = ("default", "osworld")
"""Image profiles: "default" (arpo-desktop, the Tk task apps) and "osworld" (arpo-desktop-osworld)."""
IMAGE_NAME = "arpo-desktop"
BASE_IMAGE = "debian:bookworm"
SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
ENTRYPOINT = '["/opt/arpo/entrypoint.sh"]'
WHEELS_FILE = "python-wheels.txt"
DIST_PACKAGES = "usr/lib/python3/dist-packages"  # Debian's python3 path for packages outside the stdlib
ENV = {"DISPLAY": ":0", "LANG": "C.UTF-8", "HOME": "/root", "ARPO_SCREEN": "1280x720x24"}
# The osworld session's environment (OSWorld's VM: user "user", uid 1000, home /home/user); entrypoint.sh
# starts the session D-Bus at $XDG_RUNTIME_DIR/bus.
OSWORLD_ENV = {"HOME": "/home/user", "XDG_RUNTIME_DIR": "/run/user/1000"}
# Paths trimmed from the debootstrap rootfs (relative to it): package caches, docs, translations.
TRIM = ["var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man",
        "usr/share/info", "usr/share/locale"]


class DesktopBuildError(RuntimeError):
    """The desktop image could not be built; the message says what failed and what to run."""


def _check_profile(profile: str) -> None:
    if profile not in PROFILES:
        raise DesktopBuildError(f"unknown desktop image profile {profile!r}; known: {', '.join(PROFILES)}")


def _folder_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith(".pyc"))


def _hash_folder(h, folder: Path) -> None:
    """Feed ``folder``'s files (relative paths, executable bits and contents) into the hash ``h``."""
    for p in _folder_files(folder):
        h.update(p.relative_to(folder).as_posix().encode() + b"\0")
        h.update(b"x" if os.access(p, os.X_OK) else b"-")
        h.update(p.read_bytes() + b"\0")


def recipe_hash() -> str:
    """First 12 hex digits of sha256 over the recipe folder (relative paths, modes and contents)."""
    h = hashlib.sha256()
    _hash_folder(h, RECIPE_DIR)
    return h.hexdigest()[:12]


def image_name(profile: str = "default") -> str:
    """``arpo-desktop`` for the default profile, ``arpo-desktop-<profile>`` for the others."""
    _check_profile(profile)
    return IMAGE_NAME if profile == "default" else f"{IMAGE_NAME}-{profile}"


def profile_dir(profile: str) -> Path:
    """The folder of a non-default profile (packages.txt, setup.sh)."""
    _check_profile(profile)
    if profile == "default":
        raise DesktopBuildError("the default profile has no profile folder (its recipe is actors/desktop/image)")
    return PROFILES_DIR / profile


def base_tag(profile: str) -> str:
    """``arpo-desktop-<profile>-base:<12 hex>``: the apps layer, hashed over the package and wheel lists (in
    order; comments do not count) and the Debian suite, so only a list change rebuilds it."""
    h = hashlib.sha256(SUITE.encode() + b"\0")
    for item in [*profile_packages(profile), "--wheels--", *python_wheels()]:
        h.update(item.encode() + b"\0")
    return f"{image_name(profile)}-base:{h.hexdigest()[:12]}"


def image_tag(profile: str = "default") -> str:
    """The image tag of ``profile``: ``arpo-desktop:<12-hex recipe hash>`` for "default"; for another profile
    ``arpo-desktop-<profile>:<12 hex>`` over the recipe, the profile folder and :func:`base_tag`. Changes
    whenever any of them changes. DesktopBuildError for an unknown profile."""
    if image_name(profile) == IMAGE_NAME:
        return f"{IMAGE_NAME}:{recipe_hash()}"
    h = hashlib.sha256(layer_tag(base_tag(profile)).encode() + b"\0")
    _hash_folder(h, RECIPE_DIR)
    h.update(b"--profile--\0")
    _hash_folder(h, profile_dir(profile))
    return f"{image_name(profile)}:{h.hexdigest()[:12]}"


def _list_file(path: Path) -> list[str]:
    """Non-empty lines of a list file, '#' comments and surrounding blanks dropped."""
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(line)
    return out


def packages() -> list[str]:
    """Debian packages from packages.txt (blank lines and '#' comments dropped)."""
    return _list_file(RECIPE_DIR / "packages.txt")


def profile_packages(profile: str) -> list[str]:
    """Debian packages of ``profile``'s image: the default's, then the profile's packages.txt (new ones only)."""
    base = packages()
    if image_name(profile) == IMAGE_NAME:
        return base
    return base + [p for p in _list_file(profile_dir(profile) / "packages.txt") if p not in base]


def python_wheels() -> list[str]:
    """Pinned PyPI requirements from python-wheels.txt (``name==version``; pure-Python packages only)."""
    reqs = _list_file(RECIPE_DIR / WHEELS_FILE)
    for r in reqs:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+==[A-Za-z0-9_.!+-]+", r):
            raise DesktopBuildError(f"{WHEELS_FILE}: {r!r} is not a pinned requirement (name==version)")
    return reqs


def install_wheels(requirements: list[str], target: Path, log: Callable[[str], None]) -> None:
    """Install pure-Python ``requirements`` into ``target`` (an image's dist-packages) with the host's pip.

    ``pip install --no-deps --no-compile --target TARGET``: no dependency resolution (the list pins every
    package; compiled dependencies come from Debian), no bytecode (the image's python3 writes none either).
    Needs the host's pip and PyPI (or the pip index the host is configured for). Raises DesktopBuildError
    when pip is missing or fails, or when a requirement installs a compiled extension (it would be built
    for the host's Python, not the image's).
    """
    if not requirements:
        return
    log(f"installing {len(requirements)} Python packages into {target} with the host's pip")
    with tempfile.TemporaryDirectory(prefix="arpo-wheels-") as staging:
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
               "--disable-pip-version-check", "--no-warn-script-location", "--target", staging, *requirements]
        _run_logged(cmd, log, what="pip install", quiet=re.compile(r"^WARNING: (Location|Running pip)"))
        compiled = sorted(str(p.relative_to(staging)) for p in Path(staging).rglob("*.so"))
        if compiled:
            raise DesktopBuildError(f"{WHEELS_FILE} must list pure-Python packages only; compiled: {compiled}")
        shutil.rmtree(Path(staging, "bin"), ignore_errors=True)  # console scripts name the host's python
        shutil.copytree(staging, target, dirs_exist_ok=True)


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


def build_image(*, force: bool = False, log: Callable[[str], None] = print, profile: str = "default") -> str:
    """Build ``profile``'s desktop image if missing (or always when ``force``) and return its tag.

    For "osworld" the apps layer (:func:`base_tag`) and VS Code's layer are built only when missing, even with
    ``force`` (remove them with ``docker rmi`` to rebuild them): ``force`` rebuilds the final layer. Raises
    DesktopBuildError for an unknown profile, when docker or debootstrap is missing, the engine is not running,
    or a build step fails (with the step's last output lines).
    """
    check_engine()
    tag = image_tag(profile)
    if image_exists(tag) and not force:
        log(f"desktop image {tag} already exists")
        return tag
    t0 = time.monotonic()
    if profile == "default":
        _build_rootfs_image(tag, packages(), log, recipe=True)
    else:
        base = base_tag(profile)
        if image_exists(base):
            log(f"apps layer {base} already exists")
        else:
            _build_rootfs_image(base, profile_packages(profile), log, recipe=False)
            log(f"built {base} ({image_size_mb(base):.0f} MB) in {time.monotonic() - t0:.0f} s")
        t1 = time.monotonic()
        vscode = layer_tag(base)
        if image_exists(vscode):
            log(f"VS Code layer {vscode} already exists")
        else:
            build_layer(base, log, _run_logged)
            log(f"built {vscode} ({image_size_mb(vscode):.0f} MB) in {time.monotonic() - t1:.0f} s")
        t1 = time.monotonic()
        _build_profile_image(tag, vscode, profile, log)
        log(f"final layer built in {time.monotonic() - t1:.0f} s")
    subprocess.run([_docker(), "tag", tag, f"{image_name(profile)}:latest"], check=True)
    log(f"built {tag} ({image_size_mb(tag):.0f} MB) in {time.monotonic() - t0:.0f} s")
    return tag


def image_size_mb(tag: str) -> float:
    """The image's size as ``docker image inspect`` reports it (all layers), MB (1e6 bytes); 0 if missing."""
    size = subprocess.run([_docker(), "image", "inspect", tag, "--format", "{{.Size}}"],
                          stdout=subprocess.PIPE, text=True, check=False).stdout.strip()
    return int(size or 0) / 1e6


def _build_rootfs_image(tag: str, pkgs: list[str], log: Callable[[str], None], *, recipe: bool) -> None:
    """An image with the Debian packages ``pkgs`` and the wheels; with ``recipe`` also the recipe at /opt/arpo
    and the default entrypoint. From debian:bookworm when present locally, else debootstrap."""
    if image_exists(BASE_IMAGE):
        _build_from_base(tag, pkgs, log, recipe=recipe)
    else:
        _build_with_debootstrap(tag, pkgs, log, recipe=recipe)


def _build_profile_image(tag: str, base: str, profile: str, log: Callable[[str], None]) -> None:
    """``FROM base``: the recipe at /opt/arpo, the profile at /opt/arpo-profile, its setup.sh run once; no
    network (``docker build --network none``)."""
    log(f"building {tag} from {base} with docker build (no network)")
    env_lines = "\n".join(f"ENV {k}={v}" for k, v in {**ENV, **OSWORLD_ENV}.items())
    dockerfile = (
        f"FROM {base}\n"
        "COPY recipe/ /opt/arpo/\n"
        "COPY profile/ /opt/arpo-profile/\n"
        "RUN chmod +x /opt/arpo/entrypoint.sh /opt/arpo-profile/setup.sh && /opt/arpo-profile/setup.sh\n"
        f"{env_lines}\n"
        f"LABEL arpo.recipe={recipe_hash()} arpo.profile={profile} arpo.base={base}\n"
        f"ENTRYPOINT {ENTRYPOINT}\n")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    with tempfile.TemporaryDirectory(prefix="arpo-desktop-ctx-") as ctx:
        shutil.copytree(RECIPE_DIR, Path(ctx, "recipe"), ignore=ignore)
        shutil.copytree(profile_dir(profile), Path(ctx, "profile"), ignore=ignore)
        Path(ctx, "Dockerfile").write_text(dockerfile)
        _run_logged([_docker(), "build", "--network", "none", "-t", tag, ctx], log, what="docker build")


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


def _build_from_base(tag: str, pkgs: list[str], log: Callable[[str], None], *, recipe: bool) -> None:
    log(f"building {tag} from local base image {BASE_IMAGE} with docker build")
    env_lines = "\n".join(f"ENV {k}={v}" for k, v in ENV.items())
    recipe_lines = ("COPY recipe/ /opt/arpo/\n"
                    "RUN chmod +x /opt/arpo/entrypoint.sh\n"
                    f"LABEL arpo.recipe={recipe_hash()}\n") if recipe else ""
    dockerfile = (
        f"FROM {BASE_IMAGE}\n"
        "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "
        f"{' '.join(pkgs)} && rm -rf /var/lib/apt/lists/* /usr/share/doc /usr/share/man\n"
        f"COPY wheels/ /{DIST_PACKAGES}/\n"
        f"{recipe_lines}"
        f"{env_lines}\n"
        f"ENTRYPOINT {ENTRYPOINT}\n")
    with tempfile.TemporaryDirectory(prefix="arpo-desktop-ctx-") as ctx:
        if recipe:
            shutil.copytree(RECIPE_DIR, Path(ctx, "recipe"), ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        install_wheels(python_wheels(), Path(ctx, "wheels"), log)
        Path(ctx, "Dockerfile").write_text(dockerfile)
        _run_logged([_docker(), "build", "--network", "host", "-t", tag, ctx], log, what="docker build")


def _unmount_below(root: Path) -> None:
    """Unmount anything a failed debootstrap left mounted inside ``root`` (deepest first)."""
    prefix = str(root.resolve()) + "/"
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for m in sorted((m for m in mounts if m.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", m], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


def _build_with_debootstrap(tag: str, pkgs: list[str], log: Callable[[str], None], *, recipe: bool) -> None:
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
        _run_logged([debootstrap, "--variant=minbase", SUITE, str(rootfs), mirror], log, what="debootstrap",
                    quiet=re.compile(r"^I: (Retrieving|Validating|Extracting|Unpacking|Configuring) "))
        _unmount_below(rootfs)
        _chroot_install(rootfs, pkgs, log)
        for rel in TRIM:
            target = rootfs / rel
            if target.is_dir():
                shutil.rmtree(target)
                target.mkdir(parents=True)
        (rootfs / "var/lib/apt/lists/partial").mkdir(parents=True, exist_ok=True)
        install_wheels(python_wheels(), rootfs / DIST_PACKAGES, log)
        changes = [f"ENTRYPOINT {ENTRYPOINT}", *(f"ENV {k}={v}" for k, v in ENV.items())]
        if recipe:
            shutil.copytree(RECIPE_DIR, rootfs / "opt/arpo", dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            (rootfs / "opt/arpo/entrypoint.sh").chmod(0o755)
            changes.append(f"LABEL arpo.recipe={recipe_hash()}")
        log(f"importing {rootfs} into docker as {tag}")
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


def _chroot_install(rootfs: Path, pkgs: list[str], log: Callable[[str], None]) -> None:
    """``apt-get install --no-install-recommends pkgs`` inside the debootstrap rootfs (chroot, host network,
    /proc mounted, services kept from starting by a policy-rc.d); apt's lists and cache are trimmed later."""
    policy = rootfs / "usr/sbin/policy-rc.d"
    resolv = rootfs / "etc/resolv.conf"
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    resolv.unlink(missing_ok=True)
    shutil.copyfile("/etc/resolv.conf", resolv)
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DEBIAN_FRONTEND": "noninteractive", "LANG": "C.UTF-8",
           "HOME": "/root"}
    subprocess.run(["mount", "-t", "proc", "proc", str(rootfs / "proc")], check=True)
    try:
        log(f"installing {len(pkgs)} packages and their dependencies with apt-get in the rootfs")
        _run_logged(["chroot", str(rootfs), "apt-get", "update"], log, what="apt-get update", env=env)
        _run_logged(["chroot", str(rootfs), "apt-get", "install", "-y", "--no-install-recommends", *pkgs], log,
                    what="apt-get install", env=env,
                    quiet=re.compile(r"^(Get:|Unpacking |Setting up |Selecting |Preparing to unpack |"
                                     r"Processing triggers |\(Reading database)"))
        subprocess.run(["chroot", str(rootfs), "apt-get", "clean"], env=env, check=False)
    finally:
        _unmount_below(rootfs)
        policy.unlink(missing_ok=True)
        resolv.unlink(missing_ok=True)
        resolv.write_text("")


def main(argv: list[str] | None = None) -> int:
    """``arpo desktop build [--force] [--profile P] [--print-tag]``: build a desktop image; exit code 0 on
    success, 1 with the error on stdout."""
    p = argparse.ArgumentParser(prog="arpo desktop build", description="Build the arpo desktop image locally.")
    p.add_argument("--force", action="store_true", help="rebuild even if the image exists")
    p.add_argument("--profile", choices=PROFILES, default="default",
                   help="default (small, the Tk task apps) or osworld (OSWorld's apps and session, ~2 GB)")
    p.add_argument("--print-tag", action="store_true", help="print the image tag and exit")
    args = p.parse_args(argv)
    if args.print_tag:
        print(image_tag(args.profile))
        return 0
    try:
        build_image(force=args.force, profile=args.profile)
    except DesktopBuildError as exc:
        print(f"error: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
