#!/usr/bin/env bash
# Session 18: the 1.5B EAGLE heads after a fourth distill round (762k tokens), against plain decoding
# and the 0.5B draft model, four methods (the time left in the session did not hold seven); the
# same settings as session 15's seven-method script. Reports go next to this script.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
V=.venv/bin/verispec
OUT=${OUT:-docs/results/heads/zen5-s18}
COMMON=(--target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --threads 2
        --methods none,draft,eagle,eagle+ngram -k 5 --depth-policy adaptive --max-new-tokens 96 --warmup 1
        --quantization int4)
$V bench "${COMMON[@]}" --dataset humaneval --limit 20 --out "$OUT/humaneval"
$V bench "${COMMON[@]}" --dataset spec_bench --limit 3 --out "$OUT/spec_bench"
