"""Routing: whether one path of a sub-batch replays a graph or runs eagerly, and why.

The call plan (:mod:`lightning_cg.engine.plan`) gives each path of a sub-batch
the key of the graph that holds it. The :class:`Router` finds the key's graph
in the cache, or asks the capture policy whether capturing it now pays. It only
decides: running the route is the
:class:`~lightning_cg.engine.call_runner.CallRunner`'s job. Routing reads the
items' sizes, not their tensors, so a sub-batch that runs eagerly is never
gathered (see :class:`SubBatch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from lightning_cg.core.capture_policy import CAPTURE, NO_GAIN, CapturePolicy
from lightning_cg.core.stats import GraphStats
from lightning_cg.engine.cache import CapturedGraph, GraphCache, GraphKey
from lightning_cg.engine.call_timer import CallTimer
from lightning_cg.engine.capture import GraphCapturer, path_keys
from lightning_cg.engine.config import GraphConfig
from lightning_cg.engine.encoder import GraphableEncoder, ItemSpec
from lightning_cg.engine.plan import PathRoute, PlanRef


class SubBatch:
    """Items of one call packed to run together: their positions in the call,
    their specs, and their inputs, gathered only when something reads them.

    Args:
        encoder: the adapter, whose ``select_items`` gathers the inputs.
        call_inputs: the inputs of the whole call.
        call_size: how many items the call holds.
        indices: the items' positions in the call.
        specs: the items' specs.
    """

    def __init__(
        self,
        encoder: GraphableEncoder,
        call_inputs: Any,
        call_size: int,
        indices: list[int],
        specs: list[ItemSpec],
    ) -> None:
        self.indices = indices
        self.specs = specs
        self._encoder = encoder
        self._call_inputs = call_inputs
        self._call_size = call_size
        self._tokens: dict[str, list[int]] = {}

    @cached_property
    def inputs(self) -> Any:
        """The adapter's inputs of these items, in sub-batch order."""
        # Every item of the call in order is the call itself: no gather (a copy).
        if self.indices == list(range(self._call_size)):
            return self._call_inputs
        return self._encoder.select_items(self._call_inputs, self.indices)

    def tokens(self, path: str) -> list[int]:
        """Each item's tokens on ``path`` (read several times per call, listed once)."""
        tokens = self._tokens.get(path)
        if tokens is None:
            tokens = self._tokens[path] = [spec.path_tokens.get(path, 0) for spec in self.specs]
        return tokens


@dataclass(frozen=True)
class Route:
    """How one path of one sub-batch runs: a graph, or eagerly.

    ``key`` is set for an eager route whose key has no graph yet, so the policy
    can learn the key's eager time.
    """

    tokens: int
    key: GraphKey | None = None
    graph: CapturedGraph | None = None

    @property
    def eager(self) -> bool:
        return self.graph is None


class Router:
    """Decides each path's route, capturing a key when the capture policy says it pays.

    Args:
        config: the graph options.
        plans: the current plan (the capturer replaces it on faults).
        cache: the captured graphs.
        capturer: captures keys, recovering from faults.
        policy: whether a key is worth capturing, and whether a graph is slower than eager.
        stats: counters of eager runs by reason.
        timer: CUDA-event timings the policy learns from.
    """

    def __init__(
        self,
        config: GraphConfig,
        plans: PlanRef,
        cache: GraphCache,
        capturer: GraphCapturer,
        policy: CapturePolicy,
        stats: GraphStats,
        timer: CallTimer,
    ) -> None:
        self.config = config
        self.plans = plans
        self.cache = cache
        self.capturer = capturer
        self.policy = policy
        self.stats = stats
        self.timer = timer
        #: Keys whose padded graph differed from eager: served eagerly for good.
        self._eager_keys: set[GraphKey] = set()

    def serve_eagerly(self, key: GraphKey) -> None:
        """Run ``key`` eagerly from now on (its graph stays until the cache is cleared)."""
        self._eager_keys.add(key)

    def route(self, planned: PathRoute, sub_batch: SubBatch) -> Route:
        """How the planned path of ``sub_batch`` runs: its graph, or eagerly and why (counted)."""
        key, total = planned.key, planned.total
        if key is None:
            if planned.reason == "misses":
                self.stats.misses += 1
            elif planned.reason:
                self.stats.count_eager(planned.reason)
            return Route(tokens=total)
        self.policy.sighted(key, key.path, key.descriptor.num_tokens, total)
        graph, reason = self._graph_for(key, sub_batch)
        if graph is None:
            self.stats.count_eager(reason)
            return Route(key=key, tokens=total)
        return Route(key=key, graph=graph, tokens=total)

    def _graph_for(self, key: GraphKey, sub_batch: SubBatch) -> tuple[CapturedGraph | None, str]:
        """The graph of ``key``, captured now if the policy says it pays; else why not."""
        if key in self._eager_keys:
            return None, "rows_interact"
        graph = self.cache.get(key)
        if graph is not None:
            if self.policy.slower_than_eager(key):
                return None, "measured_slower"
            return graph, ""
        # Timings of earlier runs that have finished; waiting for the rest would
        # stall the host behind the GPU: a key whose timing is pending waits a call.
        self.timer.collect()
        decision = self.policy.decide(key)
        if decision != CAPTURE:
            return None, "policy" if decision == NO_GAIN else "no_graph_yet"
        self._capture_key(key)
        # A fault may have changed the plan (a dropped budget, an eager path, a
        # mode without PIECEWISE keys): look again, and capture the key it gives.
        tokens = sub_batch.tokens(key.path)
        frames = sum(spec.num_frames for spec in sub_batch.specs)
        rekey = self.plans.plan.key(key.graph_set, key.path, tokens, frames)
        if rekey is not None and rekey != key and rekey not in self.cache:
            self._capture_key(rekey)
        graph = self.cache.get(rekey) if rekey is not None else None
        return graph, "" if graph is not None else "above_budget"

    def _capture_key(self, key: GraphKey) -> None:
        # capture="upfront" captures a path's whole ladder at its first call.
        if self.config.capture == "upfront":
            keys = path_keys(key.graph_set, key.path, self.plans.plan.paths[key.path])
        else:
            keys = [key]
        compile_before = self.stats.compile_seconds
        seconds = self.capturer.capture(keys)
        # A compiled forward compiles at a path's first capture (with static
        # shapes, also at a new budget's): paid once, not by each further key.
        seconds -= self.stats.compile_seconds - compile_before
        self.policy.record_capture(key, seconds, keys=len(keys))
