#!/usr/bin/env bash
# One batched call on the GPU machine: Hydra wheels, then the given steps.
# Usage there: bash scripts/device_run.sh cuda-tests demo bench-quick bench-full
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case "$step" in
    cuda-tests) python3 -m pytest -m cuda -q -p no:cacheprovider -x --timeout=300 2>&1 | tee "$OUT/cuda-tests.log" | tail -25 ;;
    demo) python3 scripts/predict.py trainer=gpu compare_eager=true hydra.run.dir=/tmp/hydra 2>&1 | tail -22 ;;
    bench-quick) python3 scripts/bench.py quick=true output="$OUT/bench-quick.json" plot="$OUT/bench-quick.png" hydra.run.dir=/tmp/hydra 2>&1 | tail -40 ;;
    bench-*) python3 scripts/bench.py "workloads=[${step#bench-}]" output="$OUT/bench-${step#bench-}.json" plot="$OUT/bench-${step#bench-}.png" hydra.run.dir=/tmp/hydra 2>&1 | tail -40 ;;
  esac
done
