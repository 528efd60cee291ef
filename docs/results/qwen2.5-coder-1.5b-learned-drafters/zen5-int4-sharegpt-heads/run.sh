#!/usr/bin/env bash
# All seven methods, one run per prompt set, on a 2-core AMD EPYC Zen 5 (AVX-512 VNNI), on the int4
# path (target, 0.5B draft and heads all int4: the fastest plain decoding there), with EAGLE heads
# trained on ShareGPT and standard-library text. Reports go next to this script.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
V=.venv/bin/verispec
OUT=${OUT:-docs/results/qwen2.5-coder-1.5b-learned-drafters/zen5-int4-sharegpt-heads}
COMMON=(--target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --threads 2
        --methods none,ngram,draft,medusa,eagle,medusa+ngram,eagle+ngram -k 5 --depth-policy adaptive
        --max-new-tokens 96 --warmup 1 --quantization int4)
$V bench "${COMMON[@]}" --dataset humaneval --limit 20 --out "$OUT/humaneval"
$V bench "${COMMON[@]}" --dataset spec_bench --limit 3 --out "$OUT/spec_bench"
