#!/usr/bin/env bash
# The third-party corpus (tests/gpu/test_corpus_gpu.py) in one device call, as a user runs it: supermem's
# allocator on (SUPERMEM=1; ALLOC=0 runs it on PyTorch's), the models split over the GPUs there (1, 2 or
# 4), one pytest per GPU through tools/ci/gpu_groups.sh. Logs go to $OUT; the CORPUS rows of every group
# print at the end (the closing table).
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-$(mktemp -d)} SUPERMEM=${ALLOC:-1}
case $(nvidia-smi -L | wc -l) in
  1) G=("${MODELS:-gpt2,llama,mistral,t5,vit,timm-efficientnet}") ;;
  2) G=("gpt2,gpt2-eager,llama,mistral,qwen2,bert,t5" "bart,vit,convnext,efficientnet,mobilenet-v2,timm-mobilenetv3,timm-convnext,timm-efficientnet,timm-resnet50,tv-resnet50,tv-mobilenet-v3") ;;
  *) G=("gpt2,gpt2-eager,llama" "mistral,qwen2,bert,t5" "bart,vit,convnext,efficientnet,mobilenet-v2"
        "timm-mobilenetv3,timm-convnext,timm-efficientnet,timm-resnet50,tv-resnet50,tv-mobilenet-v3") ;;
esac
groups=()
for i in "${!G[@]}"; do
  groups+=("$i=$i=SUPERMEM_CORPUS=${G[$i]} python -m pytest -q -s -rfEs -p no:cacheprovider tests/gpu/test_corpus_gpu.py")
done
T=${T:-540} TAIL=600 bash tools/ci/gpu_groups.sh "${groups[@]}"
grep -h '^CORPUS' "$OUT"/[0-9].log | sort
