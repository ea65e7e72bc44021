"""Images per second of ``trainer.predict`` with the callback under DDP, against one device.

    python scripts/bench_ddp.py --devices 1 --output /tmp/ddp-1.json
    python scripts/bench_ddp.py --devices 2 --output /tmp/ddp-2.json
    python scripts/bench_ddp.py --device cpu --tiny --batches 4 --devices 2 --output /tmp/ddp.json

Each rank builds the same seeded batches (``--workload``, default
packed_vit_small/mixed_batch_8; ``--batches``, default 1000) on its own device,
and Lightning's distributed sampler gives each rank its share. One module and
one callback run ``trainer.predict`` twice (the ``first`` and the ``second``
run). Rank 0 writes one row per run: the images of all ranks, the slowest
rank's wall and tower seconds, and images per second by each. Lightning starts
the other ranks by running this script again.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# scripts/bench.py would shadow the bench package: look in the repo root instead of here.
ROOT = Path(__file__).resolve().parents[1]
if sys.path[0] and Path(sys.path[0]).resolve() == ROOT / "scripts":
    sys.path[0] = str(ROOT)
else:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.trainer.module import RunClock, UserModule  # noqa: E402
from bench.trainer.runs import TrainerSettings, make_trainer  # noqa: E402
from bench.trainer.suite import quiet_lightning, warm_up  # noqa: E402
from bench.trainer.workloads import (  # noqa: E402
    FULL_SIZES,
    TINY_SIZES,
    SyntheticBatches,
    Workload,
    make_tower,
)
from lightning_cg import CUDAGraphCallback  # noqa: E402

RUNS = ("first", "second")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="packed_vit_small/mixed_batch_8")
    parser.add_argument("--batches", type=int, default=1000)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny towers and images (CPU)")
    parser.add_argument("--callback-kwargs", type=json.loads, default={})
    parser.add_argument("--output", type=Path, required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    quiet_lightning()
    precision = "bf16-mixed" if args.device == "cuda" else "32-true"
    settings = TrainerSettings(args.device, precision, args.callback_kwargs)
    workload = Workload.parse(args.workload)
    sizes = TINY_SIZES if args.tiny else FULL_SIZES
    tower = make_tower(workload, sizes, 0)
    # Lightning sets LOCAL_RANK in the ranks it starts; rank 0 is this process.
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    batches = SyntheticBatches(workload, tower, args.batches, sizes, 0, device)
    warm_up(tower, batches, str(device), precision)
    callback = CUDAGraphCallback(module="backbone", **settings.callback_kwargs)
    clock = RunClock(callback)
    strategy = "ddp" if args.devices > 1 else "auto"
    trainer = make_trainer(settings, [callback, clock], devices=args.devices, strategy=strategy)
    module = UserModule(tower)
    for _ in RUNS:
        trainer.predict(module, dataloaders=batches.loader(), return_predictions=False)
    per_rank = [
        {
            "images": record.calls * workload.batch_size,
            "wall_s": record.wall_s,
            "tower_s": record.tower_s,
            "graphs_captured": record.graphs_captured,
        }
        for record in clock.records
    ]
    ranks = _gather(per_rank)
    if trainer.global_rank == 0:
        rows = [_row(args, run, [rank[index] for rank in ranks]) for index, run in enumerate(RUNS)]
        args.output.write_text(json.dumps(rows, indent=1) + "\n")
        for row in rows:
            print(json.dumps(row))
    if dist.is_available() and dist.is_initialized():
        # Left to the interpreter's exit, gloo's threads sometimes abort it
        # ("terminate called without an active exception", SIGABRT).
        dist.destroy_process_group()


def _gather(per_rank: list[dict]) -> list[list[dict]]:
    """Every rank's records (one rank: its own)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [per_rank]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, per_rank)
    return gathered


def _row(args: argparse.Namespace, run: str, ranks: list[dict]) -> dict:
    images = sum(rank["images"] for rank in ranks)
    wall_s = max(rank["wall_s"] for rank in ranks)
    tower_s = max(rank["tower_s"] for rank in ranks)
    return {
        "workload": args.workload,
        "batches": args.batches,
        "devices": args.devices,
        "run": run,
        "images": images,
        "wall_s": wall_s,
        "tower_s": tower_s,
        "images_per_s": images / wall_s,
        "tower_images_per_s": images / tower_s,
        "graphs_captured": [rank["graphs_captured"] for rank in ranks],
    }


if __name__ == "__main__":
    main()
