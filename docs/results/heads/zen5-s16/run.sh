#!/usr/bin/env bash
# Session 16: issue 6's benchmark (all seven methods, one run per prompt set, int4 path) on the same
# AMD EPYC Zen 5 machine as session 15, with the EAGLE heads fine-tuned on the target's own replies
# (`verispec distill`): session 15's script, reports written next to this one.
set -euo pipefail
cd "$(dirname "$0")"
OUT=${OUT:-docs/results/heads/zen5-s16} exec bash ../zen5-s15/run.sh
