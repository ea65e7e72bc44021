"""EncoderGraphManager: run a tower through graphs at token budgets, eager elsewhere.

One manager wraps one :class:`~lightning_cg.encoder.GraphableEncoder`. For every
call it packs the items into sub-batches that fit the budgets, asks each path's
:class:`~lightning_cg.dispatcher.CudagraphDispatcher` for the key of the
sub-batch, and replays that key's graph or runs the path eagerly. The work is
done by parts with one job each, which this façade wires together:

- :class:`~lightning_cg.config.GraphConfig`: the validated options;
- :mod:`lightning_cg.plan`: each path's budgets and dispatcher;
- :class:`~lightning_cg.cache.GraphCache`: what is captured, by named key;
- :class:`~lightning_cg.capture_policy.CapturePolicy`: whether a key is worth
  capturing now (on demand, once its replays are expected to repay it);
- :class:`~lightning_cg.capture.GraphCapturer`: capture and fault recovery;
- :mod:`lightning_cg.replay`: fill, pad, replay, verify;
- :class:`~lightning_cg.auto_ladder.AutoLadder` and
  :class:`~lightning_cg.measured_dispatch.MeasuredDispatch`: the tuning options;
- :class:`~lightning_cg.stats.GraphStats`: counters.

Without CUDA the same path runs (static buffers, padding, graph forward or
pieces, scatter) without capture. The manager knows nothing of Lightning.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_cg.auto_ladder import AutoLadder
from lightning_cg.cache import CapturedGraph, GraphCache, GraphKey, GraphSet
from lightning_cg.call_timer import CallTimer
from lightning_cg.capture import GraphCapturer, ProgressFn, path_keys
from lightning_cg.capture_policy import CAPTURE, NO_GAIN, CapturePolicy
from lightning_cg.compiled import CompiledEncoder
from lightning_cg.config import BudgetConfig, GraphConfig
from lightning_cg.dispatcher import BatchDescriptor, GraphMode
from lightning_cg.encoder import GraphableEncoder, ItemSpec
from lightning_cg.measured_dispatch import MeasuredDispatch
from lightning_cg.packing import pack_items
from lightning_cg.plan import frames_fit_items, path_budget_choices, plan_paths
from lightning_cg.replay import autocast_key, check_replay, graph_context, replay
from lightning_cg.stats import GraphStats

__all__ = ["BudgetConfig", "EncoderGraphManager", "GraphConfig", "GraphStats"]

Rows = list[torch.Tensor | None]


class EncoderGraphManager:
    """Budget-batched CUDA graph execution of one graphable encoder.

    Args:
        encoder: the adapter around the tower.
        config: the graph options (:class:`~lightning_cg.config.GraphConfig`);
            None builds one from ``options``.
        progress: called after each capture as ``progress(done, total, spec)``.
        **options: fields of :class:`~lightning_cg.config.GraphConfig` (with
            ``budgets`` and ``paths`` as mappings or BudgetConfigs), when
            ``config`` is None.

    Example:
        >>> manager = EncoderGraphManager(PackedEncoderAdapter(tower), mode="full")
        >>> tokens = manager.execute(manager.encoder.inputs_from_call((patches, grid), {}))
    """

    def __init__(
        self,
        encoder: GraphableEncoder,
        config: GraphConfig | None = None,
        progress: ProgressFn | None = None,
        **options: Any,
    ) -> None:
        if not isinstance(encoder, GraphableEncoder):
            raise TypeError(
                "encoder must implement lightning_cg.encoder.GraphableEncoder; "
                f"got {type(encoder)!r}"
            )
        if config is not None and options:
            raise ValueError(f"pass config or options, not both; got options {sorted(options)}")
        self.config = config if config is not None else GraphConfig.from_options(**options)
        self.mode = self.config.mode
        self.stats = GraphStats()
        if self.config.compile:
            encoder = CompiledEncoder(encoder, on_compile=self._count_compile_seconds)
        self.encoder = encoder
        self.encoder_config = encoder.graph_config()
        choices = path_budget_choices(self.encoder_config, self.config)
        self.paths, self.max_items = plan_paths(encoder, self.config, choices)
        self.cache = GraphCache()
        self.capturer = GraphCapturer(
            encoder, self.config, self.paths, self.cache, self.stats, progress
        )
        self.policy = CapturePolicy(
            first_use=self.config.capture == "first_use",
            min_sightings=self.config.min_sightings,
            drop_slower_graphs=self.config.drop_slower_graphs,
        )
        self.auto_ladder = AutoLadder(
            choices,
            self.paths,
            self.max_items,
            # The user's cap, frames or uniform counts fix the item cap.
            learn_max_items=all(
                given is None
                for given in (
                    self.config.max_items_per_batch,
                    self.config.max_frames_per_batch,
                    self.config.uniform_item_counts,
                )
            ),
        )
        self.measured = MeasuredDispatch(encoder, self.cache, self._replay, self._eager_forward)
        self._timer = CallTimer()

    # ------------------------------------------------------------- public API

    @property
    def capture_error(self) -> str | None:
        """The capture error that turned every path eager (``capture_errors="eager"``)."""
        return self.capturer.capture_error

    @property
    def learned_budgets(self) -> dict[str, dict[str, Any]]:
        """Per auto path: the learned ladder, its expected padding and sample size."""
        return self.auto_ladder.learned

    def begin_run(self, expected_calls: int | None = None) -> None:
        """Start a run: zero the run counters and tell the capture policy how many
        calls to expect (None: unknown), which bounds what a capture can repay."""
        self.stats.reset_run()
        self.policy.begin_run(expected_calls)

    def reset_stats(self) -> None:
        """Zero the run counters; graph count, pool size and capture totals stay."""
        self.stats.reset_run()

    def is_captured(self) -> bool:
        """Whether any graph has been captured (or, without CUDA, prepared)."""
        return len(self.cache) > 0

    def clear(self) -> None:
        """Drop every graph, buffer and the pool; keys are captured again when they pay.

        What capture faults taught stays: budgets dropped for lack of memory are
        not tried again, and paths that cannot be captured keep running eagerly.
        """
        self.cache.clear()
        self.measured.drop()
        self.policy.forget_graphs()
        self._timer.clear()
        self.stats.graphs = 0
        self.stats.pool_bytes = 0

    def learn_budgets(self, batches: Sequence[Sequence[dict[str, int]]]) -> dict[str, list[int]]:
        """Learn the ladder of every ``auto`` path from a sample of batches.

        The manager calls this itself on its first ``auto_sample_batches``
        batches unless it was called before, e.g. with sizes a dataset gives
        without reading pixels. Graphs captured before are dropped.

        Args:
            batches: per batch, per item, the tokens on each path, as
                ``ItemSpec.path_tokens``, e.g. ``[[{"local": 256}, {"local": 1024}]]``.

        Returns:
            The learned ladder of each auto path (empty without one).
        """
        self.max_items = self.auto_ladder.learn(batches)
        self.clear()
        return self.auto_ladder.learned_ladders()

    def capture(self, signature: Hashable, paths: Sequence[str] | None = None) -> None:
        """Capture every key of ``paths`` (default: all) for one adapter signature now,
        whatever the capture policy says (e.g. to capture before a timed run)."""
        graph_set = GraphSet(signature, autocast_key())
        keys = [
            key
            for path in (paths or self.paths)
            if self.paths[path].eager_reason is None
            for key in path_keys(graph_set, path, self.paths[path])
        ]
        self.capturer.capture(keys, self.max_items)

    def decision_table(self) -> list[dict[str, Any]]:
        """Rows of the measured decision tables (``dispatch="measured"``, CUDA only)."""
        return self.measured.rows()

    # -------------------------------------------------------------- execution

    def execute(self, inputs: Any) -> Any:
        """Run the tower on ``inputs`` through graphs where they fit, eager elsewhere.

        Returns the tower's own output format with items in their original order;
        nothing returned aliases a graph buffer.
        """
        return self.encoder.postprocess(self.execute_items(inputs), inputs)

    def execute_items(self, inputs: Any) -> list[dict[str, torch.Tensor]]:
        """Like :meth:`execute`, but per item: ``{path: output rows}`` in input order.

        Paths on which an item has no tokens are absent from its dict.
        """
        specs = self.encoder.item_specs(inputs)
        self.stats.items += len(specs)
        self.stats.tokens += sum(spec.output_tokens for spec in specs)
        outputs: list[dict[str, torch.Tensor]] = [{} for _ in specs]
        everything = list(range(len(specs)))
        # Graphs hold no autograd state: a caller that needs gradients runs eagerly.
        if torch.is_grad_enabled() or self._sampling(specs):
            call = _Call(None, torch.is_inference_mode_enabled())
            self._run_sub_batch(call, inputs, everything, specs, outputs)
            return outputs
        self.policy.called()
        self._timer.collect()
        call = _Call(
            GraphSet(self.encoder.graph_signature(inputs), autocast_key()),
            torch.is_inference_mode_enabled(),
        )
        with graph_context():
            eager_items: list[int] = []
            eager_routes: list[_Route] = []
            for indices in self._pack(specs):
                # One sub-batch of every item in order needs no gather (a copy).
                sub_inputs = (
                    inputs if indices == everything else self.encoder.select_items(inputs, indices)
                )
                sub_specs = [specs[i] for i in indices]
                self.stats.sub_batches += 1
                routes = {
                    path: self._route(call, path, sub_inputs, sub_specs) for path in self.paths
                }
                if all(route.eager for route in routes.values()):
                    # Eager sub-batches run together below: one eager call, not one each.
                    eager_items += indices
                    eager_routes += routes.values()
                    continue
                for path, route in routes.items():
                    rows = self._run_route(call, route, path, sub_inputs, sub_specs)
                    _scatter(outputs, indices, path, rows)
        if eager_items:
            self._run_eager_items(call, inputs, sorted(eager_items), specs, eager_routes, outputs)
        return outputs

    def _sampling(self, specs: list[ItemSpec]) -> bool:
        """Add a batch to the auto ladder's sample; True while it runs eagerly for that."""
        if not self.auto_ladder.sampling or not specs:
            return False
        max_items = self.auto_ladder.add_batch(specs)
        if max_items is None:
            return True
        self.max_items = max_items
        self.clear()
        return False

    def _pack(self, specs: list[ItemSpec]) -> list[list[int]]:
        item_tokens = [spec.path_tokens for spec in specs]
        max_budgets = {path: plan.budgets[-1] for path, plan in self.paths.items()}
        ladders = {path: plan.ladder for path, plan in self.paths.items()}
        return pack_items(
            item_tokens, self.max_items, max_budgets, self.config.packing, budgets=ladders
        )

    def _run_sub_batch(
        self,
        call: _Call,
        sub_inputs: Any,
        indices: list[int],
        specs: list[ItemSpec],
        outputs: list[dict[str, torch.Tensor]],
    ) -> None:
        """Run every path of one sub-batch eagerly."""
        sub_specs = [specs[i] for i in indices]
        for path in self.paths:
            if any(spec.path_tokens.get(path, 0) for spec in sub_specs):
                rows = self._eager(call, path, sub_inputs, sub_specs)
                _scatter(outputs, indices, path, self._split(rows, path, sub_specs))

    def _run_eager_items(
        self,
        call: _Call,
        inputs: Any,
        indices: list[int],
        specs: list[ItemSpec],
        routes: list[_Route],
        outputs: list[dict[str, torch.Tensor]],
    ) -> None:
        """Run the items of every all-eager sub-batch in one eager call.

        Keys the policy still needs eager times of share the call's time by tokens.
        """
        everything = len(indices) == len(specs)
        sub_inputs = inputs if everything else self.encoder.select_items(inputs, indices)
        timed = [route for route in routes if route.key is not None and route.tokens]
        timed = [route for route in timed if self.policy.wants_eager_timing(route.key)]
        if not timed:
            self._run_sub_batch(call, sub_inputs, indices, specs, outputs)
            return
        total = sum(route.tokens for route in routes) or 1

        def record(seconds: float) -> None:
            for route in timed:
                self.policy.record_eager(route.key, seconds * route.tokens / total)

        with self._timer.timed(record) as timing:
            self._run_sub_batch(call, sub_inputs, indices, specs, outputs)
            timing.on_cuda = any(
                rows.is_cuda for index in indices for rows in outputs[index].values()
            )

    def _route(self, call: _Call, path: str, inputs: Any, specs: list[ItemSpec]) -> _Route:
        """How ``path`` of a sub-batch runs: which graph, or eagerly and why (counted)."""
        tokens = [spec.path_tokens.get(path, 0) for spec in specs]
        total = sum(tokens)
        if total == 0:
            return _Route(tokens=0)
        plan = self.paths[path]
        if self.mode is GraphMode.NONE or plan.eager_reason is not None:
            self.stats.misses += 1
            return _Route(tokens=total)
        key = self._key(call.graph_set, path, specs, tokens)
        if key is None:
            self.stats.count_eager("above_budget")
            return _Route(tokens=total)
        graph, reason = self._graph_for(key, call, path, inputs, specs)
        if graph is None:
            self.stats.count_eager(reason)
            return _Route(key=key, tokens=total)
        if self.config.dispatch == "measured":
            if not self.measured.has_table(call.graph_set, path):
                self.measured.measure(call.graph_set, path, inputs, specs)
            decision = self.measured.decide(call.graph_set, path, tokens)
            if decision is not None and decision.runner == "split":
                self.stats.measured_splits += 1
                return _Route(key=key, tokens=total, parts=decision.parts)
            if decision is not None and decision.runner == "eager":
                self.stats.measured_eager += 1
                self.stats.misses += 1
                return _Route(tokens=total)
        return _Route(key=key, graph=graph, tokens=total)

    def _run_route(
        self, call: _Call, route: _Route, path: str, inputs: Any, specs: list[ItemSpec]
    ) -> Rows:
        if route.parts:
            return self._run_parts(call, path, inputs, specs, route.parts)
        if route.graph is not None:
            return self._run_graph(call, route.key, route.graph, path, inputs, specs, route.tokens)
        if route.tokens == 0:
            return [None] * len(specs)
        return self._split(self._eager(call, path, inputs, specs), path, specs)

    def _key(
        self, graph_set: GraphSet, path: str, specs: list[ItemSpec], tokens: list[int]
    ) -> GraphKey | None:
        """The key of the graph that holds the sub-batch (its tokens and frames), or None."""
        plan = self.paths[path]
        desc = BatchDescriptor(sum(tokens), len(tokens), uniform=len(set(tokens)) == 1)
        frames = sum(spec.num_frames for spec in specs)
        runtime_mode, found = plan.dispatcher.dispatch(desc)
        if not self._holds_frames(path, runtime_mode, found, frames):
            # More attention sequences than the key's graph holds (items of
            # several frames): a mixed key with as many slots, else no FULL key.
            slots = frames_fit_items(frames, plan, self.max_items)
            runtime_mode, found = plan.dispatcher.dispatch(BatchDescriptor(desc.num_tokens, slots))
            if not self._holds_frames(path, runtime_mode, found, frames):
                runtime_mode, found = plan.dispatcher.dispatch(desc, disable_full=True)
        if runtime_mode is GraphMode.NONE:
            return None
        key = GraphKey(graph_set, path, runtime_mode, found)
        if frames > self._spec_frames(key):
            return None  # only items with more frames than max_frames_per_item
        return key

    def _holds_frames(
        self, path: str, runtime_mode: GraphMode, desc: BatchDescriptor | None, frames: int
    ) -> bool:
        """False only for a FULL key whose graph has fewer sequence slots than ``frames``."""
        if runtime_mode is not GraphMode.FULL:
            return True
        return frames <= self._spec_frames(GraphKey(GraphSet(None), path, runtime_mode, desc))

    def _spec_frames(self, key: GraphKey) -> int:
        plan = self.paths[key.path]
        return plan.capture_spec(
            key.path, key.mode, key.descriptor, None, self.max_items
        ).max_frames

    def _graph_for(
        self, key: GraphKey, call: _Call, path: str, inputs: Any, specs: list[ItemSpec]
    ) -> tuple[CapturedGraph | None, str]:
        """The graph of ``key``, captured now if the policy says it pays; else why not."""
        graph = self.cache.get(key)
        if graph is not None:
            if self.policy.slower_than_eager(key):
                return None, "measured_slower"
            return graph, ""
        self.policy.sighted(key, path, key.descriptor.num_tokens)
        # Timings of earlier runs that have finished; waiting for the rest would
        # stall the host behind the GPU: a key whose timing is pending waits a call.
        self._timer.collect()
        decision = self.policy.decide(key)
        if decision != CAPTURE:
            return None, "policy" if decision == NO_GAIN else "no_graph_yet"
        self._capture_key(key)
        # A fault may have changed the plan (a dropped budget, an eager path, a
        # mode without PIECEWISE keys): look again, and capture the key it gives.
        rekey = self._key(call.graph_set, path, specs, [s.path_tokens.get(path, 0) for s in specs])
        if rekey is not None and rekey != key and rekey not in self.cache:
            self._capture_key(rekey)
        graph = self.cache.get(rekey) if rekey is not None else None
        return graph, "" if graph is not None else "above_budget"

    def _capture_key(self, key: GraphKey) -> None:
        plan = self.paths[key.path]
        # Measured dispatch times a path's whole ladder, so it captures it at once.
        whole_ladder = self.config.dispatch == "measured"
        keys = path_keys(key.graph_set, key.path, plan) if whole_ladder else [key]
        seconds = self.capturer.capture(keys, self.max_items)
        self.policy.record_capture(key, seconds / max(len(keys), 1))

    def _run_graph(
        self,
        call: _Call,
        key: GraphKey,
        graph: CapturedGraph,
        path: str,
        inputs: Any,
        specs: list[ItemSpec],
        total: int,
    ) -> Rows:
        started = time.perf_counter()
        if self.policy.wants_graph_timing(key):
            with self._timer.timed(lambda seconds: self.policy.record_replay(key, seconds)) as t:
                rows = self._replay(graph, path, inputs, total)
                t.on_cuda = rows.is_cuda
        else:
            rows = self._replay(graph, path, inputs, total)
        self.stats.host_seconds += time.perf_counter() - started
        # Counted once served: a replay that raised (a bad input) is no hit.
        self.stats.hits += 1
        self.stats.piecewise_hits += graph.pieces is not None
        self.stats.real_tokens += total
        self.stats.padded_tokens += key.descriptor.num_tokens - total
        if self.config.verify and not graph.verified:
            check_replay(graph, path, rows, self._eager(call, path, inputs, specs))
        return self._split(rows, path, specs)

    def _run_parts(
        self,
        call: _Call,
        path: str,
        inputs: Any,
        specs: list[ItemSpec],
        parts: Sequence[Sequence[int]],
    ) -> Rows:
        """Run ``path`` on groups of the sub-batch's items, each as a sub-batch of its own."""
        rows: Rows = [None] * len(specs)
        for part in parts:
            part_inputs = self.encoder.select_items(inputs, part)
            part_specs = [specs[i] for i in part]
            route = self._route(call, path, part_inputs, part_specs)
            part_rows = self._run_route(call, route, path, part_inputs, part_specs)
            for index, item_rows in zip(part, part_rows, strict=True):
                rows[index] = item_rows
        return rows

    def _replay(self, graph: CapturedGraph, path: str, inputs: Any, total: int) -> torch.Tensor:
        return replay(graph, self.encoder, self.encoder_config.padding_rules, path, inputs, total)

    def _eager(self, call: _Call, path: str, inputs: Any, specs: list[ItemSpec]) -> torch.Tensor:
        rows = self._eager_forward(path, inputs, call.inference_mode)
        expected = sum(spec.path_tokens.get(path, 0) for spec in specs)
        if rows.shape[0] != expected:
            raise RuntimeError(
                f"eager_forward on path {path!r} returned {rows.shape[0]} rows; "
                f"item_specs promise {expected}"
            )
        return rows

    def _eager_forward(self, path: str, inputs: Any, inference_mode: bool = True) -> torch.Tensor:
        """The path eagerly, in the caller's inference mode (it launches faster than
        plain no_grad; graph runs leave it)."""
        with torch.inference_mode(inference_mode and not torch.is_grad_enabled()):
            return self.encoder.eager_forward(path, inputs)

    def _split(self, rows: torch.Tensor, path: str, specs: list[ItemSpec]) -> Rows:
        tokens = [spec.path_tokens.get(path, 0) for spec in specs]
        if sum(tokens) == 0:
            return [None] * len(specs)
        return [
            part if count else None for part, count in zip(rows.split(tokens), tokens, strict=True)
        ]

    def _count_compile_seconds(self, seconds: float) -> None:
        self.stats.compile_seconds += seconds


@dataclass(frozen=True)
class _Route:
    """How one path of one sub-batch runs: a graph, parts of its own, or eagerly."""

    tokens: int
    key: GraphKey | None = None
    graph: CapturedGraph | None = None
    parts: tuple[tuple[int, ...], ...] = ()

    @property
    def eager(self) -> bool:
        return self.graph is None and not self.parts


class _Call:
    """What one call carries through its sub-batches: its graph set (None runs
    everything eagerly) and whether the caller was in inference mode."""

    __slots__ = ("graph_set", "inference_mode")

    def __init__(self, graph_set: GraphSet | None, inference_mode: bool) -> None:
        self.graph_set = graph_set
        self.inference_mode = inference_mode


def _scatter(
    outputs: list[dict[str, torch.Tensor]], indices: list[int], path: str, rows: Rows
) -> None:
    """Put a sub-batch's rows of ``path`` into the per-item outputs."""
    for index, item_rows in zip(indices, rows, strict=True):
        if item_rows is not None:
            outputs[index][path] = item_rows
