#!/usr/bin/env bash
# JSON mode on the 1.5B: every answer under schema.json (a schema no distill prompt used), the first
# MT-bench prompt of each category (both turns), fixed k=5 and 16 tree nodes so tau measures the
# drafters rather than the depth policy. HEADS=<folder> benchmarks heads other than the shipped ones.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
OUT=${OUT:-results/heads-json}
HEADS=${HEADS:+--heads $HEADS}
# shellcheck disable=SC2086
.venv/bin/verispec bench --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \
    --methods none,ngram,draft,eagle -k 5 --tree-nodes 16 $HEADS \
    --json-schema docs/results/qwen2.5-coder-1.5b-learned-drafters/zen3-json-mode/schema.json --dataset mt_bench --limit 1 \
    --max-new-tokens 128 --threads 2 --out "$OUT"
