#!/usr/bin/env bash
# The third-party corpus (tests/gpu/test_corpus_gpu.py) in one device call, as a user runs it: supermem's
# allocator on (SUPERMEM=1; ALLOC=0 runs it on PyTorch's), an editable build, then the models split over
# the GPUs there (1, 2 or 4), one pytest per GPU. Logs go to $OUT; the CORPUS rows of every group print
# at the end (the closing table).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$(mktemp -d)}
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 SUPERMEM=${ALLOC:-1}
T=${T:-540}
python -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
n=$(nvidia-smi -L | wc -l)
case $n in
  1) G=("${MODELS:-gpt2,llama,mistral,t5,vit,timm-efficientnet}") ;;
  2) G=("gpt2,gpt2-eager,llama,mistral,qwen2,bert,t5" "bart,vit,convnext,efficientnet,mobilenet-v2,timm-mobilenetv3,timm-convnext,timm-efficientnet,timm-resnet50,tv-resnet50,tv-mobilenet-v3") ;;
  *) G=("gpt2,gpt2-eager,llama" "mistral,qwen2,bert,t5" "bart,vit,convnext,efficientnet,mobilenet-v2"
        "timm-mobilenetv3,timm-convnext,timm-efficientnet,timm-resnet50,tv-resnet50,tv-mobilenet-v3") ;;
esac
for i in "${!G[@]}"; do
  (CUDA_VISIBLE_DEVICES=$i SUPERMEM_CORPUS=${G[$i]} timeout -k 10 "$T" python -m pytest -q -s -rfEs \
    -p no:cacheprovider tests/gpu/test_corpus_gpu.py >"$OUT/$i.log" 2>&1; echo "group $i rc=$?") &
done
wait
for i in "${!G[@]}"; do echo "== ${G[$i]}: $(grep -E '[0-9]+ (passed|failed|error)' "$OUT/$i.log" | tail -1)"
  grep -E '^(FAILED|ERROR) ' "$OUT/$i.log" | cut -c1-300 | head -12; done
grep -h '^CORPUS' "$OUT"/[0-9].log | sort
