#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine (root, no GPU) for arpo-async; safe to run again (skips what is done).
#   1. Debian packages: docker.io (the engine), debootstrap (builds the desktop image without a registry),
#      chromium (tests/integration/test_viewer.py renders `arpo view`'s page in headless Chromium)
#   2. the Docker engine, started in the background if it is not answering
#   3. Python packages: torch 2.13.0 (CPU build), then this project with its test extras and the cluster
#      extra (ray: `arpo launch` and tests/integration/test_cluster.py)
#   4. the desktop image arpo-desktop:<version>, built locally if missing (not the ~2 GB osworld image: build
#      it with `arpo desktop build --profile osworld`; its tests build it through the osworld_image fixture)
#   5. host limits for hundreds of live desktops (scripts/host_limits.sh: inotify instances, pid_max); dockerd
#      is started with its open-files soft limit raised to the hard one
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '[bootstrap] %s\n' "$*"; }

if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null || ! command -v chromium >/dev/null; then
  say "installing docker.io, debootstrap and chromium"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq docker.io debootstrap chromium >/dev/null
fi

if ! docker info >/dev/null 2>&1; then
  say "starting the Docker engine (log: /tmp/dockerd.log)"
  ulimit -n "$(ulimit -Hn)" 2>/dev/null || ulimit -n 1048576 2>/dev/null || true  # dockerd: ~6.3 files per desktop
  nohup dockerd --iptables=false --bridge=none >/tmp/dockerd.log 2>&1 &
  for _ in $(seq 1 120); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 || { say "the Docker engine did not start; see /tmp/dockerd.log"; exit 1; }
fi

PY=${PYTHON:-python3}
if ! "$PY" -c 'import torch' 2>/dev/null; then
  say "installing torch 2.13.0 (CPU build)"
  "$PY" -m pip install -q torch==2.13.0
fi
say "installing arpo-async, its test tools and ray (the cluster extra)"
"$PY" -m pip install -q -e '.[test,cluster]'
command -v pyenv >/dev/null && pyenv rehash || true

scripts/host_limits.sh

say "building the desktop image if missing"
"$PY" -m arpo_cli.cli desktop build
say "ready"
