#!/usr/bin/env bash
# The pool's compiled GPT-24 row (chunked loss, planned, BUDGET_BYTES: default 5.29 GiB, the eager
# checkpoint's peak) beside native eager and compile checkpoint, ROUNDS times interleaved, one worker
# process each, in one call; prints each row's step times (and the host's), peak allocated, the timed
# steps' reserved, pool stats and eager plan (or the row's error). NO_INSTALL=1: the package is
# installed already; NATIVE=0: no native row. Run on the GPU machine from the repository root
# (docs/measurements.md, "Blocks checkpointed inside the graph").
set -uo pipefail
export OUT=${OUT:-$(mktemp -d)}
BUDGET_BYTES=${BUDGET_BYTES:-5680000000}
[[ -n ${NO_INSTALL:-} ]] || python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || { tail -5 $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/card.txt
W() {  # W LABEL SPEC: one worker process; its row under LABEL, or a line that says it gave none
  local row
  row=$(timeout 400 python3 -m supermem.bench.worker "$2" 2>>$OUT/worker_err.log | grep '^@@ROW' | tail -1)
  if [[ -n $row ]]; then printf '%s\t%s\n' "$1" "${row#@@ROW }" >> $OUT/rows.tsv; else echo "$1: no row"; fi
}
[[ ${NATIVE:-1} == 0 ]] || W "native eager" '{"bench":"train","preset":"gpt","device":"cuda","steps":10,"warmup":10,"saved_peak":true,"allocator":"native","conf":null,"saver":"none"}'
B='"bench":"train","preset":"gpt","device":"cuda","steps":10,"saved_peak":true,"loss":"chunked","compile":true,"memory_budget":1.0'
CKPT="{$B,\"warmup\":10,\"allocator\":\"native\",\"conf\":null,\"saver\":\"checkpoint\",\"checkpoint_saves\":null}"
POOL="{$B,\"warmup\":20,\"allocator\":\"supermem\",\"conf\":null,\"saver\":\"pool\",\"policy\":\"planned\",\"budget_bytes\":$BUDGET_BYTES}"
for i in $(seq ${ROUNDS:-2}); do  # interleaved: the pool's row moved 0.99-1.2x of the baseline's between processes
  W "compile checkpoint, native" "$CKPT"
  W "the pool" "$POOL"
done
W "compile checkpoint, native" "$CKPT"  # each pool row between two of the baseline's
python3 - <<'PY'
import json, os
for line in open(os.environ["OUT"] + "/rows.tsv"):
    label, row = line.rstrip("\n").split("\t", 1)
    r = json.loads(row)
    p = r.get("pool") or {}
    print(label, r.get("step_ms"), "host", r.get("host_ms"), r.get("step_ms_all"), round(r.get("peak_alloc_bytes", 0) / 2**30, 3),
          "reserved", round(r.get("peak_reserved_bytes", 0) / 2**30, 3), r.get("error"),
          {k: p.get(k) for k in ("compile_share", "compile_recompiles", "compiled_kept_bytes", "offloads", "dropped", "sync_restores", "packed", "plans", "steps", "light_calls", "replays")},
          {k: v for k, v in p.get("plan", {}).items() if k in ("offload", "recompute", "keep", "feasible", "predicted_peak_bytes", "predicted_step_s", "measured_step_s")} if p.get("plan") else None)
PY
tail -3 $OUT/worker_err.log
