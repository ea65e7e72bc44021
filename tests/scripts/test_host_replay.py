import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_reports_host_time_per_replay_of_every_case_on_cpu():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "host_replay.py"), "--passes=1", "--repeats=1"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = re.findall(
        r"^(\w+) +us/replay over 1 passes of (\d+) replays:\n"
        r" +own +min +([\d.]+).*\n +host +min +([\d.]+)",
        result.stdout,
        flags=re.MULTILINE,
    )
    assert [row[0] for row in rows] == ["batched1", "batched8", "packed1", "packed8"]
    # Every call was replayed (captured at first use) and took some host time,
    # of which the manager's own (less the launch) is a part.
    assert all(int(replays) > 0 for _, replays, _, _ in rows)
    assert all(0 < float(own) <= float(host) for _, _, own, host in rows)
