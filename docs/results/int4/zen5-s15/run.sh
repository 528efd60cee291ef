#!/usr/bin/env bash
# Session 15: the int4 path on an AMD EPYC Zen 5 machine (AVX-512 VNNI, 2 cores) after session 14's
# cheaper EAGLE drafting (drafting forward with the C++ layer ops, int4 heads, the policy's node-gain
# floor), at the issue's prompt counts (20 HumanEval prompts, 3 per Spec-Bench category), llama.cpp in
# the same runs.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
V=.venv/bin/verispec
COMMON=(--target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --threads 2
        -k 5 --depth-policy adaptive --max-new-tokens 128 --warmup 1 --quantization int4)
$V bench "${COMMON[@]}" --dataset humaneval --limit 20 --methods none,ngram,eagle,eagle+ngram \
    --baselines llamacpp,llamacpp-pld --out ${OUT:-results/int4-zen5-s15}/humaneval
$V bench "${COMMON[@]}" --dataset spec_bench --limit 3 --methods none,ngram,eagle+ngram \
    --baselines llamacpp --out ${OUT:-results/int4-zen5-s15}/spec_bench
