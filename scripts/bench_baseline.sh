#!/usr/bin/env bash
# Put the engine of a reference commit (default: the last one before the capture
# rule was simplified) under .baseline/ with today's benchmark, so one GPU call
# can run `python3 .baseline/scripts/bench_trainer.py` (reference) and
# `python3 scripts/bench_trainer.py` (current) on the same workloads.
set -euo pipefail
cd "$(dirname "$0")/.."
ref=${1:-80037b7}
rm -rf .baseline && mkdir -p .baseline
git archive "$ref" lightning_cg | tar -x -C .baseline
git archive HEAD bench scripts/bench_trainer.py | tar -x -C .baseline
grep -qx '/.baseline/' .git/info/exclude || echo '/.baseline/' >> .git/info/exclude
echo "reference engine $ref in .baseline/ (carry it to the GPU machine)"
