"""CUDA-only scripts find the repo's ``bench`` package, not ``scripts/bench.py``,
also where ``lightning_cg`` is importable (as on a GPU machine's PYTHONPATH)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the cuda tests run these scripts whole")
@pytest.mark.parametrize("script", ["attention_bound.py", "compile_shapes.py"])
def test_a_cuda_script_imports_the_bench_package_before_it_needs_a_gpu(script):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    assert "ModuleNotFoundError" not in result.stderr, result.stderr[-2000:]
    assert "ImportError" not in result.stderr, result.stderr[-2000:]
