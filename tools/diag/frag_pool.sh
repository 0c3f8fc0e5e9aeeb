#!/usr/bin/env bash
# `supermem bench frag` under a pool for every backward, supermem's rows only (with and without
# expandable segments), one process a row: "WORKLOAD BUDGET STEPS [LOSS]", e.g.
#   bash tools/diag/frag_pool.sh "gpt 10GiB 20" "llama-varlen 7GiB 40" "resnet 8GiB 20"
# POLICY (default cost_aware) picks the pool's policy; REPEATS (default 1) the processes a row.
set -u
for w in "$@"; do
  set -- $w
  python -m supermem bench frag --pattern "$1" --allocator supermem --no-limits --repeats "${REPEATS:-1}" \
    --steps "$3" --conf "pool:${POLICY:-cost_aware},budget:$2" --loss "${4:-plain}" --json "${OUT:-.}/frag_$1${4:-}.json"
done
