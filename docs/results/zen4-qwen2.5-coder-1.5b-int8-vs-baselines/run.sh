#!/usr/bin/env bash
# The runs behind this folder: Qwen2.5-Coder-1.5B target, 0.5B draft, int8 path, idle 2-core machine,
# against transformers and llama.cpp. Raw outputs go to results/ (ignored by git); the reports are
# copied here afterwards.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
V=.venv/bin/verispec
T=qwen2.5-coder-1.5b-instruct
D=qwen2.5-coder-0.5b-instruct
OUT=${OUT:-results/qwen1.5b}
BASELINES=${BASELINES:-hf,hf-assisted,hf-pld,llamacpp,llamacpp-pld}
RESUME=${RESUME:-}

$V bench forward --target $T --draft $D --ks 1,2,4,8,16 --context 120 --repeats 7 --out "$OUT/forward"
$V bench --target $T --draft $D --methods none,ngram,draft -k 5 --baselines "$BASELINES" \
    --dataset humaneval --limit 20 --max-new-tokens 128 --warmup 1 --out "$OUT/humaneval" $RESUME
$V bench --target $T --draft $D --methods none,ngram,draft -k 5 --baselines "$BASELINES" \
    --dataset spec_bench --limit 3 --max-new-tokens 128 --warmup 1 --out "$OUT/spec_bench" $RESUME
$V plan --forward "$OUT/forward/forward.json" --results "$OUT/humaneval/results.json" > "$OUT/plan_humaneval.txt"
$V plan --forward "$OUT/forward/forward.json" --results "$OUT/spec_bench/results.json" > "$OUT/plan_spec_bench.txt"
$V bench quality --target $T --limit 20 --out "$OUT/quality"
