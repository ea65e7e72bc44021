"""What checking a graph's first padded replay against eager costs, for vit_b_16.

A fresh manager's first call captures its one graph (budget 8) and replays it. With
8 rows the replay fills the graph and is not checked; with 7 it is padded and also
runs eagerly once to compare. The difference of the two first calls, against the
capture, is the check's cost; peak allocated memory of each first call too.
Medians of ``--repeats`` alternating pairs, after a warm-up capture (the process's
first capture pays the CUDA libraries' set-up).

    python scripts/row_check_cost.py            # on a CUDA machine
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torchvision.models import vit_b_16

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_cg.adapters.batched import BatchedEncoderAdapter  # noqa: E402
from lightning_cg.engine.manager import EncoderGraphManager  # noqa: E402


def first_call(tower: torch.nn.Module, rows: int) -> dict[str, float]:
    """Seconds, capture seconds and peak MiB of a fresh manager's first call on ``rows``."""
    adapter = BatchedEncoderAdapter(tower)
    manager = EncoderGraphManager(adapter, budgets={"budgets": [8]}, capture="upfront")
    inputs = adapter.inputs_from_call((torch.randn(rows, 3, 224, 224, device="cuda"),), {})
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start_bytes = torch.cuda.memory_allocated()
    started = time.perf_counter()
    manager.execute(inputs)
    torch.cuda.synchronize()
    return {
        "seconds": time.perf_counter() - started,
        "capture": manager.stats.capture_seconds,
        "checked": manager.stats.checked_replays,
        "peak_mib": (torch.cuda.max_memory_allocated() - start_bytes) / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    tower = vit_b_16().cuda().eval()
    with torch.inference_mode():
        first_call(tower, 8)  # warm-up: the process's first capture
        x = torch.randn(7, 3, 224, 224, device="cuda")
        eager = []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            started = time.perf_counter()
            tower(x)
            torch.cuda.synchronize()
            eager.append(time.perf_counter() - started)
        pairs = [(first_call(tower, 8), first_call(tower, 7)) for _ in range(args.repeats)]
    full = {k: statistics.median(p[0][k] for p in pairs) for k in pairs[0][0]}
    padded = {k: statistics.median(p[1][k] for p in pairs) for k in pairs[0][1]}
    check = padded["seconds"] - full["seconds"]
    print(f"eager call of 7 rows          {statistics.median(eager) * 1e3:8.2f} ms")
    for name, row in (
        ("first call, 8 rows (no check)", full),
        ("first call, 7 rows (checked)", padded),
    ):
        print(
            f"{name:30s}{row['seconds'] * 1e3:8.2f} ms  capture {row['capture'] * 1e3:7.2f} ms"
            f"  checked {row['checked']:.0f}  peak {row['peak_mib']:7.1f} MiB"
        )
    print(f"check: {check * 1e3:.2f} ms, {check / full['capture']:.1%} of a capture")


if __name__ == "__main__":
    main()
