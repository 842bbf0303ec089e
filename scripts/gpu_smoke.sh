#!/usr/bin/env bash
# One-command GPU smoke test: SGLang (the pinned 0.5.23) serves a tiny random Qwen2.5-VL on one GPU, and our learner
# runs 3 steps against it with learner.weight_sync = "distributed" (NCCL) and verify_weights_every = 1: sample with
# /generate, compare sampler and trainer log-probs, train, publish over SGLang's weight group, check the server's
# /weights_checker checksums and weight_version. Prints the per-step figures and PASS or FAIL (exit 0 or 1).
#
#   .venv/bin/pip install -e '.[gpu]'  # sglang==0.5.23 and its CUDA dependencies (about 11 GB), into bootstrap's .venv
#   bash scripts/gpu_smoke.sh          # needs one CUDA GPU
#   bash scripts/gpu_smoke.sh --dry-run   # no GPU: arpo-serve in SGLang's place, learner on the CPU, gloo (CI runs this)
#
# Environment: PORT (default 30000), WORK (default a temporary folder; the model, the server log), PYTHON (default
# .venv/bin/python, the environment scripts/bootstrap.sh makes, when it exists; else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z ${PYTHON:-} && -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=${PYTHON:-python3}; fi
PORT=${PORT:-30000}
WORK=${WORK:-$(mktemp -d /tmp/arpo-gpu-smoke.XXXXXX)}
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
say() { printf '[gpu-smoke] %s\n' "$*"; }

MODEL="$WORK/tiny-model"
[[ -f "$MODEL/config.json" ]] || "$PY" -m arpo_async.model.init_model --out "$MODEL" >/dev/null
LOG="$WORK/server.log"
if [[ $DRY == 1 ]]; then
  say "dry run: arpo-serve in SGLang's place, learner on the CPU (gloo)"
  "$PY" -m arpo_serve.main --model "$MODEL" --host 127.0.0.1 --port "$PORT" >"$LOG" 2>&1 &
  DEVICE=cpu
else
  "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
    || { say "FAIL: no CUDA device (use --dry-run on a machine without a GPU)"; exit 1; }
  "$PY" -c 'import sglang' 2>/dev/null \
    || { say "FAIL: sglang is not installed ($PY -m pip install -e '.[gpu]')"; exit 1; }
  say "starting sglang.launch_server on the tiny model (log: $LOG)"
  # min/max pixels come from the model folder's preprocessor_config.json, which the learner reads too
  "$PY" -m sglang.launch_server --model-path "$MODEL" --host 127.0.0.1 --port "$PORT" --dtype bfloat16 \
    --mem-fraction-static 0.3 >"$LOG" 2>&1 &
  DEVICE=cuda
fi
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  kill -0 "$SERVER" 2>/dev/null || { say "FAIL: the server exited; last lines of $LOG:"; tail -20 "$LOG"; exit 1; }
  sleep 0.5
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { say "FAIL: the server did not answer /health in 300 s"; exit 1; }
"$PY" -m tests.gpu_smoke --url "http://127.0.0.1:$PORT" --model "$MODEL" --device "$DEVICE" --steps 3
