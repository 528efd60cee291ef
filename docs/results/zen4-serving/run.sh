#!/usr/bin/env bash
# The serving runs behind docs/results/zen4-serving/: load from a second process on loopback, idle
# 2-core machine, 2 torch threads. Each policy (plain, fixed k, adaptive) gets its own server.
set -euo pipefail
cd "$(dirname "$0")/../../.."
V=.venv/bin/verispec
OUT=docs/results/zen4-serving

$V bench serve --target smollm2-135m-instruct --method ngram -k 5 --concurrency 1,2,4,8,16 \
    --max-tokens 96 --repeats 2 --threads 2 --out $OUT/smollm2_ngram
$V bench soak --target smollm2-135m-instruct --method ngram --requests 200 --threads 2 --out $OUT/soak_smollm2
$V bench serve --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct -k 5 \
    --concurrency 1,2,4,8,16 --max-tokens 48 --repeats 1 --threads 2 --out $OUT/qwen_draft
