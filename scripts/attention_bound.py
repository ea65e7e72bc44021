"""What a graph's static attention metadata costs: varlen flash attention over
the real frames with the exact bound and sequence count (the exact-shape graph)
against a graph's bound (``max_seqlen`` = all rows) and its empty sequence slots
(``cu_seqlens`` padded by repeating its last offset up to ``max_frames``).

    python scripts/attention_bound.py    # CUDA only; prints microseconds per call

Flash attention launches ``ceil(max_seqlen / 128)`` blocks per sequence slot and
head; blocks past a sequence's end return at once. Each case times 200 calls
replayed from one CUDA graph, bf16, 12 heads of 64 (packed_vit_small).
"""

import sys
from pathlib import Path

# bench/ is never installed, and scripts/bench.py would shadow it: the repo root comes first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.nn.attention.varlen import varlen_attn

from bench.timing import time_ms

HEADS, HEAD_DIM = 12, 64
CALLS_PER_GRAPH, REPLAYS = 20, 10
#: Frames (patches each) of one sub-batch of the bench's workloads.
CASES = {
    "one image": [576],
    "stream, 3 images": [400, 256, 144],
    "mixed_4": [900, 1600, 600, 1200],
    "small_16": [16, 36, 64, 100] * 4,
}
#: Sequence slots of a graph's ``cu_seqlens``; those below a case's frames are skipped.
SLOTS = (4, 16, 64)


def microseconds_per_call(frames: list[int], max_seqlen: int, slots: int) -> float:
    """Mean time of one varlen attention call over ``frames`` with this bound,
    ``cu_seqlens`` padded with empty sequences to ``slots``."""
    rows = sum(frames)
    qkv = torch.randn(rows, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    sizes = [*frames, *[0] * (slots - len(frames))]
    offsets = torch.tensor([0, *sizes], device="cuda").cumsum(0).to(torch.int32)

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


def main() -> dict[str, dict[str, float]]:
    """Per case: us per call exactly, at all rows, and at all rows with each slot count."""
    torch.manual_seed(0)
    results = {}
    for name, frames in CASES.items():
        rows, count = sum(frames), len(frames)
        timings = {
            "exact": microseconds_per_call(frames, max(frames), count),
            "all rows": microseconds_per_call(frames, rows, count),
        }
        for slots in SLOTS:
            if slots > count:
                timings[f"all rows, {slots} slots"] = microseconds_per_call(frames, rows, slots)
        results[name] = timings
        print(f"{name}: " + ", ".join(f"{label} {us:.1f} us" for label, us in timings.items()))
    return results


if __name__ == "__main__":
    main()
