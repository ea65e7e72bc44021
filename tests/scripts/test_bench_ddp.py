"""scripts/bench_ddp.py on the CPU: two gloo ranks share the batches; rank 0 writes the rows."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_two_ranks_count_every_image_once(tmp_path):
    output = tmp_path / "ddp.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_ddp.py"),
            "--device=cpu",
            "--tiny",
            "--batches=6",
            "--devices=2",
            f"--output={output}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(output.read_text())
    assert [row["run"] for row in rows] == ["first", "second"]
    for row in rows:
        assert row["devices"] == 2 and len(row["graphs_captured"]) == 2
        assert row["images"] == 6 * 8  # mixed batches of 8, each batch on one rank
        assert row["images_per_s"] == row["images"] / row["wall_s"]
        assert row["tower_s"] <= row["wall_s"]
