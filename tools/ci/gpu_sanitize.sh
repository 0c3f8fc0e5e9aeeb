#!/usr/bin/env bash
# tests/gpu under compute-sanitizer memcheck, with supermem in passthrough mode (one cudaMalloc per
# block, freed at once: memcheck then sees every out-of-bounds access and use after free that the cache
# would hide). Child processes are followed (--target-processes all) and swapped children get
# passthrough:true too (SUPERMEM_TEST_EXTRA_CONF, see tests/gpu/gpu_harness.py). Bounded by BUDGET_S.
#
#   tools/ci/gpu_sanitize.sh [pytest args]      (default: all of tests/gpu)
#   BUDGET_S=360 PYTHON=python3 tools/ci/gpu_sanitize.sh -k stats
# Exit status: pytest's (a memcheck error makes the process exit 99, which fails its test), or 124 when
# the budget ran out. Memcheck's reports: $OUT/memcheck.<pid>.log (else a temp dir).
set -uo pipefail
cd "$(dirname "$0")/../.."
py=${PYTHON:-python3}
budget_s=${BUDGET_S:-360}
logs=${OUT:-$(mktemp -d /tmp/gpu_sanitize.XXXXXX)}
mkdir -p "$logs"
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer 2>/dev/null | head -n 1)
if [[ -z $sanitizer ]]; then
  echo "gpu_sanitize: compute-sanitizer not found (it ships with the CUDA toolkit)" >&2
  exit 2
fi
export SUPERMEM_CONF=passthrough:true            # this process (tests that run in pytest itself)
export SUPERMEM_TEST_EXTRA_CONF=passthrough:true # and every swapped child
args=("$@")
((${#args[@]})) || args=(tests/gpu)
echo "gpu_sanitize: $sanitizer --tool memcheck over ${args[*]} (budget ${budget_s}s; logs in $logs)"
t0=$SECONDS
timeout --kill-after=15 "$budget_s" "$sanitizer" --tool memcheck --target-processes all --error-exitcode 99 \
  --print-limit 50 --log-file "$logs/memcheck.%p.log" \
  "$py" -m pytest -q -rfE -p no:cacheprovider "${args[@]}"
rc=$?
echo "gpu_sanitize: rc=$rc after $((SECONDS - t0)) s"
pattern='^========= (Invalid|Program hit|Malloc/Free error|Leaked)'
errors=$(cat "$logs"/memcheck.*.log 2>/dev/null | grep -cE "$pattern")
echo "gpu_sanitize: memcheck error reports: ${errors:-0} (in $logs/memcheck.<pid>.log)"
cat "$logs"/memcheck.*.log 2>/dev/null | grep -m 20 -A6 -E "$pattern"
exit "$rc"
