import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: A quick profile of tiny towers on the CPU.
TINY_ON_CPU = ("quick=true", "tiny=true", "device=cpu", "dtype=float32", "warmup=1")


def profile_host(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "profile_host.py"), *overrides],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


def test_profiles_one_pass_of_a_tiny_workload_on_cpu(tmp_path):
    result = profile_host(
        *TINY_ON_CPU,
        "workloads=[packed_vit_small]",
        "scenarios=[mixed_4]",
        f"hydra.run.dir={tmp_path}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "packed_vit_small/mixed_4: 4 batches" in result.stdout
    assert "aten::linear" in result.stdout and "Self CPU time total" in result.stdout


def test_kernels_need_cuda(tmp_path):
    result = profile_host("tiny=true", "device=cpu", "+kernels=true", f"hydra.run.dir={tmp_path}")
    assert result.returncode != 0
    assert "kernels=true records GPU kernels and needs device=cuda" in result.stderr


def test_profiles_the_stream_workload_on_cpu(tmp_path):
    result = profile_host(
        *TINY_ON_CPU, "workloads=[stream]", "stream.shapes=5", f"hydra.run.dir={tmp_path}"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "stream/packed_vit_small: 5 batches" in result.stdout


def test_against_names_the_allowed_methods(tmp_path):
    result = profile_host("tiny=true", "device=cpu", "+against=slow", f"hydra.run.dir={tmp_path}")
    assert result.returncode != 0
    assert "against must be one of exact, compile, eager; got 'slow'" in result.stderr
