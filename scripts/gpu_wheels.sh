#!/usr/bin/env bash
# Download the wheels scripts/gpu_check.sh needs on a GPU machine that has no internet: the packages of
# scripts/gpu_requirements.txt (what the project needs beyond PyTorch with CUDA and transformers), as binary wheels
# for the GPU machine's Python, with no dependencies of theirs (the list names each one the check needs). Run it
# where PyPI is reachable; carry the folder to the GPU machine with the checkout (about 19 MiB; the budget is 30).
#
#   bash scripts/gpu_wheels.sh                # -> .gpu-wheels/ (git ignores it), for CPython 3.12 on x86-64 Linux
#   GPU_PYTHON_VERSION=3.11 bash scripts/gpu_wheels.sh /tmp/wheels   # another Python; another folder
#
# Environment: GPU_PYTHON_VERSION (default 3.12), PYTHON (the pip to download with: .venv/bin/python when it
# exists, else python3), WHEELS_BUDGET_MIB (default 30: more than that fails). Prints each wheel and the total.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z ${PYTHON:-} && -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=${PYTHON:-python3}; fi
OUT=${1:-.gpu-wheels}
VERSION=${GPU_PYTHON_VERSION:-3.12}
BUDGET_MIB=${WHEELS_BUDGET_MIB:-30}
say() { printf '[gpu-wheels] %s\n' "$*"; }

rm -rf "$OUT.partial"
mkdir -p "$OUT.partial"
platforms=()
for p in manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_24_x86_64 manylinux_2_26_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_28_x86_64; do platforms+=(--platform "$p"); done
say "downloading scripts/gpu_requirements.txt for CPython $VERSION, manylinux x86-64 (glibc 2.28 or newer)"
"$PY" -m pip download --quiet --disable-pip-version-check --dest "$OUT.partial" --only-binary=:all: --no-deps \
  --python-version "$VERSION" --implementation cp "${platforms[@]}" -r scripts/gpu_requirements.txt
rm -rf "$OUT"
mv "$OUT.partial" "$OUT"
total=0
for wheel in "$OUT"/*.whl; do
  size=$(stat -c %s "$wheel")
  total=$((total + size))
  awk -v b="$size" -v n="$(basename "$wheel")" 'BEGIN { printf "  %8.2f MiB  %s\n", b / 1048576, n }'
done
say "$(ls "$OUT"/*.whl | wc -l) wheels, $(awk -v b="$total" 'BEGIN { printf "%.1f", b / 1048576 }') MiB in $OUT"
if (( total > BUDGET_MIB * 1048576 )); then
  say "FAIL: over the ${BUDGET_MIB} MiB budget (a GPU machine takes at most 64 MiB from the checkout)"
  exit 1
fi
