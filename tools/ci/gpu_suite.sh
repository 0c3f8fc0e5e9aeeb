#!/usr/bin/env bash
# tests/gpu in one device call (the corpus aside: tools/ci/gpu_corpus.sh): its files dealt round robin
# into PER groups a GPU (default 3; an H200's memory holds them), every GPU the machine has, then each
# test that failed run once more alone (tools/ci/gpu_groups.sh RERUN=1: tests that read the driver's
# device-wide counters fail while others share the card). T bounds a group (default 420 s).
#   bash tools/ci/gpu_suite.sh [FILE...]          (default: every tests/gpu/test_*.py but the corpus)
set -u
cd "$(dirname "$0")/../.."
gpus=$(nvidia-smi -L | wc -l)
files=("$@")
if [ ${#files[@]} -eq 0 ]; then
  mapfile -t files < <(ls tests/gpu/test_*.py | grep -v test_corpus_gpu)
fi
n=$((gpus * ${PER:-3}))
declare -a lists
for i in "${!files[@]}"; do lists[$((i % n))]+=" ${files[$i]}"; done
groups=()
for g in "${!lists[@]}"; do
  groups+=("g$g=$((g % gpus))=python -m pytest -q -rfEs -p no:cacheprovider${lists[$g]}")
done
RERUN=1 T=${T:-420} RERUN_T=${RERUN_T:-120} bash tools/ci/gpu_groups.sh "${groups[@]}"
