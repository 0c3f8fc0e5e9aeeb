#!/usr/bin/env bash
# Builds several commits side by side and runs one command against each, in one GPU call, so their
# timings share a card: the way to find which commit moved a number.
#
#   tools/diag/ab_commits.sh "python3 $PWD/tools/pool_step.py gpt 0.75" e691e00 b8a6b4a HEAD
#   AB_ROUNDS=3 STEPS=12 tools/diag/ab_commits.sh ...   # interleaved repeats, more timed steps each
#
# Each commit is exported (git archive) to $AB_DIR/<commit> and built in place with build_ext (no
# pip install, so the builds run in parallel and nothing installed is touched); the command runs in
# that tree with PYTHONPATH set to it (so name the script by an absolute path: an old tree may lack
# it). PYTHON picks the interpreter that builds. The device machine has no .git: export the trees
# here first (AB_EXPORT_ONLY=1, AB_DIR=.stage/ab), carry .stage, and run there with the same AB_DIR.
set -uo pipefail
cmd=$1
shift
AB_DIR=${AB_DIR:-$(mktemp -d /tmp/ab.XXXXXX)}
PY=${PYTHON:-python3}
export TORCH_DEVICE_BACKEND_AUTOLOAD=0  # an installed supermem's torch backend must not load into a build
for c in "$@"; do
  if [[ ! -d $AB_DIR/$c ]]; then
    mkdir -p "$AB_DIR/$c" && git archive "$c" | tar -x -C "$AB_DIR/$c" || exit 1
  fi
done
[[ ${AB_EXPORT_ONLY:-0} == 1 ]] && exit 0
for c in "$@"; do
  (cd "$AB_DIR/$c" && "$PY" setup.py -q build_ext --inplace > build.log 2>&1 || tail -5 build.log) &
done
wait
# AB_ROUNDS=N runs the commits N times over, interleaved (A B A B ...): a host-bound step drifts by
# 20-30% over minutes, so one run each compares the drift as much as the commits.
for round in $(seq "${AB_ROUNDS:-1}"); do
  for c in "$@"; do
    echo "== $c (round $round)"
    (cd "$AB_DIR/$c" && PYTHONPATH=$PWD timeout "${AB_TIMEOUT:-120}" bash -c "$cmd" 2>&1 | tail -n "${AB_TAIL:-4}")
  done
done
