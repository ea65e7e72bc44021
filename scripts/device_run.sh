#!/usr/bin/env bash
# One batched call on the GPU machine (see BENCHMARKS.md): Hydra wheels, then steps.
# Usage there: bash scripts/device_run.sh cuda-tests cuda-slow demo "bench:NAME:OVERRIDES..." \
#   "trainer:NAME:BENCH_TRAINER_ARGS..." ...
# A trainer step runs scripts/bench_trainer.py here, then the same arguments in .baseline/
# when it exists (scripts/bench_baseline.sh puts a reference library there; the other
# order with REFERENCE_FIRST=1), in one call, and compares the two (scripts/compare_trainer.py).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
# The first CUDA process of a fresh machine loads cuBLAS, cuDNN and graph support from a
# cold disk; pay that here, not in the first step's first capture.
python3 - <<'WARM'
import torch
conv, linear = torch.nn.Conv2d(3, 8, 3).cuda(), torch.nn.Linear(8, 8).cuda()
x = torch.randn(2, 3, 16, 16, device="cuda")
with torch.inference_mode(), torch.autocast("cuda", torch.bfloat16):
    forward = lambda: linear(conv(x).mean((2, 3)))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    graph.replay()
torch.cuda.synchronize()
WARM
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case "$step" in
    cuda-tests|cuda-slow)
      # Two steps: a call that runs out of time still brings back the first one's log.
      # No -q: the project's addopts hold one, and a second hides the counts line.
      marker="cuda and not slow"
      [ "$step" = cuda-slow ] && marker="cuda and slow"
      python3 -m pytest -m "$marker" -p no:cacheprovider --timeout=300 --durations=15 \
        > "$OUT/$step.log" 2>&1
      grep -E "passed|failed|FAILED|ERROR" "$OUT/$step.log" | tail -30 ;;
    demo)
      # What `make demo` runs; its per-pass table comes back in demo.log.
      python3 scripts/predict.py data.batch_size=1 data.repeats=4 trainer=gpu \
        hydra.run.dir=/tmp/hydra > "$OUT/demo.log" 2>&1
      tail -22 "$OUT/demo.log" ;;
    trainer:*)
      IFS=: read -r _ name args <<< "$step"
      # REFERENCE_FIRST=1 runs .baseline/ first: the first process to use a kernel may
      # load it from a cold disk, which the second then finds cached.
      order=(current)
      if [ -d .baseline ]; then
        order=(current reference)
        [ "${REFERENCE_FIRST:-0}" = 1 ] && order=(reference current)
      fi
      for engine in "${order[@]}"; do
        if [ "$engine" = current ]; then
          # shellcheck disable=SC2086
          timeout "${BENCH_TIMEOUT:-240}" python3 scripts/bench_trainer.py $args --overwrite \
            --output "$OUT/$name.json" > "$OUT/$name.log" 2>&1
          tail -25 "$OUT/$name.log"
        else
          # shellcheck disable=SC2086
          (cd .baseline && PYTHONPATH=/tmp/site:$PWD timeout "${BENCH_TIMEOUT:-240}" \
            python3 scripts/bench_trainer.py $args --overwrite --output "$OUT/$name-baseline.json") \
            > "$OUT/$name-baseline.log" 2>&1
          tail -25 "$OUT/$name-baseline.log"
        fi
      done
      if [ -d .baseline ]; then
        python3 scripts/compare_trainer.py "$OUT/$name.json" "$OUT/$name-baseline.json"
      fi ;;
    bench:*)
      IFS=: read -r _ name overrides <<< "$step"
      # shellcheck disable=SC2086
      timeout "${BENCH_TIMEOUT:-240}" python3 scripts/bench.py $overrides output="$OUT/$name.json" plot="$OUT/$name.png" \
        hydra.run.dir=/tmp/hydra > "$OUT/$name.log" 2>&1
      tail -45 "$OUT/$name.log" ;;
    *)
      echo "unknown step $step; steps: cuda-tests, cuda-slow, demo, trainer:NAME:ARGS, bench:NAME:OVERRIDES" >&2
      exit 2 ;;
  esac
  # A call brings back few files: each step's results, logs and metadata join one archive.
  (cd "$OUT" && find . -maxdepth 1 -type f ! -name results.tar -printf '%P\0' \
    | xargs -0 -r sh -c 'tar -rf results.tar "$@" && rm -f "$@"' tar)
done
