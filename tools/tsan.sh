#!/usr/bin/env bash
# The allocator core under ThreadSanitizer: builds supermem._C with -fsanitize=thread in a scratch copy of
# the tree and runs the threaded suites there (threads, fork, OOM and pressure handlers).
#   tools/tsan.sh [pytest args]        (default: the thread, fork and OOM tests)
# Needs the project's .venv (make build). The TSan runtime is preloaded (Python itself is not built with
# it). tools/tsan.supp silences races inside CPython and torch only: a report in supermem's code fails.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git -C "$root" ls-files -z | (cd "$root" && xargs -0 cp --parents -t "$work")
cd "$work"
SUPERMEM_CUDA=0 SUPERMEM_SANITIZE=thread "$py" setup.py -q build_ext --inplace >build.log 2>&1 ||
  { tail -30 build.log; exit 1; }
export LD_PRELOAD=$(gcc -print-file-name=libtsan.so)
# exitcode=66: any report fails the run (also in a child process, which then exits 66).
export TSAN_OPTIONS="suppressions=$root/tools/tsan.supp halt_on_error=1 exitcode=66 second_deadlock_stack=1 report_signal_unsafe=0"
export PYTHONPATH="$work"
export SUPERMEM_TSAN=1  # tests that loop on GIL hand-offs run fewer rounds (each costs ms under TSan)
"$py" -c "import supermem._C as c; assert c.__file__.startswith('$work'), c.__file__"  # the TSan build
tests=(tests/cpu/test_threads.py tests/cpu/test_fork.py tests/cpu/test_oom.py)
(($#)) && tests=("$@")
"$py" -m pytest -q -p no:cacheprovider "${tests[@]}"
