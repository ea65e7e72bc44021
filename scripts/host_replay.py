"""Host microseconds per graph replay of EncoderGraphManager: the manager's own work per call.

    python scripts/host_replay.py                   # table: batched / packed, batch 1 and 8
    python scripts/host_replay.py --profile packed8 # cProfile of the timed passes of one case
    python scripts/host_replay.py --profile packed8 --sort cumulative
    python scripts/host_replay.py --idle-gpu        # CUDA: no time waiting for the GPU

Every key is captured at first use (prepared on CPU), then each graph's run is
replaced by one returning its output buffer, so what is timed is the manager's
own work around the launch: replay_inputs, fill/padding, copies, clone.
On CUDA, graph.run is kept (the real replay) unless --no-forward is given;
the table's "own" column is the host time less the launch's.
"""

import argparse
import cProfile
import pstats
import random
import sys
import time
from pathlib import Path

import torch
from torch import nn

# The repository's package, not an installed copy.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.models.packed_vit import PackedViT, packed_vit_small_config
from lightning_cg.adapters.batched import BatchedEncoderAdapter
from lightning_cg.adapters.packed import PackedEncoderAdapter
from lightning_cg.engine.manager import EncoderGraphManager

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
STUB_PACKED_FORWARD = DEVICE.type == "cpu"


class TinyTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3 * 8 * 8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1))


def batched_case(batch_size: int, calls: int):
    tower = TinyTower().to(DEVICE).eval()
    manager = EncoderGraphManager(BatchedEncoderAdapter(tower), capture="first_use")
    batches = [torch.randn(batch_size, 3, 8, 8, device=DEVICE) for _ in range(calls)]
    return manager, [((x,), {}) for x in batches]


def packed_case(batch_size: int, calls: int, patch_size: int):
    # patch 2, 1 channel: a 4-wide patch row, so the CPU's memcpy of the patches
    # (an async device copy on the GPU) does not swamp the host work.
    config = packed_vit_small_config(
        hidden_size=32,
        depth=1,
        num_heads=2,
        out_hidden_size=32,
        patch_size=patch_size,
        in_channels=1 if patch_size == 2 else 3,
    )
    tower = PackedViT(config).to(DEVICE).eval()
    if STUB_PACKED_FORWARD:
        # CPU: the forward of thousands of rows (a dense mask without varlen) is
        # what would take the time; its output's shape is all the harness needs.
        merge_area = config.spatial_merge_size**2
        tower.forward_packed = lambda patches, cu_seqlens, positions, max_seqlen: patches.new_zeros(
            patches.shape[0] // merge_area, config.out_hidden_size
        )
    manager = EncoderGraphManager(PackedEncoderAdapter(tower), capture="first_use")
    rng = random.Random(0)
    calls_args = []
    for _ in range(calls):
        grid = [(1, 2 * rng.randint(2, 32), 2 * rng.randint(2, 32)) for _ in range(batch_size)]
        rows = sum(t * h * w for t, h, w in grid)
        patches = torch.randn(rows, config.patch_dim, device=DEVICE)
        calls_args.append(((patches, torch.tensor(grid, device=DEVICE)), {}))
    return manager, calls_args


def run_pass(manager, calls_args, idle_gpu: bool = False):
    for args, kwargs in calls_args:
        if idle_gpu:
            torch.cuda.synchronize()
        manager.execute(manager.encoder.inputs_from_call(args, kwargs))


class NeverChecked:
    """The check schedule of a graph whose forward is skipped: no replay compares."""

    def due(self, padded: frozenset[str]) -> bool:
        return False

    def replayed(self) -> None:
        pass


def skip_forward(manager) -> None:
    for _, graph in manager.cache.items():
        output = graph.run()
        graph.run = lambda output=output: output
        graph.checks = NeverChecked()  # a stale output would differ from eager


def measure(
    manager, calls_args, passes: int, no_forward: bool, profiler=None, idle_gpu: bool = False
):
    """Host us per replay of each timed pass, without and with the launch (the
    first two passes capture and warm up); with ``idle_gpu``, the GPU has
    finished the earlier calls' work when a call starts."""
    per_pass = []
    with torch.inference_mode():
        run_pass(manager, calls_args)  # captures every key
        if no_forward:
            skip_forward(manager)
        run_pass(manager, calls_args)  # warm
        for _ in range(passes):
            if DEVICE.type == "cuda":
                torch.cuda.synchronize()
            manager.stats.reset_run()
            if profiler is not None:
                profiler.enable()
            run_pass(manager, calls_args, idle_gpu)
            if profiler is not None:
                profiler.disable()
            stats = manager.stats
            per_pass.append(
                (stats.host_us_per_replay - stats.launch_us_per_replay, stats.host_us_per_replay)
            )
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
    return per_pass, manager.stats.hits


CASES = {
    "batched1": lambda: batched_case(1, 50),
    "batched8": lambda: batched_case(8, 50),
    # 400 images per pass either way: an epoch sees far more sizes than a cache of
    # a few hundred frame sizes holds, and so do both packed cases.
    "packed1": lambda: packed_case(1, 400, 2),
    "packed8": lambda: packed_case(8, 50, 2),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", choices=CASES)
    parser.add_argument("--passes", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sort", default="tottime", help="the profile's pstats sort key")
    parser.add_argument("--no-forward", action="store_true", default=DEVICE.type == "cpu")
    parser.add_argument(
        "--thread-clock",
        action="store_true",
        help="count the thread's CPU time, not wall time (steadier on a shared CPU; "
        "on a GPU host it hides time blocked in launches)",
    )
    parser.add_argument(
        "--idle-gpu",
        action="store_true",
        help="synchronize before each call, so that no figure counts time the host "
        "waits for the GPU's earlier work (a staging buffer still being read, a "
        "full launch queue): the manager's own work alone (CUDA only)",
    )
    args = parser.parse_args()
    if args.idle_gpu and DEVICE.type != "cuda":
        parser.error("--idle-gpu needs CUDA")
    if args.thread_clock:
        import types

        import lightning_cg.engine.call_runner

        lightning_cg.engine.call_runner.time = types.SimpleNamespace(perf_counter=time.thread_time)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if args.profile:
        manager, calls_args = CASES[args.profile]()
        profiler = cProfile.Profile()
        measure(manager, calls_args, args.passes, args.no_forward, profiler, args.idle_gpu)
        pstats.Stats(profiler, stream=sys.stdout).sort_stats(args.sort).print_stats(30)
        return
    clock = "thread CPU time" if args.thread_clock else "wall time"
    idle = ", GPU idle at each call" if args.idle_gpu else ""
    print(f"device {DEVICE}, forward {'skipped' if args.no_forward else 'replayed'}, {clock}{idle}")
    for name, build in CASES.items():
        per_pass = []
        for _ in range(args.repeats):
            manager, calls_args = build()
            passes, hits = measure(
                manager, calls_args, args.passes, args.no_forward, idle_gpu=args.idle_gpu
            )
            per_pass += passes
        print(f"{name:10s} us/replay over {len(per_pass)} passes of {hits} replays:")
        own, host = (sorted(column) for column in zip(*per_pass, strict=True))
        for column, figures in (("own", own), ("host", host)):
            print(
                f"  {column:4s} min {figures[0]:6.1f}  p25 {figures[len(figures) // 4]:6.1f}  "
                f"median {figures[len(figures) // 2]:6.1f}"
            )


if __name__ == "__main__":
    main()
