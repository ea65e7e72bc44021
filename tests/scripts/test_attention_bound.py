import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.cuda
def test_times_every_case_at_both_bounds():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "attention_bound.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["stream, 3 images", "mixed_4", "small_16"]
    assert all("at the longest frame" in line and "at all rows" in line for line in lines)
