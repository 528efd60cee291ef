#!/usr/bin/env bash
# The int4 path on a 2-core Intel Xeon with AMX-INT8, where the int4 and int8 Linears run verispec's
# AMX kernels, against llama.cpp in the same runs. The cost curve is measured twice, with the AMX
# kernels and with the VNNI / fbgemm ones (VERISPEC_INT4_AMX=0), one process each. Raw outputs go to
# $OUT; the reports are copied next to this script.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
V=.venv/bin/verispec
OUT=${OUT:-results/int4-xeon-amx}
COMMON=(--target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --quantization int4 --threads 2)
BENCH=(--methods none,ngram,draft,eagle,eagle+ngram -k 5 --depth-policy adaptive --baselines llamacpp,llamacpp-pld
       --max-new-tokens 128 --warmup 1)

$V bench forward "${COMMON[@]}" --ks 1,2,4,6,8,16,32 --context 120 --repeats 9 --out "$OUT/forward"
VERISPEC_INT4_AMX=0 $V bench forward "${COMMON[@]}" --ks 1,2,4,6,8,16,32 --context 120 --repeats 9 \
    --out "$OUT/forward-vnni"
$V bench "${COMMON[@]}" "${BENCH[@]}" --dataset humaneval --limit 20 --out "$OUT/humaneval"
$V bench "${COMMON[@]}" "${BENCH[@]}" --dataset spec_bench --limit 3 --out "$OUT/spec_bench"
