"""Measured dispatch: per graph set and path, a decision table timed on real items.

With ``dispatch="measured"`` a path's whole ladder is captured when its first
key is, and every graph of it is timed against eager on the first real
sub-batch (its items repeated to fill each budget, so both see the data's
sequence lengths). Sub-batches then go to a graph, to eager, or split into
smaller graphs by :class:`~lightning_cg.measured.DecisionTable`. Items whose
inputs hold NaN or infinity are not timed on: a warning names the path and the
input, and a later sub-batch measures the path.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from lightning_cg.cache import CapturedGraph, GraphCache, GraphSet
from lightning_cg.encoder import GraphableEncoder, ItemSpec
from lightning_cg.measured import (
    Decision,
    DecisionTable,
    TimingSample,
    fill_budget,
    measure_decision_table,
)

ReplayFn = Callable[[CapturedGraph, str, Any, int], torch.Tensor]
EagerFn = Callable[[str, Any], torch.Tensor]


class MeasuredDispatch:
    """Decision tables by graph set and path.

    Args:
        encoder: selects the stand-in sub-batches.
        cache: the graphs to time.
        replay: runs a graph as a hit does (copies in, replay, clone out).
        eager: runs a path eagerly as a miss does.
    """

    def __init__(
        self, encoder: GraphableEncoder, cache: GraphCache, replay: ReplayFn, eager: EagerFn
    ) -> None:
        self.encoder = encoder
        self.cache = cache
        self._replay = replay
        self._eager = eager
        self._tables: dict[tuple[GraphSet, str], DecisionTable] = {}
        self._told_needs_cuda = False
        self._told_non_finite: set[str] = set()

    def has_table(self, graph_set: GraphSet, path: str) -> bool:
        return (graph_set, path) in self._tables

    @property
    def tables(self) -> dict[tuple[GraphSet, str], DecisionTable]:
        """The decision tables by (graph set, path)."""
        return dict(self._tables)

    def set_table(self, graph_set: GraphSet, path: str, table: DecisionTable) -> None:
        """Dispatch ``path`` of ``graph_set`` by ``table`` (one measured elsewhere)."""
        self._tables[(graph_set, path)] = table

    def measure(self, graph_set: GraphSet, path: str, inputs: Any, specs: list[ItemSpec]) -> None:
        """Time each captured graph of ``path`` against eager on these real items.

        Budgets no item fits are timed on their capture buffers, graph only.
        Without real tokens (every item above every budget) eager cannot be
        timed, and on inputs with NaN or infinity nothing is (a warning says
        so); a later sub-batch measures the path.
        """
        if not self.cache.has_pool:
            self._tell_needs_cuda()
            return
        non_finite = non_finite_inputs(self.encoder, path, inputs)
        if non_finite:
            self._tell_non_finite(path, non_finite)
            return
        samples = [
            self._timing_sample(graph, path, inputs, specs)
            for _, graph in self.cache.items(graph_set, path)
        ]
        if any(sample.tokens for sample in samples):
            self._tables[(graph_set, path)] = measure_decision_table(samples)

    def decide(self, graph_set: GraphSet, path: str, tokens: list[int]) -> Decision | None:
        """The table's decision for a sub-batch of ``tokens``; None without a table."""
        table = self._tables.get((graph_set, path))
        return None if table is None else table.choose(tokens)

    def rows(self) -> list[dict[str, Any]]:
        """Per path and budget: graph and eager milliseconds."""
        return [
            {"path": path, "signature": str(graph_set.signature), **row}
            for (graph_set, path), table in self._tables.items()
            for row in table.rows()
        ]

    def drop(self, paths: list[str] | None = None) -> None:
        """Forget the tables of ``paths`` (None: all)."""
        self._tables = {
            key: table
            for key, table in self._tables.items()
            if paths is not None and key[1] not in paths
        }

    def _tell_needs_cuda(self) -> None:
        if self._told_needs_cuda:
            return
        warnings.warn(
            "dispatch='measured' times CUDA graphs, and none were captured (no CUDA): "
            "sub-batches use the graph path as with dispatch='budget'",
            RuntimeWarning,
            stacklevel=5,
        )
        self._told_needs_cuda = True

    def _tell_non_finite(self, path: str, names: list[str]) -> None:
        if path in self._told_non_finite:
            return
        warnings.warn(
            f"dispatch='measured': the items path {path!r} was to be timed on hold NaN or "
            f"infinity in their input {', '.join(names)}; they are not timed on (a later "
            "sub-batch with finite inputs measures the path). The batch is at fault, not "
            "the tower.",
            RuntimeWarning,
            stacklevel=5,
        )
        self._told_non_finite.add(path)

    def _timing_sample(
        self, graph: CapturedGraph, path: str, inputs: Any, specs: list[ItemSpec]
    ) -> TimingSample:
        spec = graph.spec
        positions = fill_budget(
            [item.path_tokens.get(path, 0) for item in specs],
            [item.num_frames for item in specs],
            spec.token_budget,
            spec.max_items,
            spec.max_frames,
        )
        if not positions:
            return TimingSample(spec.token_budget, None, replay=lambda: graph.run().clone())
        sub_inputs = self.encoder.select_items(inputs, positions)
        tokens = sum(specs[i].path_tokens[path] for i in positions)
        return TimingSample(
            spec.token_budget,
            tokens,
            replay=functools.partial(self._replay, graph, path, sub_inputs, tokens),
            # As a miss runs: the tower as it is (never compiled), in the caller's mode.
            eager=functools.partial(self._eager, path, sub_inputs),
        )


def non_finite_inputs(encoder: GraphableEncoder, path: str, inputs: Any) -> list[str]:
    """Names of the floating-point inputs of ``path`` that hold NaN or infinity.

    Reads the real rows the encoder would copy into a graph
    (:meth:`~lightning_cg.encoder.GraphableEncoder.replay_inputs`); one host sync.
    """
    return [
        name
        for name, rows in encoder.replay_inputs(path, inputs).items()
        if rows.is_floating_point() and not torch.isfinite(rows).all()
    ]
