#!/usr/bin/env bash
# The allocator core under AddressSanitizer + UndefinedBehaviorSanitizer: builds supermem._C with
# -fsanitize=address,undefined in a scratch copy of the tree and runs the allocator suites there.
#   tools/ci/sanitize.sh [pytest args]        (default: the conformance, fuzz, thread, OOM and input tests)
# Needs the project's .venv (make build). Leak checking is off: Python itself "leaks" at exit.
set -euo pipefail
source "$(dirname "$0")/sanitizer_build.sh" address,undefined
asan=$(gcc -print-file-name=libasan.so)
ubsan=$(gcc -print-file-name=libubsan.so)
export LD_PRELOAD="$asan:$ubsan"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
check_sanitized_build
tests=(tests/cpu/alloc/test_conformance.py tests/cpu/alloc/test_fuzz.py tests/cpu/pool/test_threads.py
       tests/cpu/alloc/test_oom.py tests/cpu/alloc/test_alloc_record_stream.py tests/cpu/alloc/test_alloc_private_pools.py
       tests/cpu/pool/test_pool.py tests/cpu/alloc/test_core_inputs.py tests/cpu/package/test_torch_compat.py
       tests/cpu/alloc/test_fork.py)
(($#)) && tests=("$@")
# ASan's quarantine holds freed memory by design, so the pool's RSS-growth check does not apply here.
"$py" -m pytest -q -p no:cacheprovider "${tests[@]}" -k "not host_memory_growth"
