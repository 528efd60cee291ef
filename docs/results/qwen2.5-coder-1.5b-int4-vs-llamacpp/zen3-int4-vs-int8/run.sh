#!/usr/bin/env bash
# The int4 path on a 2-core AVX2-only AMD EPYC Zen 3 against llama.cpp, then the int8 path, on 10
# HumanEval prompts; then Spec-Bench, one prompt per category, int4.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
V=.venv/bin/verispec
COMMON=(--target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --threads 2
        -k 5 --depth-policy adaptive --dataset humaneval --limit 10 --max-new-tokens 128 --warmup 1)
$V bench "${COMMON[@]}" --quantization int4 --methods none,ngram,eagle,eagle+ngram --baselines llamacpp,llamacpp-pld --out ${OUT:-results/int4-zen3}/int4
$V bench "${COMMON[@]}" --quantization int8 --methods none,ngram,eagle,eagle+ngram --out ${OUT:-results/int4-zen3}/int8
# Spec-Bench, one prompt per category:
$V bench --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --threads 2 -k 5 --depth-policy adaptive \
    --dataset spec_bench --limit 1 --max-new-tokens 128 --warmup 1 --quantization int4 --methods none,ngram,eagle+ngram \
    --baselines llamacpp --out ${OUT:-results/int4-zen3}/int4-sb
