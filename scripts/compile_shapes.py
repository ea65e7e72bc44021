"""Static against dynamic shapes for ``compile: true``: one CUDA graph replay of
packed_vit_small's compiled ``forward_packed`` on one batch, compiled with
``dynamic=True`` (what :class:`~lightning_cg.engine.compiled.CompiledEncoder` does for
a packed tower, once for every budget) and with ``dynamic=False`` (one compile
per shape, as reduce-overhead specialises).

    python scripts/compile_shapes.py    # CUDA only; bf16, random weights

Each mode is compiled afresh twice (the second time from inductor's caches);
a row is the best of 5 timings of 50 replays.
"""

import sys
from pathlib import Path

# bench/ is never installed, and scripts/bench.py would shadow it: the repo root comes first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import time

import torch

from bench.timing import time_ms
from examples.models.packed_vit import PackedViT, packed_vit_small_config, patchify

REPLAYS, TIMINGS = 50, 5
#: Three images of the stream workload's sizes.
IMAGE_SIZES = [(224, 320), (160, 160), (96, 288)]


def replay_microseconds(tower: PackedViT, dynamic: bool) -> tuple[float, float]:
    """(us per replay, compile seconds) of ``forward_packed`` compiled with ``dynamic``."""
    images = [torch.randn(3, height, width) for height, width in IMAGE_SIZES]
    patches, grid_thw = patchify(images, tower.config.patch_size, tower.config.spatial_merge_size)
    patches = patches.cuda().to(torch.bfloat16)
    metadata = tower.build_metadata(grid_thw, patches.device)
    torch._dynamo.reset()
    forward = torch.compile(tower.forward_packed, dynamic=dynamic)

    def run() -> torch.Tensor:
        return forward(patches, **metadata, max_seqlen=patches.shape[0])

    started = time.perf_counter()
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    compile_seconds = time.perf_counter() - started
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    best = min(time_ms(graph.replay, repeats=REPLAYS) for _ in range(TIMINGS))
    return 1e3 * best, compile_seconds


def main() -> None:
    torch.manual_seed(0)
    tower = PackedViT(packed_vit_small_config()).cuda().to(torch.bfloat16).eval()
    with torch.inference_mode():
        for dynamic in (True, False, True, False):
            microseconds, seconds = replay_microseconds(tower, dynamic)
            print(f"dynamic={dynamic}: {microseconds:.1f} us per replay, compile {seconds:.1f} s")


if __name__ == "__main__":
    main()
