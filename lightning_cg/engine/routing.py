"""Routing: whether one path of a sub-batch replays a graph or runs eagerly, and why.

Routing reads the items' sizes, not their tensors, so an eager sub-batch is never gathered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from lightning_cg.core.capture_policy import CAPTURE, NO_GAIN
from lightning_cg.engine.cache import CapturedGraph, GraphKey
from lightning_cg.engine.call_timer import CallTimer
from lightning_cg.engine.capture import GraphCapturer, path_keys
from lightning_cg.engine.config import GraphConfig
from lightning_cg.engine.encoder import GraphableEncoder, ItemSpec
from lightning_cg.engine.plan import PathRoute
from lightning_cg.engine.state import EngineState


class SubBatch:
    """Items of one call packed to run together: their positions in the call, their
    specs, and their inputs, gathered only when something reads them."""

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
    """How one path of one sub-batch runs: a graph, or eagerly (``key`` set when the key
    has no graph yet, so the policy can learn its eager time)."""

    tokens: int
    key: GraphKey | None = None
    graph: CapturedGraph | None = None

    @property
    def eager(self) -> bool:
        return self.graph is None


class Router:
    """Decides each path's route, capturing a key when the capture policy says it pays."""

    def __init__(
        self, config: GraphConfig, state: EngineState, capturer: GraphCapturer, timer: CallTimer
    ) -> None:
        self.config = config
        self.state = state
        self.capturer = capturer
        self.timer = timer
        #: Called with each key at its first sighting, before the policy counts it (a
        #: loaded state's records join there); None while no loaded record waits.
        self.on_first_sighting: Callable[[GraphKey], None] | None = None
        self._sighted: set[GraphKey] = set()

    def serve_eagerly(self, key: GraphKey, reason: str) -> None:
        """Run ``key`` eagerly from now on, counted as ``eager_{reason}`` (its graph stays
        until the cache is cleared)."""
        self.state.eager_keys[key] = reason

    def route(self, planned: PathRoute, sub_batch: SubBatch) -> Route:
        """How the planned path of ``sub_batch`` runs: its graph, or eagerly and why (counted)."""
        key, total = planned.key, planned.total
        stats = self.state.stats
        if key is None:
            if planned.reason == "misses":
                stats.misses += 1
            elif planned.reason:
                stats.count_eager(planned.reason)
            return Route(tokens=total)
        if self.on_first_sighting is not None and key not in self._sighted:
            self._first_sighting(key)
        self.state.policy.sighted(key, key.path, key.descriptor.num_tokens, total)
        key, graph, reason = self._graph_for(key, sub_batch)
        if graph is None:
            if reason:
                stats.count_eager(reason)
            else:
                stats.misses += 1
        return Route(key=key, graph=graph, tokens=total)

    def _graph_for(
        self, key: GraphKey, sub_batch: SubBatch
    ) -> tuple[GraphKey | None, CapturedGraph | None, str]:
        """The key that serves ``key``'s sub-batch and its graph, captured now if the policy
        says it pays; else why not ("" for a path a capture fault turned eager)."""
        state = self.state
        if (reason := state.eager_keys.get(key)) is not None:
            return key, None, reason
        graph = state.cache.get(key)
        if graph is not None:
            if state.policy.slower_than_eager(key):
                return key, None, "measured_slower"
            return key, graph, ""
        # Only finished timings: waiting for the rest would stall the host behind the GPU.
        self.timer.collect()
        decision = state.policy.decide(key)
        if decision != CAPTURE:
            return key, None, "policy" if decision == NO_GAIN else "no_graph_yet"
        self._capture_key(key)
        # A fault may have changed the plan: look again, and capture the key it gives.
        tokens = sub_batch.tokens(key.path)
        frames = sum(spec.num_frames for spec in sub_batch.specs)
        rekey = state.plan.key(key.graph_set, key.path, tokens, frames)
        if rekey is None:
            return None, None, state.plan.no_key_reason(key.path, sum(tokens))
        if rekey != key:
            # The key the new plan gives serves from now on: its sightings and times count.
            if self.on_first_sighting is not None and rekey not in self._sighted:
                self._first_sighting(rekey)
            state.policy.sighted(rekey, rekey.path, rekey.descriptor.num_tokens, sum(tokens))
            if rekey not in state.cache:
                self._capture_key(rekey)
        graph = state.cache.get(rekey)
        if graph is None:
            return rekey, None, state.plan.no_key_reason(key.path, sum(tokens))
        return rekey, graph, ""

    def _first_sighting(self, key: GraphKey) -> None:
        self._sighted.add(key)
        self.on_first_sighting(key)

    def _capture_key(self, key: GraphKey) -> None:
        state = self.state
        if self.config.capture == "upfront":
            keys = path_keys(key.graph_set, key.path, state.plan.paths[key.path])
        else:
            keys = [key]
        compile_before = state.stats.compile_seconds
        held_before = sum(k in state.cache for k in keys)
        seconds = self.capturer.capture(keys)
        # Compiling is paid once per path (or budget), not by each further key.
        seconds -= state.stats.compile_seconds - compile_before
        captured = sum(k in state.cache for k in keys) - held_before
        if captured > 0:
            # A capture that faulted teaches no capture cost.
            state.policy.record_capture(key, seconds, keys=captured)
