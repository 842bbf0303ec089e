#!/usr/bin/env bash
# The Python part of scripts/bootstrap.sh: a virtual environment .venv in the repository root, with torch 2.13.0
# (CPU build) and this checkout installed in it in editable mode with the test, cluster (ray) and docs
# (mkdocs-material) extras. Nothing is installed into the system Python, so a stock Debian 12 (PEP 668,
# "externally-managed-environment") takes it; Debian needs its python3-venv package (bootstrap installs it).
# No root needed. Safe to run again: when .venv already imports torch, the project (from this checkout), ray,
# mkdocs and pytest, and pyproject.toml has not changed since the last install, it only checks and returns.
#
#   bash scripts/setup_python.sh                  # with python3 (>= 3.11)
#   PYTHON=/usr/bin/python3.12 bash scripts/setup_python.sh
#   rm -rf .venv && bash scripts/setup_python.sh  # start over (e.g. to change the interpreter)
#
# Then: `. .venv/bin/activate` (arpo, arpo-serve, pytest, mkdocs on PATH) or call .venv/bin/arpo directly.
#
# Torch: `pip install torch==2.13.0` takes whatever the configured indexes offer. PyPI's Linux wheel of torch is the
# CUDA build (several GB with its nvidia-* packages). On a machine without a local CPU wheel, get the CPU build with
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup_python.sh
# (not the default here: the machines this project is tested on cannot reach download.pytorch.org and take the
# CPU wheel from a local folder through pip's find-links, e.g. PIP_FIND_LINKS=/opt/wheels). For a GPU host,
# install the CUDA build (the default) and then `.venv/bin/pip install -e '.[gpu]'`.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd -P)
PY=${PYTHON:-python3}
VENV=.venv
VPY=$VENV/bin/python
TORCH=2.13.0
EXTRAS=test,cluster,docs
STAMP=$VENV/.arpo-installed  # what the last editable install was made from (pyproject.toml's hash, the extras)
say() { printf '[setup-python] %s\n' "$*"; }
die() { say "FAIL: $*"; exit 1; }

# Does the script $1 run .venv's python at this checkout's path? pip writes "#!/path/.venv/bin/python", or for a
# long path or one with spaces, a /bin/sh line and then an exec line naming it.
bound_here() { head -n2 "$1" 2>/dev/null | grep -qF "$ROOT/$VPY"; }

want_stamp() { printf '%s %s\n' "$(sha256sum pyproject.toml | cut -d' ' -f1)" "$EXTRAS"; }

# Does .venv import everything, with arpo_async from this checkout and the `arpo` script bound to .venv's python?
# Run isolated (-I), from /, so that the checkout on sys.path cannot stand in for the editable install.
ready() {
  [[ -x $VPY && -f $STAMP && "$(cat "$STAMP")" == "$(want_stamp)" ]] || return 1
  bound_here "$VENV/bin/arpo" || return 1
  (cd / && "$ROOT/$VPY" -I - "$ROOT" "$TORCH" <<'EOF'
import pathlib, sys
import torch, arpo_async, actors, learner, arpo_serve, arpo_cli, ray, mkdocs, pytest  # noqa: F401
root, want = pathlib.Path(sys.argv[1]), sys.argv[2]
ok = pathlib.Path(arpo_async.__file__).resolve().is_relative_to(root) and torch.__version__.split("+")[0] == want
sys.exit(0 if ok else 1)
EOF
  ) >/dev/null 2>&1
}

if ready; then
  say "$VENV is ready ($("$VPY" -c 'import sys; print(sys.version.split()[0])'), torch $TORCH, arpo-async from $ROOT)"
  exit 0
fi

# 1. The environment. A .venv whose interpreter no longer runs (its base Python was removed) or whose scripts name
#    another folder (the checkout moved: a venv is not relocatable) is made again.
works_here() { "$VPY" -c '' 2>/dev/null && bound_here "$VENV/bin/pip"; }
if [[ -e $VENV ]] && ! works_here; then
  say "$VENV does not work from here (moved checkout or removed base Python): making it again"
  rm -rf "$VENV"
fi
if [[ ! -x $VPY ]]; then
  command -v "$PY" >/dev/null || die "no $PY (set PYTHON=/path/to/python3.11 or newer)"
  "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || die "$PY is older than Python 3.11"
  "$PY" -c 'import venv, ensurepip' 2>/dev/null \
    || die "$PY has no venv/ensurepip module: on Debian, apt-get install python3-venv (bootstrap.sh does)"
  say "creating $VENV with $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
  "$PY" -m venv "$VENV"
fi

# 2. pip: Debian 12's venv brings pip 23.0.1, which installs this project (PEP 660 editable installs need >= 21.3);
#    an older one is upgraded.
if ! "$VPY" -c 'import sys, pip; sys.exit(int(pip.__version__.split(".")[0]) < 23)' 2>/dev/null; then
  say "upgrading pip in $VENV"
  "$VPY" -m pip install -q --upgrade pip
fi

# 3. torch first, pinned, so that the project's `torch>=2.4,<=2.14.1` is already met when step 4 resolves it.
if ! "$VPY" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH')" 2>/dev/null; then
  say "installing torch==$TORCH"
  "$VPY" -m pip install -q "torch==$TORCH"
fi
say "torch $("$VPY" -W ignore -c 'import torch; print(torch.__version__, "(CUDA" if torch.version.cuda else "(CPU", "build)")')"

# 4. This checkout, editable, with its extras.
say "installing arpo-async from $ROOT (editable) with the $EXTRAS extras"
"$VPY" -m pip install -q -e ".[$EXTRAS]"
want_stamp >"$STAMP"
ready || die "$VENV was installed but does not import torch $TORCH, arpo_async (from $ROOT), ray, mkdocs, pytest"
say "ready: . $VENV/bin/activate (then arpo ...), or $VENV/bin/arpo"
