#!/usr/bin/env bash
# Issue 4's ">= 3x transformers' assisted generation (0.5B -> 1.5B, fp32)" target on the 20 HumanEval
# prompts of run.sh (whose report has verispec's int4 methods on the same prompts and settings):
# transformers' assisted generation on the fp32 pair, beside verispec's fp32 plain decoding.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
.venv/bin/verispec bench --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --threads 2 \
    --dataset humaneval --limit 20 --max-new-tokens 128 --warmup 1 -k 5 --quantization none --methods none \
    --baselines hf-assisted --out ${OUT:-results/int4-zen5-s15}/hf_fp32
