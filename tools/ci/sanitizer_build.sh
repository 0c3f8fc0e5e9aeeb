# Sourced by tools/ci/sanitize.sh and tools/ci/tsan.sh: builds supermem._C with -fsanitize=SANITIZERS in a
# scratch copy of the tracked tree (removed on exit), cds there and points PYTHONPATH at it.
#   source "$(dirname "$0")/sanitizer_build.sh" SANITIZERS [VAR=value ...]   (VAR=value: build environment)
# Sets root, py and work. Once the runtime is preloaded, check_sanitized_build makes sure the tests import
# this build, not the project's own.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git -C "$root" ls-files -z | (cd "$root" && xargs -0 cp --parents -t "$work")
cd "$work"
env "${@:2}" SUPERMEM_SANITIZE="$1" "$py" setup.py -q build_ext --inplace >build.log 2>&1 ||
  { tail -30 build.log; exit 1; }
export PYTHONPATH="$work"

check_sanitized_build() {
  "$py" -c "import supermem._C as c; assert c.__file__.startswith('$work'), c.__file__"
}
