#!/usr/bin/env bash
# transformers' assisted generation on the float32 0.5B -> 1.5B pair, beside verispec's float32 plain
# decoding, on the 20 HumanEval prompts of run.sh (whose report has verispec's int4 methods on the
# same prompts and settings).
set -euo pipefail
cd "$(dirname "$0")/../../../.."
.venv/bin/verispec bench --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --threads 2 \
    --dataset humaneval --limit 20 --max-new-tokens 128 --warmup 1 -k 5 --quantization none --methods none \
    --baselines hf-assisted --out ${OUT:-results/int4-zen5}/hf_fp32
