#!/usr/bin/env bash
# Learned drafters (Medusa, EAGLE, and each with prompt lookup) against the 0.5B draft model and
# prompt lookup: Qwen2.5-Coder-1.5B target, greedy, idle 2-core machine, one run per prompt set.
# The heads are the shipped ones (verispec/heads/shipped/qwen2.5-coder-1.5b-instruct/, trained with
# the commands in MANIFEST.json). Raw outputs go to $OUT (ignored by git); with DEST set (e.g.
# DEST=docs/results/qwen2.5-coder-1.5b-learned-drafters/zen3-int4) the reports are copied there.
set -euo pipefail
cd "$(dirname "$0")/../../.."
V=.venv/bin/verispec
T=qwen2.5-coder-1.5b-instruct
D=qwen2.5-coder-0.5b-instruct
OUT=${OUT:-results/heads}
POLICY=${POLICY:-adaptive}
QUANT=${QUANT:-auto}        # auto = int8 on CPU; int4 is the fastest path and what the 1.5B's heads trained on
DEST=${DEST:-}
COMMON=(--target $T --draft $D --methods none,ngram,draft,medusa,eagle,medusa+ngram,eagle+ngram -k 5 --depth-policy "$POLICY"
        --quantization "$QUANT"
        --max-new-tokens 96 --warmup 1 --threads 2)

$V bench "${COMMON[@]}" --dataset humaneval --limit 20 --out "$OUT/humaneval"
$V bench "${COMMON[@]}" --dataset spec_bench --limit 3 --out "$OUT/spec_bench"
for set in humaneval spec_bench; do
    [ -n "$DEST" ] || break
    mkdir -p "$DEST/$set"
    cp "$OUT/$set/report.md" "$OUT/$set/"*.png "$DEST/$set/"
done
