#!/usr/bin/env bash
# One device call, several GPUs: an editable build, then one group of commands per GPU, in parallel.
#   bash tools/ci/gpu_groups.sh "NAME=GPU=COMMAND" ...     e.g. "tests=1=python -m pytest -q tests/gpu/test_pool_gpu.py"
# Each group's output goes to $OUT/NAME.log; its last lines print at the end. T (default 480) bounds a group.
# Groups may share a GPU (its memory is large; tests that read the driver's device-wide counters then see
# the others'): RERUN=1 runs every test that failed (but the corpus') once more, alone, at the end;
# BUILT=1 skips the build (the caller's).
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-$(mktemp -d)}  # (the groups may write there too)
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
t0=$SECONDS
if [ "${BUILT:-0}" != 1 ]; then  # BUILT=1: the caller built it already
  python -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 ||
    { tail -20 "$OUT/build.log"; exit 1; }
fi
echo "built in $((SECONDS - t0)) s on $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)"
T=${T:-480}
names=()
for g in "$@"; do
  name=${g%%=*} rest=${g#*=}; dev=${rest%%=*} cmd=${rest#*=}
  names+=("$name")
  (CUDA_VISIBLE_DEVICES=$dev timeout -k 10 "$T" bash -c "$cmd" >"$OUT/$name.log" 2>&1; echo "$name rc=$? ($((SECONDS - t0)) s)") &
done
wait
for n in "${names[@]}"; do
  echo "##### $n"
  grep -E '^(FAILED|ERROR) ' "$OUT/$n.log" | cut -c1-220 | head -20
  tail -c "${TAIL:-3000}" "$OUT/$n.log"
done
if [ "${RERUN:-0}" = 1 ]; then
  failed=$(grep -hoE '^(FAILED|ERROR) tests/[^ ]+' "$OUT"/*.log | cut -d' ' -f2 | grep -v test_corpus_gpu | sort -u)
  if [ -n "$failed" ]; then
    echo "##### rerun alone: $(echo "$failed" | wc -l) tests"
    # shellcheck disable=SC2086
    timeout -k 10 "${RERUN_T:-120}" python -m pytest -q -rfE -p no:cacheprovider $failed 2>&1 | tee "$OUT/rerun.log" | tail -25
  fi
fi
