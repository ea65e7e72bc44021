"""What a graph's static attention bound costs: varlen flash attention at the
longest real frame (the exact-shape graph) against the whole budget's rows (a
lightning-cg graph, whose ``max_seqlen`` must hold any frame that fits).

    python scripts/attention_bound.py    # CUDA only; prints microseconds per call

Flash attention launches ``ceil(max_seqlen / 128)`` blocks per sequence and
head; blocks past a sequence's end return at once. Each case times 200 calls
replayed from one CUDA graph, bf16, 12 heads of 64 (packed_vit_small).
"""

import sys
from pathlib import Path

try:
    import lightning_cg  # noqa: F401
except ImportError:  # a checkout that is not pip-installed: import it from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.nn.attention.varlen import varlen_attn

from lightning_cg.measured import time_ms

HEADS, HEAD_DIM = 12, 64
CALLS_PER_GRAPH, REPLAYS = 20, 10
#: Frames (patches each) of one sub-batch of the bench's workloads.
CASES = {
    "stream, 3 images": [400, 256, 144],
    "mixed_4": [900, 1600, 600, 1200],
    "small_16": [16, 36, 64, 100] * 4,
}


def microseconds_per_call(frames: list[int], max_seqlen: int) -> float:
    """Mean time of one varlen attention call over ``frames`` with this bound."""
    rows = sum(frames)
    qkv = torch.randn(rows, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    offsets = torch.tensor([0, *frames], device="cuda").cumsum(0).to(torch.int32)

    def attend() -> None:
        varlen_attn(qkv, qkv, qkv, offsets, offsets, max_seqlen, max_seqlen)

    for _ in range(3):  # warm up outside the graph
        attend()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            attend()
    return 1e3 * time_ms(graph.replay, repeats=REPLAYS, warmup=1) / CALLS_PER_GRAPH


def main() -> dict[str, tuple[float, float]]:
    """Per case: (us per call at the longest frame, us per call at all rows)."""
    torch.manual_seed(0)
    results = {}
    for name, frames in CASES.items():
        exact = microseconds_per_call(frames, max(frames))
        budget = microseconds_per_call(frames, sum(frames))
        results[name] = (exact, budget)
        print(f"{name}: {exact:.1f} us at the longest frame, {budget:.1f} us at all rows")
    return results


if __name__ == "__main__":
    main()
