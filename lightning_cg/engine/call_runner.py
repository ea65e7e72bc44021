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
from torch import nn

from lightning_cg.engine.cache import CapturedGraph, GraphKey, GraphSet
from lightning_cg.engine.call_timer import CallTimer
from lightning_cg.engine.capture import GraphCapturer
from lightning_cg.engine.config import GraphConfig
from lightning_cg.engine.encoder import GraphableEncoder, ItemSpec
from lightning_cg.engine.outputs import CallOutputs
from lightning_cg.engine.replay import (
    autocast_key,
    check_tolerance,
    replay,
    replay_error,
    row_count_message,
)
from lightning_cg.engine.replay_checks import BufferState
from lightning_cg.engine.routing import Route, Router, SubBatch
from lightning_cg.engine.state import EngineState


class CallRunner:
    """Runs calls through the graphs the router picks, eager elsewhere."""

    def __init__(
        self,
        encoder: GraphableEncoder,
        config: GraphConfig,
        state: EngineState,
        capturer: GraphCapturer,
    ) -> None:
        self.encoder = encoder
        self.state = state
        self.path_names = tuple(state.plan.paths)
        self.timer = CallTimer()
        self.router = Router(config, state, capturer, self.timer)
        tower = getattr(encoder, "tower", None)
        #: The module whose buffers a checked replay's eager call must leave as they were.
        self._tower = tower if isinstance(tower, nn.Module) else None
        #: Called when a compiled graph's checked replay differs from eager; None uncompiled.
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
        self.state.stats.sub_batches += 1
        for path in self.path_names:
            if any(sub_batch.tokens(path)):
                self.state.stats.count_eager(reason)
        return call

    def run(self, inputs: Any, specs: list[ItemSpec]) -> CallOutputs:
        """Route each sub-batch, replay its graphs, then run what is eager as one call."""
        self.state.policy.called()
        self.timer.collect()
        graph_set = GraphSet(self.encoder.graph_signature(inputs), autocast_key())
        call = CallOutputs(len(specs))
        eager_items: list[int] = []
        eager_routes: list[Route] = []
        for planned in self.state.plan.call_plan(graph_set, specs):
            sub_batch = self._sub_batch(inputs, planned.indices, specs)
            self.state.stats.sub_batches += 1
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
        timed = {k: n for k, n in key_tokens.items() if self.state.policy.wants_eager_timing(k)}
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
        if key is None or not self.state.policy.wants_eager_timing(key):
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
                self.state.policy.record_eager(key, seconds * tokens / total, tokens)
            for path, tokens in path_tokens.items():
                if tokens:
                    self.state.policy.record_eager_call(path, tokens, seconds * tokens / total)

        return record

    def _run_graph(self, call: CallOutputs, route: Route, path: str, sub_batch: SubBatch) -> None:
        key, graph, total = route.key, route.graph, route.tokens
        items = len(sub_batch.indices)
        padded = padding(graph, total, items)
        # A checked replay starts from saved buffers and an idle GPU, to time it apart.
        saved = self._before_check() if graph.checks.due(padded) else None
        started = time.perf_counter()
        policy = self.state.policy
        if policy.wants_graph_timing(key):
            with self.timer.timed(lambda seconds: policy.record_replay(key, seconds)) as t:
                rows, launch_seconds = replay(graph, self.encoder, sub_batch.inputs, total, items)
                t.on_cuda = rows.is_cuda
        else:
            rows, launch_seconds = replay(graph, self.encoder, sub_batch.inputs, total, items)
        host_seconds = time.perf_counter() - started
        served = rows
        if saved is None:
            graph.checks.replayed()
        else:
            served = self._checked(route, path, sub_batch, padded, rows, saved, started)
        if served is rows:
            # Counted once served: a replay that raised or lost its check is no hit.
            stats = self.state.stats
            stats.hits += 1
            stats.real_tokens += total
            stats.padded_tokens += key.descriptor.num_tokens - total
            stats.host_seconds += host_seconds
            stats.launch_seconds += launch_seconds
        call.add(path, sub_batch.indices, served, sub_batch.tokens(path))

    def _before_check(self) -> BufferState:
        saved = BufferState(self._tower)
        _synchronize()
        return saved

    def _checked(
        self,
        route: Route,
        path: str,
        sub_batch: SubBatch,
        padded: frozenset[str],
        rows: torch.Tensor,
        saved: BufferState,
        started: float,
    ) -> torch.Tensor:
        """The same items run eagerly from the buffers the replay saw, and compared.

        The replayed ``rows`` serve if they match. Else the eager rows serve and the key
        runs eagerly from then on: the tower's rows interact (padded replays), its graph
        reads a value fixed at capture, or its forward changes its buffers (a second call
        would not be invisible). A compiled graph that differs ends compiling instead.
        """
        graph = route.graph
        _synchronize()
        replayed = time.perf_counter()
        saved.restore()
        eager = self._eager(path, sub_batch)
        changed = saved.changed()
        error = None if changed else replay_error(rows, eager)
        checked = time.perf_counter()
        stats = self.state.stats
        stats.checked_replays += 1
        stats.checked_tokens += route.tokens
        stats.check_seconds += checked - replayed
        if changed:
            self._serve_eagerly(route, "changes_state", changes_state_message(self._tower, changed))
            return eager
        if error is None:
            # An eager output with NaN or infinity cannot judge the graph: the next replay is.
            graph.checks.replayed()
            return rows
        if error <= check_tolerance(eager.dtype):
            graph.checks.checked(padded, replayed - started, checked - replayed)
            return rows
        where = f"path {path!r}, budget {graph.spec.token_budget}"
        if self.on_compiled_mismatch is not None:
            self.state.stats.count_eager("compiled_mismatch")
            self.on_compiled_mismatch(
                f"the compiled graph of {where} differs from eager by relative error {error:.3e}"
            )
            return eager
        what = f"{route.tokens} real tokens of {len(sub_batch.indices)} items"
        named = self._tower if self._tower is not None else self.encoder
        graph_name = f"{type(named).__name__}: the graph of {where}"
        message = differs_message(graph_name, what, error, padded)
        self._serve_eagerly(route, "replay_differs", message)
        return eager

    def _serve_eagerly(self, route: Route, reason: str, message: str) -> None:
        self.router.serve_eagerly(route.key, reason)
        self.state.stats.count_eager(reason)
        warnings.warn(message, stacklevel=3)

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


def changes_state_message(tower: nn.Module, buffers: list[str]) -> str:
    """Why a key whose forward changed ``buffers`` of ``tower`` runs eagerly."""
    names = ", ".join(buffers[:5]) + (", ..." if len(buffers) > 5 else "")
    return (
        f"{type(tower).__name__}'s forward changes its buffers ({names}): a graph's replay "
        "cannot be checked against eager without a second call, which would change them "
        "again. This key runs eagerly from now on; the buffers hold what one call left."
    )


def _synchronize() -> None:
    # A checked replay waits for the GPU anyway (the comparison reads the error); timing
    # the replay and the check apart spaces the sampled checks by what they cost.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def padding(graph: CapturedGraph, tokens: int, items: int) -> frozenset[str]:
    """What ``tokens`` real tokens of ``items`` items leave padded in ``graph``: ``tokens``
    (padding rows) and ``items`` (empty item slots). Checks count per kind of padding: a
    full batch's rows say nothing of a short batch's padding rows."""
    spec = graph.spec
    return frozenset(
        kind
        for kind, padded in (
            ("tokens", tokens < spec.token_budget),
            ("items", items < spec.max_items),
        )
        if padded
    )
