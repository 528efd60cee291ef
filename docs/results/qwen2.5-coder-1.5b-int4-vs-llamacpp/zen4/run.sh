#!/usr/bin/env bash
# The int4 path: Qwen2.5-Coder-1.5B target and 0.5B draft with 4-bit weights (`--quantization int4`,
# verispec's AVX-512 VNNI kernel), greedy, idle 2-core machine, against llama.cpp (plain and prompt
# lookup) on the bundled Q4_K_M GGUF in the same run, the adaptive depth policy for every verispec
# method. Raw outputs go to results/ (ignored); reports are copied next to this script.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
V=.venv/bin/verispec
T=qwen2.5-coder-1.5b-instruct
D=qwen2.5-coder-0.5b-instruct
OUT=${OUT:-results/int4}
BASELINES=${BASELINES:-llamacpp,llamacpp-pld}
COMMON=(--target $T --draft $D --quantization int4 --threads 2)

$V bench forward "${COMMON[@]}" --ks 1,2,4,8,16 --context 120 --repeats 7 --out "$OUT/forward"
$V bench "${COMMON[@]}" --methods none,ngram,draft,eagle,eagle+ngram -k 5 --depth-policy adaptive --baselines "$BASELINES" \
    --dataset humaneval --limit 20 --max-new-tokens 128 --warmup 1 --out "$OUT/humaneval"
$V bench "${COMMON[@]}" --methods none,ngram,draft,eagle,eagle+ngram -k 5 --depth-policy adaptive --baselines "$BASELINES" \
    --dataset spec_bench --limit 3 --max-new-tokens 128 --warmup 1 --out "$OUT/spec_bench"
for set in humaneval spec_bench; do
    mkdir -p "docs/results/qwen2.5-coder-1.5b-int4-vs-llamacpp/zen4/$set"
    cp "$OUT/$set/report.md" "$OUT/$set/"*.png "docs/results/qwen2.5-coder-1.5b-int4-vs-llamacpp/zen4/$set/"
done
cp "$OUT/forward/forward.json" docs/results/qwen2.5-coder-1.5b-int4-vs-llamacpp/zen4/forward.json
