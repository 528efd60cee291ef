#!/usr/bin/env bash
# All seven methods on a 2-core AMD EPYC Zen 5 (int4 path), with the EAGLE heads fine-tuned on 300k
# tokens of the target's own replies (`verispec distill`): ../zen5-int4-sharegpt-heads/run.sh,
# reports written next to this script.
set -euo pipefail
cd "$(dirname "$0")"
OUT=${OUT:-docs/results/qwen2.5-coder-1.5b-learned-drafters/zen5-int4-distilled-300k} exec bash ../zen5-int4-sharegpt-heads/run.sh
