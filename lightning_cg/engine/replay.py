"""Replay: fill a graph's static buffers, replay, and measure a replay against eager.

Every replay rewrites every input buffer, so nothing of an earlier batch leaks in, and
clones the output's real rows, so nothing returned aliases a graph buffer.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from typing import Any

import torch

from lightning_cg.engine.cache import CapturedGraph
from lightning_cg.engine.encoder import GraphableEncoder

#: Largest relative error ||replay - eager|| / ||eager|| a checked replay may have.
CHECK_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}
#: fp32 tolerance under TF32: the padded batch gets other kernels, about 1e-3 off eager.
TF32_TOLERANCE = 5e-3


def replay(
    graph: CapturedGraph, encoder: GraphableEncoder, inputs: Any, total: int, items: int
) -> tuple[torch.Tensor, float]:
    """Copy the ``items`` items of ``inputs`` into the graph's buffers, replay, and clone
    the ``total`` real rows, contiguous; returns them and the launch's host seconds."""
    path = graph.spec.path
    graph.static_inputs.fill(encoder.replay_inputs(path, inputs), path)
    launched = time.perf_counter()
    if graph.output is not None:
        graph.cuda_graph.replay()  # directly: one frame less on every replay
        output = graph.output
    else:
        output = graph.run()
    launch_seconds = time.perf_counter() - launched
    if output.dim() == 0 or output.shape[0] < total:
        raise RuntimeError(row_count_message(encoder, path, output, total, items))
    # Contiguous: channels_last weight copies end in channels_last maps; eager's are not.
    rows = output if output.shape[0] == total else output[:total]
    return rows.clone(memory_format=torch.contiguous_format), launch_seconds


def row_count_message(
    encoder: GraphableEncoder, path: str, rows: torch.Tensor, expected: int, items: int
) -> str:
    """Why ``rows`` cannot be ``items`` items' ``expected`` rows, and what a tower must return."""
    got = "a 0-dim tensor" if rows.dim() == 0 else f"{rows.shape[0]} rows {list(rows.shape)}"
    return (
        f"the tower behind {type(encoder).__name__} returned {got} on path {path!r} "
        f"for {items} items whose item_specs promise {expected} rows. Graph replay "
        "splits outputs by their first dimension: a tower must return its items' rows "
        "along dim 0 (one row per batch row for a batch-first tower), as many as its "
        "inputs' shapes alone determine. Run this tower without the callback, or "
        "implement GraphableEncoder.item_specs to state its rows."
    )


def replay_error(replayed: torch.Tensor, reference: torch.Tensor) -> float | None:
    """:func:`relative_error` of a replay against eager's ``reference`` on the entries
    eager gives finite; infinite where the replay's shape, dtype or finite entries differ;
    None where no entry of ``reference`` is finite (nothing to judge by)."""
    if replayed.shape != reference.shape or replayed.dtype != reference.dtype:
        return math.inf
    finite = torch.isfinite(reference)
    if not finite.any():
        return None
    if not torch.equal(torch.isfinite(replayed), finite):
        return math.inf
    return relative_error(replayed[finite], reference[finite])


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64, complex parts apart (0 for two
    empty tensors)."""
    if actual.is_complex() or expected.is_complex():
        actual, expected = torch.view_as_real(actual), torch.view_as_real(expected)
    actual, expected = actual.double(), expected.double()
    denominator = expected.norm().item()
    difference = (actual - expected).norm().item()
    return difference / denominator if denominator else difference


def check_tolerance(dtype: torch.dtype) -> float:
    """The relative error a checked replay may have for outputs of ``dtype``."""
    tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32
    if dtype == torch.float32 and tf32 and torch.cuda.is_available():
        return TF32_TOLERANCE
    return CHECK_TOLERANCE.get(dtype, CHECK_TOLERANCE[torch.float32])


def autocast_key() -> tuple:
    """The autocast state a graph is captured under: ``((device, dtype), ...)``."""
    return tuple(
        (device, torch.get_autocast_dtype(device))
        for device in ("cuda", "cpu")
        if torch.is_autocast_enabled(device)
    )


@contextlib.contextmanager
def graph_context() -> Iterator[None]:
    """Where graphs are captured and replayed: without grad; outside inference mode, so
    buffers are ordinary tensors any caller may write; under autocast with its cache
    off, since a cast cached before capture would be freed while the graph reads it."""
    with torch.inference_mode(False), torch.no_grad(), contextlib.ExitStack() as stack:
        for device, dtype in autocast_key():
            stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=False))
        yield
