#!/usr/bin/env bash
# EAGLE heads fine-tuned on 1.11M tokens of the target's own replies, on a 2-core AMD EPYC Zen 5
# (int4 path): plain decoding, prompt lookup, the 0.5B draft model, EAGLE and EAGLE + lookup, one run
# per prompt set, the settings of ../zen5-int4-sharegpt-heads/run.sh. Reports go to $OUT.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
V=.venv/bin/verispec
OUT=${OUT:-docs/results/qwen2.5-coder-1.5b-learned-drafters/zen5-int4-distilled-1.1m}
COMMON=(--target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --threads 2
        --methods none,ngram,draft,eagle,eagle+ngram -k 5 --depth-policy adaptive
        --max-new-tokens 96 --warmup 1 --quantization int4)
$V bench "${COMMON[@]}" --dataset humaneval --limit 20 --out "$OUT/humaneval"
$V bench "${COMMON[@]}" --dataset spec_bench --limit 3 --out "$OUT/spec_bench"
