"""CallRunner: run one call of the tower, sub-batch by sub-batch.

Graphs are replayed at once; every all-eager sub-batch runs together in one eager call,
timed where the capture policy still needs eager times.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from lightning_cg.core.capture_policy import CapturePolicy
from lightning_cg.core.stats import GraphStats
from lightning_cg.engine.cache import CapturedGraph, GraphCache, GraphKey, GraphSet
from lightning_cg.engine.call_timer import CallTimer
from lightning_cg.engine.capture import GraphCapturer
from lightning_cg.engine.config import GraphConfig
from lightning_cg.engine.encoder import GraphableEncoder, ItemSpec
from lightning_cg.engine.outputs import CallOutputs
from lightning_cg.engine.plan import PlanRef
from lightning_cg.engine.replay import (
    autocast_key,
    check_tolerance,
    replay,
    replay_error,
    row_count_message,
)
from lightning_cg.engine.routing import Route, Router, SubBatch


class CallRunner:
    """Runs calls through the graphs the router picks, eager elsewhere."""

    def __init__(
        self,
        encoder: GraphableEncoder,
        config: GraphConfig,
        plans: PlanRef,
        cache: GraphCache,
        capturer: GraphCapturer,
        policy: CapturePolicy,
        stats: GraphStats,
    ) -> None:
        self.encoder = encoder
        self.plans = plans
        self.path_names = tuple(plans.plan.paths)
        self.policy = policy
        self.stats = stats
        self.timer = CallTimer()
        self.router = Router(config, plans, cache, capturer, policy, stats, self.timer)
        #: Called when a compiled graph's first replay differs from eager; None uncompiled.
        self.on_compiled_mismatch: Callable[[str], None] | None = None

    def forget_graphs(self) -> None:
        """Drop the pending timings of the graphs."""
        self.timer.clear()

    def run_eagerly(self, inputs: Any, specs: list[ItemSpec], reason: str) -> CallOutputs:
        """Every path of the whole call eagerly, as one sub-batch, counted as ``eager_{reason}``
        (a call no graph may serve: gradients enabled, or the tower in train mode)."""
        call = CallOutputs(len(specs))
        sub_batch = self._sub_batch(inputs, list(range(len(specs))), specs)
        self._run_eagerly(call, sub_batch)
        self.stats.sub_batches += 1
        for path in self.path_names:
            if any(sub_batch.tokens(path)):
                self.stats.count_eager(reason)
        return call

    def run(self, inputs: Any, specs: list[ItemSpec]) -> CallOutputs:
        """Route each sub-batch, replay its graphs, then run what is eager as one call."""
        self.policy.called()
        self.timer.collect()
        graph_set = GraphSet(self.encoder.graph_signature(inputs), autocast_key())
        call = CallOutputs(len(specs))
        eager_items: list[int] = []
        eager_routes: list[Route] = []
        for planned in self.plans.plan.call_plan(graph_set, specs):
            sub_batch = self._sub_batch(inputs, planned.indices, specs)
            self.stats.sub_batches += 1
            routes = [self.router.route(path_route, sub_batch) for path_route in planned.routes]
            if all(route.eager for route in routes):
                # Eager sub-batches run together below: one eager call, not one each.
                eager_items += planned.indices
                eager_routes += routes
                continue
            for path, route in zip(self.path_names, routes, strict=True):
                if route.graph is not None:
                    self._run_graph(call, route, path, sub_batch)
                elif route.tokens:
                    self._run_eager_path(call, route, path, sub_batch)
        if eager_items:
            eager_batch = self._sub_batch(inputs, sorted(eager_items), specs)
            self._run_eager_items(call, eager_batch, eager_routes)
        return call

    def _sub_batch(self, inputs: Any, indices: list[int], specs: list[ItemSpec]) -> SubBatch:
        return SubBatch(self.encoder, inputs, len(specs), indices, [specs[i] for i in indices])

    def _run_eagerly(self, call: CallOutputs, sub_batch: SubBatch) -> bool:
        """Run every path of one sub-batch eagerly; whether any rows are on CUDA."""
        on_cuda = False
        for path in self.path_names:
            tokens = sub_batch.tokens(path)
            if any(tokens):
                rows = self._eager(path, sub_batch)
                call.add(path, sub_batch.indices, rows, tokens)
                on_cuda = on_cuda or rows.is_cuda
        return on_cuda

    def _run_eager_items(self, call: CallOutputs, sub_batch: SubBatch, routes: list[Route]) -> None:
        """Run every all-eager sub-batch's items in one eager call; keys the policy still
        needs eager times of share its time by tokens."""
        # One sample per key and call: sub-batches of one key share this call's time.
        key_tokens: dict[GraphKey, int] = {}
        for route in routes:
            if route.key is not None and route.tokens:
                key_tokens[route.key] = key_tokens.get(route.key, 0) + route.tokens
        timed = {k: n for k, n in key_tokens.items() if self.policy.wants_eager_timing(k)}
        if not timed:
            self._run_eagerly(call, sub_batch)
            return
        total = sum(route.tokens for route in routes) or 1
        path_tokens = {path: sum(sub_batch.tokens(path)) for path in self.path_names}
        with self.timer.timed(self._eager_recorder(timed, path_tokens, total)) as timing:
            timing.on_cuda = self._run_eagerly(call, sub_batch)

    def _run_eager_path(
        self, call: CallOutputs, route: Route, path: str, sub_batch: SubBatch
    ) -> None:
        """One path of a sub-batch whose other paths replay, eagerly; timed while its key's
        eager time is still learned (else a key first seen beside a graph never captures)."""
        key, tokens = route.key, route.tokens
        if key is None or not self.policy.wants_eager_timing(key):
            rows = self._eager(path, sub_batch)
        else:
            record = self._eager_recorder({key: tokens}, {path: tokens}, tokens)
            with self.timer.timed(record) as timing:
                rows = self._eager(path, sub_batch)
                timing.on_cuda = rows.is_cuda
        call.add(path, sub_batch.indices, rows, sub_batch.tokens(path))

    def _eager_recorder(
        self, key_tokens: dict[GraphKey, int], path_tokens: dict[str, int], total: int
    ) -> Callable[[float], None]:
        """Hands an eager run's seconds to the policy, shared by tokens: per key, and per
        path for its cost line."""

        def record(seconds: float) -> None:
            for key, tokens in key_tokens.items():
                self.policy.record_eager(key, seconds * tokens / total, tokens)
            for path, tokens in path_tokens.items():
                if tokens:
                    self.policy.record_eager_call(path, tokens, seconds * tokens / total)

        return record

    def _run_graph(self, call: CallOutputs, route: Route, path: str, sub_batch: SubBatch) -> None:
        key, graph, total = route.key, route.graph, route.tokens
        items = len(sub_batch.indices)
        started = time.perf_counter()
        if self.policy.wants_graph_timing(key):
            with self.timer.timed(lambda seconds: self.policy.record_replay(key, seconds)) as t:
                rows, launch_seconds = replay(graph, self.encoder, sub_batch.inputs, total, items)
                t.on_cuda = rows.is_cuda
        else:
            rows, launch_seconds = replay(graph, self.encoder, sub_batch.inputs, total, items)
        host_seconds = time.perf_counter() - started
        padded = padding(graph, total, items)
        served = rows
        if graph.checked_padding is None or not padded <= graph.checked_padding:
            served = self._checked_against_eager(route, path, sub_batch, rows, padded)
        if served is rows:
            # Counted once served: a replay that raised or lost its check is no hit.
            self.stats.hits += 1
            self.stats.real_tokens += total
            self.stats.padded_tokens += key.descriptor.num_tokens - total
            self.stats.host_seconds += host_seconds
            self.stats.launch_seconds += launch_seconds
        call.add(path, sub_batch.indices, served, sub_batch.tokens(path))

    def _checked_against_eager(
        self,
        route: Route,
        path: str,
        sub_batch: SubBatch,
        rows: torch.Tensor,
        padded: frozenset[str],
    ) -> torch.Tensor:
        """A graph's first replay, and its first with a kind of ``padded`` not yet checked,
        against eager on the same rows; on a mismatch the eager rows serve.

        A tower whose rows interact changes its real rows when padded, one that reads a
        value fixed at capture changes them in any replay: its key runs eagerly from then
        on. A compiled graph that differs drops compiling instead.
        """
        graph = route.graph
        eager = self._eager(path, sub_batch)
        self.stats.checked_replays += 1
        self.stats.checked_tokens += route.tokens
        error = replay_error(rows, eager)
        if error is None:
            return rows  # cannot be judged on this batch: checked at the next replay
        if error <= check_tolerance(eager.dtype):
            graph.checked_padding = padded | (graph.checked_padding or frozenset())
            return rows
        spec = graph.spec
        where = f"path {path!r}, budget {spec.token_budget}"
        if self.on_compiled_mismatch is not None:
            self.stats.count_eager("compiled_mismatch")
            self.on_compiled_mismatch(
                f"the compiled graph of {where} differs from eager by relative error {error:.3e}"
            )
        else:
            self.router.serve_eagerly(route.key)
            self.stats.count_eager("replay_differs")
            tower = type(getattr(self.encoder, "tower", self.encoder)).__name__
            what = f"{route.tokens} real tokens of {len(sub_batch.indices)} items"
            message = differs_message(f"{tower}: the graph of {where}", what, error, padded)
            warnings.warn(message, stacklevel=2)
        return eager

    def _eager(self, path: str, sub_batch: SubBatch) -> torch.Tensor:
        rows = self.encoder.eager_forward(path, sub_batch.inputs)
        expected = sum(sub_batch.tokens(path))
        if rows.dim() == 0 or rows.shape[0] != expected:
            items = len(sub_batch.indices)
            raise RuntimeError(row_count_message(self.encoder, path, rows, expected, items))
        return rows


def differs_message(graph: str, what: str, error: float, padded: frozenset[str]) -> str:
    """Why ``graph`` gave ``what`` other rows than eager, and that its key runs eagerly."""
    fixed = "reads a value fixed at capture (a Python scalar, a host tensor)"
    if padded:
        why = (
            " once padded to the budget. The tower's rows likely interact (a normalisation "
            "over the batch, a scale by the batch size, attention across items): graph replay "
            "needs outputs of each item that do not depend on the other rows. Or its graph "
            f"forward {fixed}"
        )
    else:
        why = f". Its graph forward likely {fixed}"
    return (
        f"{graph} gave {what} an output that differs from eager on the same items by "
        f"relative error {error:.3e}{why}. This key runs eagerly from now on."
    )


def padding(graph: CapturedGraph, tokens: int, items: int) -> frozenset[str]:
    """What ``tokens`` real tokens of ``items`` items leave padded in ``graph``: ``tokens``
    (padding rows) and ``items`` (empty item slots). A check covers only the kinds its
    replay had: a full batch's rows say nothing of a short batch's padding rows."""
    spec = graph.spec
    return frozenset(
        kind
        for kind, padded in (
            ("tokens", tokens < spec.token_budget),
            ("items", items < spec.max_items),
        )
        if padded
    )
