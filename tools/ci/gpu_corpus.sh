#!/usr/bin/env bash
# The third-party corpus (tests/gpu/test_corpus_gpu.py) and the pool's GPU suites in one device call on
# the 4-GPU kind: an editable build, then four groups in parallel, one GPU each. Logs go to $OUT; the
# CORPUS rows of every group are printed at the end (the closing table).
set -u
OUT=${OUT:-$(mktemp -d)}
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
T=${T:-540}
python -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
run() { local name=$1 dev=$2 models=$3; shift 3
  CUDA_VISIBLE_DEVICES=$dev SUPERMEM_CORPUS=$models timeout -k 10 "$T" python -m pytest -q -s -rfEs -p no:cacheprovider "$@" >"$OUT/$name.log" 2>&1
  echo "$name rc=$?"; }
run A 0 gpt2,gpt2-eager,llama tests/gpu/test_corpus_gpu.py &
run B 1 mistral,qwen2,bert,t5 tests/gpu/test_corpus_gpu.py &
run C 2 bart,vit,convnext,efficientnet,mobilenet-v2 tests/gpu/test_corpus_gpu.py &
run D 3 timm-mobilenetv3,timm-convnext,timm-efficientnet,timm-resnet50,tv-resnet50,tv-mobilenet-v3 tests/gpu/test_corpus_gpu.py ${EXTRA:-} &
wait
for n in A B C D; do echo "== $n: $(grep -E '[0-9]+ (passed|failed|error)' "$OUT/$n.log" | tail -1)"
  grep -E '^(FAILED|ERROR) ' "$OUT/$n.log" | cut -c1-300 | head -12; done
grep -h '^CORPUS' "$OUT"/[ABCD].log | sort
