"""What the callback tells the user (rank zero only): rebinding or recapture and the CPU path at
a run's start; at its end the stats summed over ranks (memory: the largest rank's), logged as
``cudagraph/<name>``."""

from __future__ import annotations

from collections.abc import Mapping

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_cg.core.stats import GraphStats
from lightning_cg.engine.binding import CHANGED, REBOUND


def report_rebinding(outcome: str) -> None:
    """Say what :meth:`~lightning_cg.engine.binding.TensorBinding.rebind` did, if anything."""
    if outcome == REBOUND:
        rank_zero_info(
            "CUDAGraphCallback: tower tensors came back in new storage; "
            "copied their values into the captured storage, graphs kept."
        )
    elif outcome == CHANGED:
        rank_zero_info(
            "CUDAGraphCallback: a tower parameter or buffer changed shape, dtype or "
            "device; its graphs are captured again."
        )


def report_cpu_path() -> None:
    """Say that without CUDA nothing is captured, and how sub-batches run instead."""
    rank_zero_info(
        "CUDAGraphCallback: CUDA graphs need a CUDA device and the tower is on the CPU, so "
        "nothing is captured: a sub-batch the capture rule would give a graph runs the same "
        "budget path without one (packed, padded), the others run eagerly."
    )


#: Memory one rank's graphs hold: the largest rank's is reported, as each device must
#: fit its own graphs; summing over ranks would overstate what one device needs.
PER_DEVICE = ("pool_bytes", "weight_copy_bytes", "held_bytes")


def reduce_stats(trainer: pl.Trainer, stats: Mapping[str, float]) -> dict[str, float]:
    """Counters summed over ranks, memory (:data:`PER_DEVICE`) the largest rank's, rates
    recomputed from the sums."""
    rates = GraphStats().rates()
    counters = [name for name in stats if name not in rates]
    summed = [name for name in counters if name not in PER_DEVICE]
    largest = [name for name in counters if name in PER_DEVICE]
    reduced = {**_reduce(trainer, stats, summed, "sum"), **_reduce(trainer, stats, largest, "max")}
    ordered = {name: reduced[name] for name in counters}
    return {**ordered, **GraphStats(**ordered).rates()}


def _reduce(
    trainer: pl.Trainer, stats: Mapping[str, float], names: list[str], op: str
) -> dict[str, float]:
    """``stats[name]`` of each of ``names`` reduced over ranks by ``op``."""
    values = torch.tensor(
        [stats[name] for name in names], dtype=torch.float64, device=trainer.strategy.root_device
    )
    return dict(zip(names, trainer.strategy.reduce(values, reduce_op=op).tolist(), strict=True))


def report_run(trainer: pl.Trainer, stats: Mapping[str, float], stage: str, on_cuda: bool) -> None:
    """Log ``stats`` (reduced over ranks by :func:`reduce_stats`) as metrics and tell them in
    one line."""
    metrics = {f"cudagraph/{name}": value for name, value in stats.items()}
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)
    if not on_cuda:
        rank_zero_info(
            f"CUDAGraphCallback ({stage}): no CUDA graphs on the CPU; {stats['hits']:.0f} "
            f"sub-batch paths ran the padded budget path, {stats['misses']:.0f} eagerly, "
            f"padding waste {stats['padding_waste']:.1%}"
        )
    else:
        compiling = stats.get("compile_seconds_run", 0.0)
        rank_zero_info(
            f"CUDAGraphCallback ({stage}): {stats['hits']:.0f} graph replays, "
            f"{stats['misses']:.0f} eager runs, hit rate {stats['hit_rate']:.0%}, "
            f"padding waste {stats['padding_waste']:.1%}, "
            f"{stats['graphs_captured']:.0f} graphs captured in "
            f"{stats['capture_seconds_run']:.2f} s ({stats['graphs']:.0f} held; {_memory(stats)})"
            + (f", {compiling:.2f} s of it compiling the graph forward" if compiling else "")
        )


def report_costly_captures(lines: list[str], stage: str, module: str | None) -> None:
    """Tell each capture that cost the run more than its eager time, on its own line."""
    for line in lines:
        rank_zero_info(f"CUDAGraphCallback ({stage}, module={module!r}): {line}")


def _memory(stats: Mapping[str, float]) -> str:
    """The device memory the graphs hold, and its parts, in MiB."""
    pool, copies, held = (
        stats[name] / 2**20 for name in ("pool_bytes", "weight_copy_bytes", "held_bytes")
    )
    return (
        f"device memory {held:.0f} MiB: pool {pool:.0f} MiB, weight copies {copies:.0f} MiB, "
        f"input buffers {held - pool - copies:.0f} MiB"
    )
