#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine (root, no GPU) for arpo-async; safe to run again (skips what is done).
#   1. Debian packages: python3-venv (Debian's python3 refuses pip installs outside a virtual environment, PEP 668)
#      and ca-certificates when missing, docker.io (the engine), debootstrap (builds the desktop image without a
#      registry), chromium (tests/integration/test_viewer.py renders `arpo view`'s page in headless Chromium)
#   2. the Docker engine, started in the background if it is not answering
#   3. Python (scripts/setup_python.sh): a virtual environment .venv in the repository root with torch 2.13.0 (CPU
#      build) and this checkout, editable, with its test, cluster (ray: `arpo launch` and
#      tests/integration/test_cluster.py) and docs (mkdocs-material) extras. Nothing goes into the system Python.
#      PYTHON=/path/to/python3 picks the interpreter that makes .venv (default python3; Python >= 3.11).
#   4. host limits for hundreds of live desktops (scripts/host_limits.sh: inotify instances, pid_max); dockerd
#      is started with its open-files soft limit raised to the hard one
#   5. the desktop image arpo-desktop:<version>, built locally if missing (not the ~2 GB osworld image: build
#      it with `.venv/bin/arpo desktop build --profile osworld`; its tests build it through the osworld_image
#      fixture)
# Then: `. .venv/bin/activate` and `arpo ...`, or `.venv/bin/arpo ...` without activating.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '[bootstrap] %s\n' "$*"; }

PY=${PYTHON:-python3}
packages=()
command -v dockerd >/dev/null || packages+=(docker.io)
command -v debootstrap >/dev/null || [[ -x /usr/sbin/debootstrap ]] || packages+=(debootstrap)
command -v chromium >/dev/null || packages+=(chromium)
# Debian splits venv's ensurepip (the pip a new environment starts with) into python3-venv; an interpreter of
# one's own (pyenv, a python.org build) has it already.
"$PY" -c 'import venv, ensurepip' 2>/dev/null || packages+=(python3-venv)
[[ -s /etc/ssl/certs/ca-certificates.crt ]] || packages+=(ca-certificates)  # pip's HTTPS (Debian's pip reads this file)
if ((${#packages[@]})); then
  say "installing ${packages[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${packages[@]}" >/dev/null
fi

if ! docker info >/dev/null 2>&1; then
  say "starting the Docker engine (log: /tmp/dockerd.log)"
  ulimit -n "$(ulimit -Hn)" 2>/dev/null || ulimit -n 1048576 2>/dev/null || true  # dockerd: ~6.3 files per desktop
  nohup dockerd --iptables=false --bridge=none >/tmp/dockerd.log 2>&1 &
  for _ in $(seq 1 120); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 || { say "the Docker engine did not start; see /tmp/dockerd.log"; exit 1; }
fi

bash scripts/setup_python.sh

scripts/host_limits.sh

say "building the desktop image if missing"
.venv/bin/arpo desktop build
say "ready. Use the environment with '. .venv/bin/activate' (then arpo, arpo-serve, pytest, mkdocs), or call"
say ".venv/bin/arpo and .venv/bin/python directly, e.g. .venv/bin/arpo run --out runs/demo --config configs/grid4.toml"
