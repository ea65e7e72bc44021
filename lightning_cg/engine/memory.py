"""Device memory the graphs hold, read from the CUDA caching allocator.

A graph pool keeps every segment given to it until its last graph is gone, blocks freed
during capture included, so what the graphs hold is the size of the pool's segments, not
the growth of reserved memory while capturing (``torch.cuda.graph`` empties the cache
first, so the pool's segments can replace cached blocks and reserved memory not grow).
Static input buffers are made before capture, outside the pool, and counted apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_cg.engine.cache import GraphCache

#: One segment of ``torch.cuda.memory_snapshot()``: ``address``, ``total_size``,
#: ``segment_pool_id`` (the ``torch.cuda.graph_pool_handle()`` it belongs to), ...
Segment = Mapping[str, Any]


@dataclass(frozen=True)
class GraphMemory:
    """Device bytes held by one cache's graphs, weight copies aside."""

    #: The segments of the graphs' pool: outputs and every activation of the captures.
    pool_bytes: int = 0
    #: Distinct CUDA input buffers outside the pool.
    input_bytes: int = 0


def allocator_segments() -> list[Segment]:
    """The CUDA caching allocator's segments on every device; none before CUDA is
    initialised (asking would initialise it)."""
    return torch.cuda.memory_snapshot() if torch.cuda.is_initialized() else []


def pool_segments(pool: Any, segments: Iterable[Segment]) -> list[Segment]:
    """The segments of graph pool ``pool`` (a ``torch.cuda.graph_pool_handle()``)."""
    if pool is None:
        return []
    wanted = tuple(pool)
    return [segment for segment in segments if tuple(segment["segment_pool_id"]) == wanted]


def pool_bytes(pool: Any, segments: Iterable[Segment] | None = None) -> int:
    """Bytes the segments of graph pool ``pool`` hold (``segments``: default, the
    allocator's now); 0 for no pool or without CUDA."""
    if pool is None:
        return 0
    segments = allocator_segments() if segments is None else segments
    return sum(segment["total_size"] for segment in pool_segments(pool, segments))


def bytes_outside(extents: Mapping[int, int], segments: Sequence[Segment]) -> int:
    """Bytes of the ``{address: bytes}`` extents that start in none of ``segments``."""
    spans = [
        (segment["address"], segment["address"] + segment["total_size"]) for segment in segments
    ]
    return sum(
        size
        for address, size in extents.items()
        if not any(start <= address < end for start, end in spans)
    )


def cuda_storages(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """``{address: bytes}`` of the distinct CUDA storages under ``tensors`` (graphs of one
    budget share their buffers: each counts once)."""
    storages = (tensor.untyped_storage() for tensor in tensors if tensor.is_cuda)
    return {storage.data_ptr(): storage.nbytes() for storage in storages}


def graph_memory(cache: GraphCache) -> GraphMemory:
    """What ``cache``'s graphs hold on the device now: its pool's segments and the input
    buffers outside them (all zero without CUDA)."""
    buffers = cuda_storages(buffer for graph in cache.graphs() for buffer in graph.buffers.values())
    pool = cache.pool_handle
    if pool is None and not buffers:
        return GraphMemory()
    segments = allocator_segments()
    return GraphMemory(
        pool_bytes=pool_bytes(pool, segments),
        input_bytes=bytes_outside(buffers, pool_segments(pool, segments)),
    )
