#!/usr/bin/env bash
# One-shot GPU check (issue 20): SmolLM2-135M-Instruct, the default job's prompt and chat template, XSum articles
# 200-263, 64 new tokens, greedy; bfloat16 and float32; 1 to 64 rows in flight; plain against every method
# (draft_model, prompt_lookup, suffix, eagle, and prompt lookup's and eagle's token trees of 4 candidates; wall clock on a GPU).
# Prints each table and whether every row is identical to plain or
# differs first at a measured near-tie; exits 1 if a row differs elsewhere. Budget: under 8 minutes on one
# H100/H200-class device (each batch size runs on max(16, 2B) of the 64 rows).
#
#   bash bench/gpu_check.sh                      # on the GPU (CUDA_VISIBLE_DEVICES picks it)
#   bash bench/gpu_check.sh --device cpu --quick # 2 rows, 400-character articles, 4 tokens on the CPU: what the test runs
#
# Tables land in out/gpu_check/<dtype>/report.md (and .json).
set -euo pipefail
cd "$(dirname "$0")/.."
device=cuda
quick=0
out=out/gpu_check
while [ $# -gt 0 ]; do
    case "$1" in
        --device) device=$2; shift 2 ;;
        --quick) quick=1; shift ;;
        --output) out=$2; shift 2 ;;
        *) echo "usage: bash bench/gpu_check.sh [--device cuda|cpu] [--quick] [--output DIR]" >&2; exit 2 ;;
    esac
done
PY=${PYTHON:-python}
[ -x .venv/bin/python ] && PY=.venv/bin/python
if [ "$device" = cuda ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: torch sees no CUDA device (torch $("$PY" -c 'import torch; print(torch.__version__)')); install a CUDA build of torch, or pass --device cpu" >&2
    exit 2
fi
if [ "$quick" = 1 ]; then
    args=(--rows 200:202 --new-tokens 4 --batch-sizes 1,2 --article-chars 400 --warm-up-prompt 24)
else
    args=(--rows 200:264 --new-tokens 64 --batch-sizes 1,2,4,8,16,32,64 --min-rows 16 --threads 4)
fi
methods=plain,draft_model,prompt_lookup,suffix,eagle,prompt_lookup@method.num_candidates=4,eagle@method.num_candidates=4
status=0
for dtype in bfloat16 float32; do
    echo "== SmolLM2-135M-Instruct, $dtype, $device"
    "$PY" bench/bench_real.py --device "$device" --dtype "$dtype" --methods "$methods" "${args[@]}" --output "$out/$dtype" || status=$?
done
exit $status
