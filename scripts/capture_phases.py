"""Where a tower's first capture and its first checked replays spend their time (CUDA).

    python scripts/capture_phases.py vit_b_16 --batch 8
    python scripts/capture_phases.py resnet50 --batch 8 --no-weight-copies
    python scripts/capture_phases.py resnet50 --batch 16 --sides 224 256 288 320

Builds a torchvision tower with random weights, runs it eagerly a few times at one
batch of random images per side (so eager's own first-use costs are paid), then serves it
through one ``graphed(tower, capture="first_use")``, side after side (a later side's
capture is a tower's later capture at a new shape), and prints, per call, the time of each stage
with a synchronize on either side: the adapter's graph forwards (the warm-ups: without
weight copies, then with them on a tower's first capture), entering the capture, the
whole capture, the replay, the eager run of a checked replay and its comparison.
Under bf16 autocast and ``torch.inference_mode()``, as a Trainer validates. Then the
allocated memory the graphs added and the stats' memory fields.

Stages are timed by wrapping library functions, so they name the library's internals of
the commit it runs; a stage inside the capture is not synchronized (a capture forbids it).
"""

import argparse
import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torchvision

from lightning_cg import graphed
from lightning_cg.adapters.batched import BatchedEncoderAdapter
from lightning_cg.engine import call_runner
from lightning_cg.engine.capture import GraphCapturer

#: (stage, milliseconds) of the current call, in order.
STAGES: list[tuple[str, float]] = []


def synchronize() -> None:
    if not torch.cuda.is_current_stream_capturing():
        torch.cuda.synchronize()


def timed(stage: str, function: Callable) -> Callable:
    """``function``, recording its time under ``stage`` (synchronized unless capturing)."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        synchronize()
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            synchronize()
            STAGES.append((stage, (time.perf_counter() - started) * 1000))

    return wrapper


def instrument() -> None:
    """Time the stages of a capture and of a checked replay."""
    adapter = BatchedEncoderAdapter
    adapter.graph_forward = timed("graph_forward", adapter.graph_forward)
    adapter.eager_forward = timed("eager_forward", adapter.eager_forward)
    call_runner.replay_error = timed("replay_error", call_runner.replay_error)
    torch.cuda.CUDAGraph.replay = timed("replay", torch.cuda.CUDAGraph.replay)
    torch.cuda.graph.__enter__ = timed("graph_enter", torch.cuda.graph.__enter__)
    GraphCapturer.capture = timed("capture", GraphCapturer.capture)


def milliseconds(function: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    function()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tower", help="a torchvision.models builder, e.g. vit_b_16, resnet50")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--calls", type=int, default=4, help="graphed calls to time per side")
    parser.add_argument("--sides", type=int, nargs="+", default=[224], help="image sides")
    parser.add_argument(
        "--no-weight-copies", action="store_true", help="cast_weights_per_run=False"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("capture_phases.py needs a CUDA GPU")
    tower = getattr(torchvision.models, args.tower)(weights=None).cuda().eval()
    batches = {side: torch.randn(args.batch, 3, side, side, device="cuda") for side in args.sides}
    copies = not args.no_weight_copies
    instrument()
    with torch.inference_mode(), torch.autocast("cuda", torch.bfloat16):
        print(f"{args.tower} batch {args.batch}, weight copies {copies}")
        for side, images in batches.items():
            eager = [milliseconds(functools.partial(tower, images)) for _ in range(6)]
            print(f"  side {side} eager ms", " ".join(f"{ms:.2f}" for ms in eager))
        allocated = torch.cuda.memory_allocated()
        with graphed(tower, capture="first_use", cast_weights_per_run=copies) as served:
            for side, images in batches.items():
                for call in range(args.calls):
                    STAGES.clear()
                    total = milliseconds(functools.partial(tower, images))
                    stages = " ".join(f"{stage}={ms:.2f}" for stage, ms in STAGES)
                    print(f"  side {side} call {call}: {total:.2f} ms: {stages}")
            stats = served.stats
            grown = (torch.cuda.memory_allocated() - allocated) / 2**20
            held = {
                name: round(stats[name] / 2**20, 1)
                for name in ("weight_copy_bytes", "pool_bytes", "held_bytes")
            }
            print(f"  allocated memory grew {grown:.1f} MiB; stats MiB {held}")


if __name__ == "__main__":
    main()
