#!/usr/bin/env bash
# verispec's int4 path against transformers' assisted generation on the float32 0.5B -> 1.5B pair,
# 5 HumanEval prompts: verispec's prompt lookup on int4, then transformers with the 0.5B as its
# assistant model beside verispec's float32 plain decoding.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
V=.venv/bin/verispec
C=(--target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --threads 2 --dataset humaneval --limit 5 --max-new-tokens 128 --warmup 1 -k 5)
$V bench "${C[@]}" --quantization int4 --methods none,ngram --depth-policy adaptive --out results/hf_fp32/verispec_int4
$V bench "${C[@]}" --quantization none --methods none --baselines hf-assisted --out results/hf_fp32/fp32
mkdir -p docs/results/qwen2.5-coder-1.5b-int4-vs-llamacpp/zen4-fp32-assisted
cp results/hf_fp32/verispec_int4/report.md docs/results/qwen2.5-coder-1.5b-int4-vs-llamacpp/zen4-fp32-assisted/verispec_int4.md
cp results/hf_fp32/fp32/report.md docs/results/qwen2.5-coder-1.5b-int4-vs-llamacpp/zen4-fp32-assisted/fp32.md
