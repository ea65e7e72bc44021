#!/usr/bin/env bash
# The GPU suite: the `cuda` tests, then a Trainer smoke run of two workloads that
# checks second runs capture nothing and outputs equal eager.
#
# Runs on a CUDA machine's own Python (torch, lightning, transformers installed).
# Where Hydra is missing, it installs the wheels in .whl/ (from
# `bash ../shared/device/stage.sh`) into a scratch folder first.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
out=${OUT:-/tmp/lightning-cg-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ! "$python" -c "import hydra" 2>/dev/null; then
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "Hydra is not installed and .whl/ holds no wheels: run 'bash ../shared/device/stage.sh' first" >&2
    exit 2
  fi
  site=/tmp/lightning-cg-site
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$python" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, torch.cuda.get_device_name(0))"

"$python" -m pytest -m "cuda and not slow" -p no:cacheprovider --durations=15 tests "$@"
"$python" scripts/bench_trainer.py --workloads vit_b_16/batch_8 packed_vit_small/mixed_batch_8 \
  --batches 50 --methods eager callback --check --overwrite --output "$out/smoke.json"
