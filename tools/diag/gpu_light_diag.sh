#!/usr/bin/env bash
# One device call on nvidia-h200-x4 (issue 37's GPU-only gap): build, then four groups, one GPU each:
# tools/diag/diag_light.py on Llama, T5 and Mistral (planned, with and without light-call graphs, one
# treatment at a time), the hf-llama bench sweep, and the exit loop. Logs to $OUT.
set -u
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
t0=$SECONDS
python -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
echo "built in $((SECONDS - t0)) s"; nvidia-smi --query-gpu=name --format=csv,noheader | head -1
T=${T:-420}
g() { local n=$1 d=$2; shift 2; CUDA_VISIBLE_DEVICES=$d timeout -k 5 $T bash -c "$*" >"$OUT/$n.log" 2>&1; echo "$n rc=$?"; }
g diag0 0 "python3 tools/diag/diag_light.py llama 0.9 default nographs t:offload t:recompute" &
g diag1 1 "python3 tools/diag/diag_light.py t5 0.6 default nographs t:recompute; python3 tools/diag/diag_light.py mistral 0.9 default nographs" &
g bench 2 "python3 -m supermem bench train --sweep --model hf-llama --repeats 1 --timeout 120 --json \$OUT/hf_llama.json" &
g exit 3 "python3 tools/ci/exit_loop.py --mode gpu -n 200 --jobs 4" &
wait
echo "=== $((SECONDS - t0)) s"
for n in diag0 diag1 bench exit; do echo "##### $n"; tail -c 5000 "$OUT/$n.log"; done
