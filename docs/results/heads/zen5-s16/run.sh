#!/usr/bin/env bash
# Session 16: issue 6's benchmark (all seven methods, one run per prompt set) with the EAGLE heads
# fine-tuned on the target's own replies (`verispec distill`), on the AMD EPYC Zen 5
# machine (AVX-512 VNNI, 2 cores), on the int4 path (target, 0.5B draft and heads all int4: the
# fastest plain decoding here), after session 14's cheaper EAGLE drafting and session 15's AVX-512
# decode/verify attention. Reports go next to this script.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
V=.venv/bin/verispec
OUT=${OUT:-docs/results/heads/zen5-s16}
COMMON=(--target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --threads 2
        --methods none,ngram,draft,medusa,eagle,medusa+ngram,eagle+ngram -k 5 --depth-policy adaptive
        --max-new-tokens 96 --warmup 1 --quantization int4)
$V bench "${COMMON[@]}" --dataset humaneval --limit 20 --out "$OUT/humaneval"
$V bench "${COMMON[@]}" --dataset spec_bench --limit 3 --out "$OUT/spec_bench"
