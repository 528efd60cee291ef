#!/usr/bin/env bash
# The int4 path on a 2-core AVX2-only AMD EPYC Zen 3 with the lean decoder forward, the C++
# decode/verify attention and the 8-row AVX2 kernel: 20 HumanEval prompts and 3 per Spec-Bench
# category, llama.cpp in the same runs.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
V=.venv/bin/verispec
COMMON=(--target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --threads 2
        -k 5 --depth-policy adaptive --max-new-tokens 128 --warmup 1 --quantization int4)
$V bench "${COMMON[@]}" --dataset humaneval --limit 20 --methods none,ngram,eagle+ngram \
    --baselines llamacpp,llamacpp-pld --out ${OUT:-results/int4-zen3-lean-forward}/humaneval
$V bench "${COMMON[@]}" --dataset spec_bench --limit 3 --methods none,ngram,eagle+ngram \
    --baselines llamacpp --out ${OUT:-results/int4-zen3-lean-forward}/spec_bench
