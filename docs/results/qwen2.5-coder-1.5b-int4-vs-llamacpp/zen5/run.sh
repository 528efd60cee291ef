#!/usr/bin/env bash
# The int4 path on a 2-core AMD EPYC Zen 5 (AVX-512 VNNI): 20 HumanEval prompts and 3 per Spec-Bench
# category, llama.cpp (built for the same CPU) in the same runs.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
V=.venv/bin/verispec
COMMON=(--target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --threads 2
        -k 5 --depth-policy adaptive --max-new-tokens 128 --warmup 1 --quantization int4)
$V bench "${COMMON[@]}" --dataset humaneval --limit 20 --methods none,ngram,eagle,eagle+ngram \
    --baselines llamacpp,llamacpp-pld --out ${OUT:-results/int4-zen5}/humaneval
$V bench "${COMMON[@]}" --dataset spec_bench --limit 3 --methods none,ngram,eagle+ngram \
    --baselines llamacpp --out ${OUT:-results/int4-zen5}/spec_bench
