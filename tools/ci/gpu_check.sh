#!/usr/bin/env bash
# The GPU check in one call: build supermem, run tests/gpu, run the benchmarks, print a short summary.
#
#   tools/ci/gpu_check.sh                      # everything, about 9 minutes on an H100
#   STAGES=tests tools/ci/gpu_check.sh         # any of install,tests,alloc,train,savers,sweep,relu,soak,depth
#   BENCH=alloc tools/ci/gpu_check.sh          # benchmarks: alloc,train,savers (default) or none
#   PYTEST_ARGS="-k stats" TRAIN_ARGS="--model gpt" BUDGETS=1.0,0.75,0.6,0.5 tools/ci/gpu_check.sh
#
# Benchmarks: alloc (torch.empty+del, native vs supermem), train (GPT-24 and ResNet-152 steps, native
# vs supermem's allocator, 2 processes each), savers (checkpoint, save_on_cpu and supermem.pool at
# BUDGETS of native's peak; default 0.75,0.5 to fit the deadline).
# Logs, JSON rows and junit.xml go to $OUT (else a temp dir). Every stage has a time budget (seconds:
# T_INSTALL T_TESTS T_ALLOC T_TRAIN T_SAVERS) and the whole run a deadline (DEADLINE, default 540 s),
# so the summary prints before a 10-minute limit; a stage that would start with < 30 s left is skipped.
set -uo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-python3}
LOGS=${OUT:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
BENCH=${BENCH:-alloc,train,savers}
STAGES=${STAGES:-install,tests,$BENCH}
DEADLINE=${DEADLINE:-540}
mkdir -p "$LOGS"
declare -a SUMMARY=()

wanted() { [[ ",$STAGES," == *",$1,"* ]]; }

# stage NAME BUDGET_S COMMAND...: runs COMMAND under `timeout`, tees its output to $LOGS/NAME.log
stage() {
  local name=$1 budget=$2
  shift 2
  local left=$((DEADLINE - SECONDS - 15))
  if ((left < 30)); then
    SUMMARY+=("$(printf '%-8s %-10s' "$name" "skipped") (no time left before the ${DEADLINE}s deadline)")
    return 1
  fi
  ((budget > left)) && budget=$left
  echo
  echo "=== $name (budget ${budget}s): $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$budget" "$@" 2>&1 | tee "$LOGS/$name.log"
  local rc=${PIPESTATUS[0]} status=ok
  ((rc == 124 || rc == 137)) && status="TIMEOUT"
  ((rc != 0 && rc != 124 && rc != 137)) && status="rc=$rc"
  SUMMARY+=("$(printf '%-8s %-10s %4ds' "$name" "$status" $((SECONDS - t0)))")
  return "$rc"
}

if wanted install; then
  stage install "${T_INSTALL:-240}" "$PY" -m pip install -q --no-build-isolation --no-deps -e . || {
    echo "install failed: stopping (see $LOGS/install.log)"
    STAGES=none
  }
fi

"$PY" - <<'EOF' 2>&1 | tee "$LOGS/env.log"
import subprocess, sys, torch
try:
    import supermem
    from supermem import _C
    version = f"supermem {supermem.__version__} (cuda build: {_C.has_cuda})"
except Exception as e:  # noqa: BLE001
    version = f"supermem import failed: {e}"
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
print(f"gpu: {gpu} x{torch.cuda.device_count()}; torch {torch.__version__} (cuda {torch.version.cuda}); "
      f"python {sys.version.split()[0]}; {version}")
EOF

if wanted tests; then
  # shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
  stage tests "${T_TESTS:-270}" "$PY" -m pytest -v -rfEs --durations=12 --junitxml="$LOGS/junit.xml" \
    tests/gpu ${PYTEST_ARGS:-}
  counts=$(grep -E '[0-9]+ (passed|failed|skipped|error)' "$LOGS/tests.log" 2>/dev/null | tail -n 1)
  SUMMARY+=("         ${counts:-(no pytest summary: killed by its time budget?)}")
  # pytest's own list of failures; if it was killed before printing one, the verbose per-test lines
  failed=$(grep -E '^(FAILED|ERROR) ' "$LOGS/tests.log" 2>/dev/null ||
    grep -E '::.* (FAILED|ERROR)' "$LOGS/tests.log" 2>/dev/null)
  while IFS= read -r line; do [[ -n $line ]] && SUMMARY+=("         $line"); done < <(
    printf '%s\n' "$failed" | cut -c1-160 | head -n 40
  )
fi

if wanted alloc; then
  stage alloc "${T_ALLOC:-60}" "$PY" -m supermem bench alloc --timeout 60 --json "$LOGS/bench_alloc.json" \
    ${ALLOC_ARGS:-}
  while IFS= read -r line; do SUMMARY+=("         $line"); done < <(grep -E '^target ' "$LOGS/alloc.log" 2>/dev/null)
fi

if wanted train; then
  stage train "${T_TRAIN:-150}" "$PY" -m supermem bench train --model all --modes supermem --timeout 120 \
    --json "$LOGS/bench_train.json" ${TRAIN_ARGS:-}
  while IFS= read -r line; do SUMMARY+=("         $line"); done < <(grep -E '^target ' "$LOGS/train.log" 2>/dev/null)
fi

if wanted savers; then
  stage savers "${T_SAVERS:-240}" "$PY" -m supermem bench train --model all --repeats 1 --timeout 120 \
    --modes checkpoint,save_on_cpu,pool --budgets "${BUDGETS:-0.75,0.5}" \
    --json "$LOGS/bench_savers.json" ${TRAIN_ARGS:-}
  while IFS= read -r line; do SUMMARY+=("         $line"); done < <(grep -E '^savers ' "$LOGS/savers.log" 2>/dev/null)
fi

if wanted sweep; then
  # the planner's rows beside their baselines (bench train --sweep); by default issue 11's: ResNet-152
  # at checkpoint's peak, planned with and without full-room ReLU compression
  # shellcheck disable=SC2086  # SWEEP_ARGS is a list of words
  stage sweep "${T_SWEEP:-240}" "$PY" -m supermem bench train --sweep --model "${SWEEP_MODEL:-resnet}" \
    --repeats 1 --modes "${SWEEP_MODES:-checkpoint,checkpoint reentrant,planned ckpt peak,planned+compress ckpt peak}" \
    --json "$LOGS/bench_sweep.json" ${SWEEP_ARGS:-}
  while IFS= read -r line; do SUMMARY+=("         $line"); done < <(grep -E '^pareto ' "$LOGS/sweep.log" 2>/dev/null)
fi

if wanted relu; then
  stage relu "${T_RELU:-90}" "$PY" -m supermem bench relu --json "$LOGS/bench_relu.json"
  while IFS= read -r line; do SUMMARY+=("         $line"); done < <(grep -E '^target ' "$LOGS/relu.log" 2>/dev/null)
fi

if wanted soak; then
  stage soak "${T_SOAK:-120}" "$PY" tools/ci/soak.py
  while IFS= read -r line; do SUMMARY+=("         $line"); done < <(grep -E '^soak: ' "$LOGS/soak.log" 2>/dev/null)
fi

if wanted depth; then
  stage depth "${T_DEPTH:-480}" "$PY" -m supermem bench depth --json "$LOGS/bench_depth.json"
  while IFS= read -r line; do SUMMARY+=("         $line"); done < <(grep -E '^target ' "$LOGS/depth.log" 2>/dev/null)
fi

echo
echo "=== summary ($((SECONDS / 60))m$((SECONDS % 60))s; logs in $LOGS)"
cat "$LOGS/env.log"
printf '%s\n' "${SUMMARY[@]}"
