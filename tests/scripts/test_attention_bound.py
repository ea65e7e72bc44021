import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.cuda
def test_times_every_case_at_every_bound_and_slot_count():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "attention_bound.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    names = ["one image", "stream, 3 images", "mixed_4", "small_16"]
    assert [line.split(":")[0] for line in lines] == names
    assert all("exact" in line and "all rows " in line for line in lines)
    assert "all rows, 4 slots" in lines[0] and "all rows, 4 slots" not in lines[2]
    assert "all rows, 64 slots" in lines[3] and "all rows, 16 slots" not in lines[3]
