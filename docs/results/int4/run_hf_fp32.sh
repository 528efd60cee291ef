#!/usr/bin/env bash
# Issue 4's "3x transformers' assisted generation (fp32 pair)" target on 5 HumanEval prompts:
# verispec's fastest method on its fast path, then transformers' assisted generation on the fp32 pair.
set -euo pipefail
cd "$(dirname "$0")/../../.."
V=.venv/bin/verispec
C=(--target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --threads 2 --dataset humaneval --limit 5 --max-new-tokens 128 --warmup 1 -k 5)
$V bench "${C[@]}" --quantization int4 --methods none,ngram --depth-policy adaptive --out results/hf_fp32/verispec_int4
$V bench "${C[@]}" --quantization none --methods none --baselines hf-assisted --out results/hf_fp32/fp32
mkdir -p docs/results/int4/hf_fp32
cp results/hf_fp32/verispec_int4/report.md docs/results/int4/hf_fp32/verispec_int4.md
cp results/hf_fp32/fp32/report.md docs/results/int4/hf_fp32/fp32.md
