"""scripts/bench.py, the Hydra app, from a bare checkout on the CPU: tiny towers, no CUDA."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_hydra_entry_point_runs(tmp_path):
    output = tmp_path / "bench.json"
    command = [
        sys.executable,
        str(ROOT / "scripts" / "bench.py"),
        "quick=true",
        "tiny=true",
        "device=cpu",
        "workloads=[vit_b_16]",
        "batch_sizes=[2]",
        "methods=[eager,lightning-cg,exact]",
        "warmup=0",
        "repeats=1",
        f"output={output}",
        "plot=null",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(output.read_text())
    assert [row["method"] for row in rows] == ["eager", "lightning-cg/full", "exact"]
    assert "vit_b_16/batch_2" in result.stdout
