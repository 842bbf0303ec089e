#!/usr/bin/env bash
# The whole GPU check in one command, for a short lease on one GPU with no internet: PyTorch with CUDA and
# transformers already installed, plus the wheels of scripts/gpu_wheels.sh carried in .gpu-wheels/.
#
#   1. the packages: the wheels are installed into a temporary prefix with pip (--no-index; any the machine has
#      already are skipped);
#   2. the CUDA path, 3 steps (tests/gpu_smoke.py): arpo-serve on CUDA holding a tiny random Qwen2.5-VL in bf16, in
#      SGLang's place; the learner's trainer on CUDA in bf16, sharded with FSDP2 on one rank; each step samples a
#      group, compares the server's and the trainer's log-probs, trains, publishes with learner.weight_sync =
#      "distributed" and verify_weights_every = 1; prints the log-prob difference (mean and max, nats), publish
#      seconds, whether the checksums agree and the server's weight_version;
#   3. real-size figures (bench/bench_real_size.py): Qwen2.5-VL at the 3B configuration, random weights, one bf16
#      training step on a UI-TARS-length sample (tokens/s, peak GPU memory), then its weights published over the
#      weight group and by disk (seconds, GB/s);
#   then one last line: PASS, or FAIL and which part failed (exit 0 or 1).
#
# The weight group runs over NCCL with the server on a second GPU when there is one, or on the same GPU when NCCL is
# 2.30 or newer (NCCL_MULTI_RANK_GPU_ENABLE=1); older NCCL refuses two ranks on one GPU, and the check then says so
# and uses gloo (arpo_async.weight_sync.weight_group_plan).
#
#   bash scripts/gpu_check.sh            # on the GPU machine: at most 8 minutes (parts cut off at 2.5 and 5)
#   bash scripts/gpu_check.sh --dry-run  # no GPU: the same steps on the CPU (tiny model everywhere, gloo); CI runs it
#
# Environment: WHEELS (default .gpu-wheels; skipped when absent and nothing is missing), PYTHON (default
# .venv/bin/python when it exists, else python3), WORK (default a temporary folder: the models, the logs, the
# installed packages), PORT (default 30000).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z ${PYTHON:-} && -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=${PYTHON:-python3}; fi
WHEELS=${WHEELS:-.gpu-wheels}
WORK=${WORK:-$(mktemp -d /tmp/arpo-gpu-check.XXXXXX)}
PORT=${PORT:-30000}
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
say() { printf '[gpu-check] %s\n' "$*"; }
fail() { echo "FAIL: $*"; exit 1; }

# 1. packages -------------------------------------------------------------------------------------------------------
if [[ -d $WHEELS ]]; then
  say "installing $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $WORK/deps (those missing here)"
  PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install --quiet --disable-pip-version-check \
    --no-index --find-links "$WHEELS" --prefix "$WORK/deps" -r scripts/gpu_requirements.txt \
    || fail "pip could not install scripts/gpu_requirements.txt from $WHEELS (run scripts/gpu_wheels.sh again)"
  # site-packages; dist-packages where a Debian or Ubuntu system Python lays --prefix out its own way
  for site in $(find "$WORK/deps" -type d \( -name site-packages -o -name dist-packages \) 2>/dev/null); do
    PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  done
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
missing=$("$PY" - <<'PYEOF'
import importlib.util
needed = ["torch", "transformers", "aiohttp", "zmq", "msgpack", "PIL", "xgrammar", "tenacity", "tomli_w", "pydantic"]
print(" ".join(m for m in needed if importlib.util.find_spec(m) is None))
PYEOF
)
[[ -z $missing ]] || fail "missing Python packages: $missing (bash scripts/gpu_wheels.sh where PyPI is reachable, \
then carry .gpu-wheels to this machine)"

# 2. the CUDA path --------------------------------------------------------------------------------------------------
if [[ $DRY == 1 ]]; then
  say "dry run: everything on the CPU, weight group over gloo"
  DEVICE=cpu BACKEND=gloo SERVE_GPU=0 QUICK=--quick
else
  "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
    || fail "no CUDA device (use --dry-run on a machine without a GPU)"
  DEVICE=cuda QUICK=
  read -r BACKEND SERVE_GPU < <("$PY" -m tests.gpu_smoke --plan) || true
  [[ -n ${BACKEND:-} ]] || fail "could not plan the weight group (python -m tests.gpu_smoke --plan failed)"
  if [[ $BACKEND == nccl && $SERVE_GPU == 0 ]]; then export NCCL_MULTI_RANK_GPU_ENABLE=1; fi
fi
"$PY" - <<'PYEOF'
import torch, transformers
line = f"torch {torch.__version__}, transformers {transformers.__version__}"
if torch.cuda.is_available():
    line += (f", CUDA {torch.version.cuda}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, "
             f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()[:3]))}")
print("[gpu-check]", line)
PYEOF
if [[ $DEVICE == cuda && $BACKEND == gloo ]]; then
  say "NCCL older than 2.30 refuses two ranks on one GPU: the weight group runs over gloo (host memory) instead"
fi

MODEL="$WORK/tiny-model"
[[ -f "$MODEL/config.json" ]] || "$PY" -m arpo_async.model.init_model --out "$MODEL" >/dev/null
LOG="$WORK/serve.log"
say "arpo-serve on $DEVICE$([[ $DEVICE == cuda ]] && echo " (GPU $SERVE_GPU)"), bf16 (log: $LOG)"
CUDA_VISIBLE_DEVICES=$([[ $DEVICE == cuda ]] && echo "$SERVE_GPU" || echo "${CUDA_VISIBLE_DEVICES:-}") \
  "$PY" -m arpo_serve.main --model "$MODEL" --host 127.0.0.1 --port "$PORT" --device "$DEVICE" --dtype bfloat16 \
  >"$LOG" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true' EXIT
for _ in $(seq 1 240); do
  "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null && break
  kill -0 "$SERVER" 2>/dev/null || { tail -20 "$LOG"; fail "arpo-serve exited (last lines of $LOG above)"; }
  sleep 0.5
done
say "CUDA path: 3 steps, trainer on $DEVICE with FSDP2 on one rank, weight group over $BACKEND"
SMOKE=0
timeout 150 "$PY" -m tests.gpu_smoke --url "http://127.0.0.1:$PORT" --model "$MODEL" --device "$DEVICE" --fsdp \
  --backend "$BACKEND" --steps 3 || SMOKE=$?
kill "$SERVER" 2>/dev/null || true
wait "$SERVER" 2>/dev/null || true

# 3. real-size figures ----------------------------------------------------------------------------------------------
say "real size: Qwen2.5-VL 3B configuration${QUICK:+ (dry run: the tiny model)}"
REAL=0
timeout 300 "$PY" -m bench.bench_real_size --device "$DEVICE" --fsdp --backend "$BACKEND" --repeats 1 \
  --work "$WORK/real-size" $QUICK || REAL=$?

if [[ $SMOKE != 0 ]]; then echo "FAIL: the CUDA path (exit $SMOKE; server log: $LOG)"; exit 1; fi
if [[ $REAL != 0 ]]; then echo "FAIL: the real-size figures (exit $REAL; server log: $WORK/real-size/serve.log)"; exit 1; fi
echo "PASS"
