#!/usr/bin/env bash
# One device call on nvidia-h200-x4 (issue 37's GPU-only gap), through tools/ci/gpu_groups.sh: four
# groups, one GPU each: tools/diag/diag_light.py on Llama, T5 and Mistral (planned, with and without
# light-call graphs, one treatment at a time), the hf-llama bench sweep, and the exit loop. Logs to $OUT.
cd "$(dirname "$0")/../.."
T=${T:-420} TAIL=5000 exec bash tools/ci/gpu_groups.sh \
  "diag0=0=python3 tools/diag/diag_light.py llama 0.9 default nographs t:offload t:recompute" \
  "diag1=1=python3 tools/diag/diag_light.py t5 0.6 default nographs t:recompute; python3 tools/diag/diag_light.py mistral 0.9 default nographs" \
  "bench=2=python3 -m supermem bench train --sweep --model hf-llama --repeats 1 --timeout 120 --json \$OUT/hf_llama.json" \
  "exit=3=python3 tools/ci/exit_loop.py --mode gpu -n 200 --jobs 4"
