"""The graph cache: what is captured, by :class:`GraphKey`, and the one pool they share."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_cg.core.dispatcher import BatchDescriptor
from lightning_cg.engine.encoder import CaptureSpec
from lightning_cg.engine.replay_checks import CheckSchedule
from lightning_cg.engine.static_inputs import StaticInputs


@dataclass(frozen=True)
class GraphSet:
    """The batches one set of graphs serves: adapter signature and autocast state (hash
    computed once: it is hashed on every key lookup)."""

    signature: Hashable
    autocast: tuple = ()
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.signature, self.autocast)))

    def __hash__(self) -> int:
        return self._hash


@dataclass(frozen=True)
class GraphKey:
    """Which graph serves a sub-batch on one path (hash computed once)."""

    graph_set: GraphSet
    path: str
    descriptor: BatchDescriptor
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.graph_set, self.path, self.descriptor)))

    def __hash__(self) -> int:
        return self._hash


@dataclass
class CapturedGraph:
    """Static buffers of one key and ``run``, which replays its graph (without CUDA: runs
    the graph forward eagerly) and returns the output the next run overwrites."""

    spec: CaptureSpec
    buffers: dict[str, torch.Tensor]
    run: Callable[[], torch.Tensor]
    #: The adapter's padding rule by buffer name (``zero`` for the others).
    padding_rules: Mapping[str, str]
    cuda_graph: torch.cuda.CUDAGraph | None = None
    #: The graph's static output, which each replay of ``cuda_graph`` overwrites.
    output: torch.Tensor | None = None
    #: Which of its replays are checked against eager.
    checks: CheckSchedule = field(default_factory=CheckSchedule, repr=False, compare=False)
    #: How each replay rewrites the buffers (and its pinned staging, on CUDA).
    static_inputs: StaticInputs = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.static_inputs = StaticInputs(self.buffers, self.padding_rules)


class GraphCache:
    """Captured graphs by key, and the memory pool they share."""

    def __init__(self) -> None:
        self._graphs: dict[GraphKey, CapturedGraph] = {}
        self._pool: Any = None

    def __len__(self) -> int:
        return len(self._graphs)

    def __contains__(self, key: GraphKey) -> bool:
        return key in self._graphs

    def get(self, key: GraphKey) -> CapturedGraph | None:
        """The graph of ``key``, or None."""
        return self._graphs.get(key)

    def add(self, key: GraphKey, graph: CapturedGraph) -> None:
        """Hold ``graph`` under ``key``."""
        self._graphs[key] = graph

    def items(self) -> Iterator[tuple[GraphKey, CapturedGraph]]:
        """Every key and its graph."""
        return iter(list(self._graphs.items()))

    def keys(self) -> list[GraphKey]:
        """Every key captured."""
        return list(self._graphs)

    def graphs(self) -> list[CapturedGraph]:
        """Every graph captured."""
        return list(self._graphs.values())

    @property
    def num_cuda_graphs(self) -> int:
        """CUDA graphs held (none without CUDA)."""
        return sum(graph.cuda_graph is not None for graph in self._graphs.values())

    def drop(self, paths: Sequence[str], from_budget: int = 0) -> None:
        """Forget the graphs of ``paths`` (from a budget up)."""
        self.remove(
            [
                key
                for key in self._graphs
                if key.path in paths and key.descriptor.num_tokens >= from_budget
            ]
        )

    def remove(self, keys: Sequence[GraphKey]) -> None:
        """Forget the graphs of ``keys``."""
        for key in keys:
            self._graphs.pop(key, None)
        if not self._graphs:
            # A fresh pool: nothing may capture into a pool whose last graph is gone.
            self._pool = None

    def clear(self) -> None:
        """Forget every graph and the pool."""
        self._graphs.clear()
        self._pool = None

    def pool(self) -> Any:
        """The memory pool every graph captures into (made on first use)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    @property
    def pool_handle(self) -> Any:
        """The pool's ``torch.cuda.graph_pool_handle()``, or None before the first capture."""
        return self._pool

    @property
    def has_pool(self) -> bool:
        """Whether any CUDA graph was captured into the pool."""
        return self._pool is not None

    def share_buffers(
        self, spec: CaptureSpec, buffers: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """``buffers``, each replaced by an equal-layout one of a graph of the same path,
        budget and signature (filled with the new values): graphs replay one at a time
        and fill their buffers first, so one budget's graphs can share one set."""
        wanted = (spec.path, spec.token_budget, spec.signature)
        for graph in self._graphs.values():
            if (graph.spec.path, graph.spec.token_budget, graph.spec.signature) != wanted:
                continue
            for name, buffer in buffers.items():
                shared = graph.buffers.get(name)
                if shared is not None and _layout(shared) == _layout(buffer):
                    buffers[name] = shared.copy_(buffer)
        return buffers


def _layout(tensor: torch.Tensor) -> tuple:
    return tensor.shape, tensor.stride(), tensor.dtype, tensor.device
