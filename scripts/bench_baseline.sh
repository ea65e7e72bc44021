#!/usr/bin/env bash
# Put the library of a reference commit (default: 0.1.0's engine, the
# cost-estimating capture policy) under .baseline/ with the benchmark of a second
# commit that runs against it (default: the last benchmark of 0.1.0's layout), so
# one GPU call can run
# `(cd .baseline && python3 scripts/bench_trainer.py ...)` (reference) and
# `python3 scripts/bench_trainer.py ...` (current) on the same workloads.
set -euo pipefail
cd "$(dirname "$0")/.."
ref=${1:-80037b7}
bench_ref=${2:-46d6f94}
rm -rf .baseline && mkdir -p .baseline
git archive "$ref" lightning_cg | tar -x -C .baseline
git archive "$bench_ref" bench examples scripts/bench_trainer.py | tar -x -C .baseline
grep -qx '/.baseline/' .git/info/exclude || echo '/.baseline/' >> .git/info/exclude
echo "reference library $ref, benchmark $bench_ref in .baseline/ (carry it to the GPU machine)"
