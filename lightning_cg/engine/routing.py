"""Routing: which graph runs one path of a sub-batch, or why it runs eagerly.

For each path of a sub-batch the :class:`Router` looks up the key its plan's
dispatcher gives, finds the key's graph in the cache or asks the capture
policy whether capturing it now pays. It only
decides: running the route is the
:class:`~lightning_cg.engine.call_runner.CallRunner`'s job. Routing reads the items'
sizes, not their tensors, so a sub-batch that runs eagerly is never gathered
(see :class:`SubBatch`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from lightning_cg.core.capture_policy import CAPTURE, NO_GAIN, CapturePolicy
from lightning_cg.core.dispatcher import BatchDescriptor, GraphMode
from lightning_cg.core.memo import StateMemo
from lightning_cg.core.stats import GraphStats
from lightning_cg.engine.cache import CapturedGraph, GraphCache, GraphKey, GraphSet
from lightning_cg.engine.call_timer import CallTimer
from lightning_cg.engine.capture import GraphCapturer, path_keys
from lightning_cg.engine.config import GraphConfig
from lightning_cg.engine.encoder import GraphableEncoder, ItemSpec
from lightning_cg.engine.plan import PathPlan, frames_fit_items


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
        paths: the path plans (shared with the capturer, which changes them on faults).
        cache: the captured graphs.
        capturer: captures keys, recovering from faults.
        policy: whether a key is worth capturing, and whether a graph is slower than eager.
        stats: counters of eager runs by reason.
        timer: CUDA-event timings the policy learns from.
        max_items: the item cap of a sub-batch (the manager updates it).
    """

    def __init__(
        self,
        config: GraphConfig,
        paths: Mapping[str, PathPlan],
        cache: GraphCache,
        capturer: GraphCapturer,
        policy: CapturePolicy,
        stats: GraphStats,
        timer: CallTimer,
        max_items: int,
    ) -> None:
        self.config = config
        self.paths = paths
        self.cache = cache
        self.capturer = capturer
        self.policy = policy
        self.stats = stats
        self.timer = timer
        self.max_items = max_items
        self._keys: StateMemo[GraphKey | None] = StateMemo()
        #: Keys whose padded graph differed from eager: served eagerly for good.
        self._eager_keys: set[GraphKey] = set()

    def serve_eagerly(self, key: GraphKey) -> None:
        """Run ``key`` eagerly from now on (its graph stays until the cache is cleared)."""
        self._eager_keys.add(key)

    def route(self, graph_set: GraphSet, path: str, sub_batch: SubBatch) -> Route:
        """How ``path`` of ``sub_batch`` runs: which graph, or eagerly and why (counted)."""
        tokens = sub_batch.tokens(path)
        total = sum(tokens)
        if total == 0:
            return Route(tokens=0)
        plan = self.paths[path]
        if self.config.mode is GraphMode.NONE or plan.eager_reason is not None:
            self.stats.misses += 1
            return Route(tokens=total)
        key = self.key(graph_set, path, sub_batch.specs, tokens)
        if key is None:
            self.stats.count_eager("above_budget")
            return Route(tokens=total)
        self.policy.sighted(key, path, key.descriptor.num_tokens, total)
        graph, reason = self._graph_for(key, sub_batch)
        if graph is None:
            self.stats.count_eager(reason)
            return Route(key=key, tokens=total)
        return Route(key=key, graph=graph, tokens=total)

    def key(
        self, graph_set: GraphSet, path: str, specs: list[ItemSpec], tokens: list[int]
    ) -> GraphKey | None:
        """The key of the graph that holds the sub-batch (its tokens and frames), or None."""
        plan = self.paths[path]
        shape = (sum(tokens), len(tokens), len(set(tokens)) == 1)
        frames = sum(spec.num_frames for spec in specs)
        # The key depends on these alone: the dispatcher object is replaced
        # whenever the plan's budgets, modes or item counts change.
        state = (plan.dispatcher, plan.max_frames, self.max_items)
        return self._keys.get(
            (graph_set, path, shape, frames),
            state,
            lambda: self._find_key(graph_set, path, plan, BatchDescriptor(*shape), frames),
        )

    def _find_key(
        self, graph_set: GraphSet, path: str, plan: PathPlan, desc: BatchDescriptor, frames: int
    ) -> GraphKey | None:
        runtime_mode, found = plan.dispatcher.dispatch(desc)
        if not self._holds_frames(plan, runtime_mode, found, frames):
            # More attention sequences than the key's graph holds (items of
            # several frames): a mixed key with as many slots, else no FULL key.
            slots = frames_fit_items(frames, plan, self.max_items)
            runtime_mode, found = plan.dispatcher.dispatch(BatchDescriptor(desc.num_tokens, slots))
            if not self._holds_frames(plan, runtime_mode, found, frames):
                runtime_mode, found = plan.dispatcher.dispatch(desc, disable_full=True)
        if runtime_mode is GraphMode.NONE or found is None:
            return None
        if frames > plan.graph_frames(runtime_mode, found, self.max_items):
            return None  # only items with more frames than max_frames_per_item
        return GraphKey(graph_set, path, runtime_mode, found)

    def _holds_frames(
        self,
        plan: PathPlan,
        runtime_mode: GraphMode,
        desc: BatchDescriptor | None,
        frames: int,
    ) -> bool:
        """False only for a FULL key whose graph has fewer sequence slots than ``frames``."""
        if runtime_mode is not GraphMode.FULL or desc is None:
            return True
        return frames <= plan.graph_frames(runtime_mode, desc, self.max_items)

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
        rekey = self.key(key.graph_set, key.path, sub_batch.specs, sub_batch.tokens(key.path))
        if rekey is not None and rekey != key and rekey not in self.cache:
            self._capture_key(rekey)
        graph = self.cache.get(rekey) if rekey is not None else None
        return graph, "" if graph is not None else "above_budget"

    def _capture_key(self, key: GraphKey) -> None:
        plan = self.paths[key.path]
        # capture="upfront" captures a path's whole ladder at its first call.
        whole_ladder = self.config.capture == "upfront"
        keys = path_keys(key.graph_set, key.path, plan) if whole_ladder else [key]
        compile_before = self.stats.compile_seconds
        seconds = self.capturer.capture(keys, self.max_items)
        # A compiled forward compiles at a path's first capture (with static
        # shapes, also at a new budget's): paid once, not by each further key.
        seconds -= self.stats.compile_seconds - compile_before
        self.policy.record_capture(key, seconds, keys=len(keys))
