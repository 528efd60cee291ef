#!/usr/bin/env bash
# Session 17: issue 6's benchmark (all seven methods, one run per prompt set, int4 path) on the same
# AMD EPYC Zen 5 machine as sessions 15-16, with the EAGLE heads fine-tuned on 569k tokens of the
# target's own replies (`verispec distill`, three rounds): session 15's script, reports written next
# to this one.
set -euo pipefail
cd "$(dirname "$0")"
OUT=${OUT:-docs/results/heads/zen5-s17} exec bash ../zen5-s15/run.sh
