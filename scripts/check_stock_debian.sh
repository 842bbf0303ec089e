#!/usr/bin/env bash
# Checks that scripts/setup_python.sh (bootstrap's Python part) works on a stock Debian 12 with Debian's own python3.
# Root, Linux, debootstrap, network access to deb.debian.org and pypi.org. Prints PASS or FAIL with each phase's
# seconds; exit 0 on PASS, 1 on FAIL. The result is recorded in docs/stock-debian.md.
#
#   sudo bash scripts/check_stock_debian.sh            # reuses the cached bookworm root file system
#   sudo bash scripts/check_stock_debian.sh --fresh    # builds it again (and empties the cache of .deb files)
#
# Phases:
#   rootfs   debootstrap --variant=minbase bookworm from http://deb.debian.org/debian (cached under
#            $CACHE/rootfs; the default CACHE is /var/tmp/arpo-stock-debian)
#   copy     a fresh copy of it for this run ($CACHE/run, about 3 GB with .venv; left for inspection, the next run
#            replaces it)
#   apt      in the chroot: apt-get install python3 python3-venv ca-certificates (bookworm, bookworm-updates,
#            bookworm-security), the packages bootstrap's apt step adds for Python
#   ca       the host's own certificate authorities (/usr/local/share/ca-certificates/*.crt, e.g. an HTTPS proxy's)
#            are added to the chroot's trust store with update-ca-certificates, as a user behind such a proxy does
#            on any machine; Debian's pip in .venv uses that store. None on the host: nothing to do.
#   pep668   Debian's python3 refuses a plain `pip install` (the marker /usr/lib/python3.11/EXTERNALLY-MANAGED
#            exists; Debian's own pip 23.0.1, run from the wheel that python3-venv brings (python3-pip-whl), exits with
#            "externally-managed-environment"), and `python3 -m pip` does not exist
#   clone    the repository as a clone has it: `git archive HEAD` (committed files only) into /root/arpo-async
#   setup    PYTHON=/usr/bin/python3 bash scripts/setup_python.sh in the chroot, with a clean environment (no host
#            pip configuration: the host's /etc/pip.conf and PIP_* variables do not enter the chroot)
#   rerun    setup_python.sh again: it must find .venv ready and return
#   use      .venv's python is Debian's; .venv imports torch, transformers, zmq, arpo_async, learner, actors;
#            `arpo --help`; `arpo config show`; pytest on tests/unit/test_config.py and tests/unit/test_codec.py
#
# Torch: PyPI's torch 2.13.0 for Linux is the CUDA build (several GB). When the folder $WHEELS (default /opt/wheels)
# holds a torch-2.13.0+cpu wheel, it is bind-mounted read-only into the chroot and passed as PIP_FIND_LINKS, so the
# CPU wheel is taken from that local folder instead of download.pytorch.org (which the machines this project is
# tested on cannot reach); everything else comes from PyPI. Without such a folder, PIP_EXTRA_INDEX_URL is set to
# https://download.pytorch.org/whl/cpu when that answers; otherwise the check stops (FAIL) rather than download
# the CUDA build.
#
# Not covered: the Docker engine inside the chroot (bootstrap's apt and Docker steps), the desktop image, host
# limits; the tests that need Docker or a desktop.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd -P)
CACHE=${CACHE:-/var/tmp/arpo-stock-debian}
WHEELS=${WHEELS:-/opt/wheels}
MIRROR=http://deb.debian.org/debian
ROOTFS=$CACHE/rootfs
RUN=$CACHE/run
FRESH=0
[[ ${1:-} == --fresh ]] && FRESH=1
[[ $# -gt 0 && ${1:-} != --fresh ]] && { echo "usage: $0 [--fresh]" >&2; exit 2; }
say() { printf '[stock-debian] %s\n' "$*"; }
[[ $(id -u) == 0 ]] || { say "FAIL: needs root (debootstrap, chroot, mount)"; exit 1; }

# Torch's CPU wheel: from a local folder, else from download.pytorch.org; never PyPI's CUDA build.
CHROOT_ENV=(PYTHON=/usr/bin/python3)
if compgen -G "$WHEELS/torch-2.13.0+cpu-*.whl" >/dev/null; then
  CHROOT_ENV+=("PIP_FIND_LINKS=$WHEELS")
  TORCH_FROM="the local folder $WHEELS (bind-mounted read-only, PIP_FIND_LINKS=$WHEELS)"
elif curl -sfI --max-time 15 https://download.pytorch.org/whl/cpu/torch/ >/dev/null; then
  CHROOT_ENV+=(PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu)
  TORCH_FROM="https://download.pytorch.org/whl/cpu (PIP_EXTRA_INDEX_URL)"
  WHEELS=
else
  say "FAIL: no torch-2.13.0+cpu wheel in $WHEELS and download.pytorch.org does not answer (not downloading the" \
    "CUDA build from PyPI); set WHEELS=/folder/with/the/wheel"
  exit 1
fi
COMMIT=$(git rev-parse --short HEAD)  # what the clone phase copies

# --- phases: each is timed; the first failure ends the check ---
RESULTS=()
summary() {
  local mem host
  mem=$(awk '/^MemTotal:/ { printf "%.0f", $2 / 1048576 }' /proc/meminfo)
  host=$(. /etc/os-release && echo "$PRETTY_NAME")
  say "commit ${COMMIT:-?} (git archive), $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores, $mem GiB, host: $host"
  for r in "${RESULTS[@]}"; do say "  $r"; done
}
phase() {  # phase NAME FUNCTION: run FUNCTION in a subshell with errexit (its first failing command fails it)
  local name=$1 start end rc
  say "=== $name"
  start=$(date +%s.%N)
  set +e
  (set -e; "$2")
  rc=$?
  set -e
  end=$(date +%s.%N)
  local secs
  secs=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
  if ((rc == 0)); then
    RESULTS+=("$(printf '%-7s PASS %7s s' "$name" "$secs")")
  else
    RESULTS+=("$(printf '%-7s FAIL %7s s (exit %d)' "$name" "$secs" "$rc")")
    summary
    say "FAIL"
    exit 1
  fi
}

# --- mounts: every mount under $RUN is undone on exit, and $RUN is never removed while anything is mounted in it ---
mounts_under() { awk -v p="$1/" 'index($2 "/", p) == 1 { print $2 }' /proc/mounts | sort -r; }
unmount_all() {
  local m
  for m in $(mounts_under "$RUN"); do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true; done
}
trap unmount_all EXIT
bind() {  # bind SOURCE TARGET [ro]
  mkdir -p "$2"
  mount --bind "$1" "$2"
  [[ ${3:-} == ro ]] && mount -o remount,bind,ro "$2"
  return 0
}
in_chroot() {  # in_chroot COMMAND...: a clean environment, as a root login shell on the new system would have
  chroot "$RUN" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "${CHROOT_ENV[@]}" "$@"
}

# --- the phases ---
rootfs() {
  if ((FRESH)) || [[ ! -x $ROOTFS/usr/bin/apt-get || ! -f $ROOTFS/.arpo-complete ]]; then
    command -v debootstrap >/dev/null || [[ -x /usr/sbin/debootstrap ]] || apt-get install -y -qq debootstrap
    rm -rf --one-file-system "$ROOTFS" "$CACHE/apt-archives"
    mkdir -p "$CACHE"
    say "debootstrap --variant=minbase bookworm $ROOTFS $MIRROR"
    PATH=$PATH:/usr/sbin debootstrap --variant=minbase bookworm "$ROOTFS" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
      || { tail -20 "$CACHE/debootstrap.log"; return 1; }
    # what the Debian installer writes: the release, its updates and its security archive
    printf '%s\n' "deb $MIRROR bookworm main" "deb $MIRROR bookworm-updates main" \
      "deb http://deb.debian.org/debian-security bookworm-security main" >"$ROOTFS/etc/apt/sources.list"
    touch "$ROOTFS/.arpo-complete"
  else
    say "reusing $ROOTFS (built $(date -u -r "$ROOTFS/.arpo-complete" +%Y-%m-%dT%H:%MZ); --fresh rebuilds it)"
  fi
}

copy() {
  unmount_all
  [[ -z $(mounts_under "$RUN") ]] || { say "something is still mounted under $RUN: not removing it"; return 1; }
  rm -rf --one-file-system "$RUN"
  cp -a "$ROOTFS" "$RUN"
  bind /proc "$RUN/proc"
  bind /sys "$RUN/sys"
  bind /dev "$RUN/dev"
  bind /dev/pts "$RUN/dev/pts"
  mkdir -p "$CACHE/apt-archives/partial"
  bind "$CACHE/apt-archives" "$RUN/var/cache/apt/archives"  # reruns need not download the .debs again
  [[ -z $WHEELS ]] || bind "$WHEELS" "$RUN$WHEELS" ro
  cp -L /etc/resolv.conf "$RUN/etc/resolv.conf"
}

apt_step() {
  in_chroot apt-get update -qq
  in_chroot env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    python3 python3-venv ca-certificates >/dev/null
  local version
  version=$(in_chroot dpkg-query -W -f='${Version}' python3.11)
  say "$(in_chroot /usr/bin/python3 --version) at /usr/bin/python3 (Debian package python3.11 $version)"
}

ca() {
  local crts=(/usr/local/share/ca-certificates/*.crt)
  [[ -e ${crts[0]} ]] || { say "no local certificate authorities on the host"; return 0; }
  cp "${crts[@]}" "$RUN/usr/local/share/ca-certificates/"
  say "added the host's ${crts[*]##*/}"
  in_chroot update-ca-certificates 2>&1 | grep -v -e '^rehash: warning: skipping ca-certificates.crt' -e '^Updating' \
    -e '^Running hooks' -e '^done' -e 'added, .* removed' || true
  in_chroot test -s /etc/ssl/certs/ca-certificates.crt
}

pep668() {
  [[ -f $RUN/usr/lib/python3.11/EXTERNALLY-MANAGED ]] || { say "no /usr/lib/python3.11/EXTERNALLY-MANAGED"; return 1; }
  say "/usr/lib/python3.11/EXTERNALLY-MANAGED exists"
  if in_chroot /usr/bin/python3 -m pip --version >/dev/null 2>&1; then
    say "python3 -m pip exists (unexpected on a stock system without python3-pip)"; return 1
  fi
  say "python3 -m pip: $(in_chroot /usr/bin/python3 -m pip --version 2>&1 | tail -1)"
  local wheel out rc=0
  wheel=$(cd "$RUN" && ls usr/share/python-wheels/pip-*.whl | head -1)
  out=$(in_chroot /usr/bin/python3 "/$wheel/pip" install --no-input six 2>&1) || rc=$?
  if ((rc == 0)) || ! grep -q externally-managed-environment <<<"$out"; then
    say "Debian's pip did not refuse: exit $rc"; printf '%s\n' "$out" | tail -5; return 1
  fi
  say "Debian's pip (/$wheel) refuses: exit $rc, $(grep -m1 -o 'error: externally-managed-environment' <<<"$out")"
}

clone() {
  mkdir -p "$RUN/root/arpo-async"
  git -C "$REPO" archive "$COMMIT" | tar -x -C "$RUN/root/arpo-async"
  say "git archive $COMMIT: $(git -C "$REPO" ls-tree -r --name-only "$COMMIT" | wc -l) files"
  [[ -z $(git -C "$REPO" status --porcelain --untracked-files=no -- scripts/setup_python.sh pyproject.toml) ]] \
    || say "note: scripts/setup_python.sh or pyproject.toml has uncommitted changes; the check uses HEAD's"
}

setup() {
  say "torch's CPU wheel from $TORCH_FROM"
  in_chroot bash -c 'cd /root/arpo-async && bash scripts/setup_python.sh'
}
rerun() {
  local out
  out=$(in_chroot bash -c 'cd /root/arpo-async && bash scripts/setup_python.sh') || return 1
  printf '%s\n' "$out"
  grep -q "is ready" <<<"$out"
}
use() {
  cat >"$RUN/tmp/versions.py" <<'EOF'
import sys
import torch, transformers, zmq, arpo_async, learner, actors  # noqa: F401
print("[stock-debian] .venv: Python", sys.version.split()[0], "based on", sys._base_executable, "| torch",
      torch.__version__, "| transformers", transformers.__version__, "| pyzmq", zmq.__version__)
EOF
  in_chroot bash -euo pipefail -c '
    cd /root/arpo-async
    grep -qx "home = /usr/bin" .venv/pyvenv.cfg
    .venv/bin/python /tmp/versions.py
    .venv/bin/arpo --help | head -3
    .venv/bin/arpo config show >/tmp/config.txt
    head -5 /tmp/config.txt
    .venv/bin/python -m pytest -q -p no:cacheprovider tests/unit/test_config.py tests/unit/test_codec.py 2>&1 | tail -3
  '
}

say "checking scripts/setup_python.sh on Debian 12 (bookworm) in a chroot; cache: $CACHE"
phase rootfs rootfs
phase copy copy
phase apt apt_step
phase ca ca
phase pep668 pep668
phase clone clone
phase setup setup
phase rerun rerun
phase use use
summary
say "PASS"
