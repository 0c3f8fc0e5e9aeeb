#!/usr/bin/env bash
# The allocator core under ThreadSanitizer: builds supermem._C with -fsanitize=thread in a scratch copy of
# the tree and runs the threaded suites there (threads, fork, OOM and pressure handlers).
#   tools/ci/tsan.sh [pytest args]        (default: the thread, fork and OOM tests)
# Needs the project's .venv (make build). The TSan runtime is preloaded (Python itself is not built with
# it). tools/ci/tsan.supp silences races inside CPython and torch only: a report in supermem's code fails.
set -euo pipefail
source "$(dirname "$0")/sanitizer_build.sh" thread SUPERMEM_CUDA=0
export LD_PRELOAD=$(gcc -print-file-name=libtsan.so)
# exitcode=66: any report fails the run (also in a child process, which then exits 66).
export TSAN_OPTIONS="suppressions=$root/tools/ci/tsan.supp halt_on_error=1 exitcode=66 second_deadlock_stack=1 report_signal_unsafe=0"
export SUPERMEM_TSAN=1  # tests that loop on GIL hand-offs run fewer rounds (each costs ms under TSan)
check_sanitized_build
tests=(tests/cpu/pool/test_threads.py tests/cpu/alloc/test_fork.py tests/cpu/alloc/test_oom.py)
(($#)) && tests=("$@")
"$py" -m pytest -q -p no:cacheprovider "${tests[@]}"
