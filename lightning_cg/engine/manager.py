"""EncoderGraphManager: run a tower through graphs at token budgets, eager elsewhere.

A façade over parts with one job each (the capturer, the call runner and its router,
compiled capture, what outlives the process) that read and change one run-time state
the manager owns (:class:`~lightning_cg.engine.state.EngineState`: plan, graph cache,
capture policy, keys sent to eager, stats). Without CUDA the same path runs without
capture.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_cg.core.capture_policy import CapturePolicy
from lightning_cg.core.stats import GraphStats
from lightning_cg.engine.cache import GraphCache, GraphSet
from lightning_cg.engine.call_runner import CallRunner
from lightning_cg.engine.capture import GraphCapturer, ProgressFn, path_keys
from lightning_cg.engine.compiled import compiled_encoder_for
from lightning_cg.engine.compiling import CompileLifecycle
from lightning_cg.engine.config import BudgetConfig, GraphConfig, weight_copies
from lightning_cg.engine.encoder import GraphableEncoder, ItemSpec
from lightning_cg.engine.plan import PathPlan, path_budget_choices, plan_paths
from lightning_cg.engine.replay import autocast_key
from lightning_cg.engine.run_state import RunState, read_plan, write_plan
from lightning_cg.engine.state import EngineState
from lightning_cg.engine.weight_casts import WeightCasts, weight_casts_for

__all__ = ["BudgetConfig", "EncoderGraphManager", "GraphConfig", "GraphStats"]


class EncoderGraphManager:
    """Budget-batched CUDA graph execution of one graphable encoder.

    Args:
        config: the graph options; None builds one from ``options``
            (:meth:`GraphConfig.from_options`).
        progress: called after each capture as ``progress(done, total, spec)``.

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
                "encoder must implement lightning_cg.engine.encoder.GraphableEncoder; "
                f"got {type(encoder)!r}"
            )
        self.config = GraphConfig.from_config_or_options(config, options)
        self.mode = self.config.mode
        # Adapters that build their output from each path's rows skip the per-item split.
        self._postprocess_joined = getattr(encoder, "postprocess_joined", None)
        #: The compiling wrapper of the adapter, which the parts capture (None uncompiled).
        self.compiled_encoder = compiled_encoder_for(encoder, self.config)
        tower = getattr(encoder, "tower", None)
        #: The adapter's module, whose train mode sends calls to eager (None: it names none).
        self._tower = tower if isinstance(tower, nn.Module) else None
        encoder = self.encoder = self.compiled_encoder or encoder
        self.encoder_config = encoder.graph_config()
        choices = path_budget_choices(self.encoder_config, self.config)
        #: The run-time state every part reads and changes: plan, graphs, capture rule,
        #: keys sent to eager, stats.
        self.state = EngineState(
            plan_paths(encoder, self.config, choices),
            policy=CapturePolicy(first_use=self.config.capture in ("first_use", "upfront")),
        )
        weight_casts = weight_casts_for(encoder, weight_copies(self.config))
        self.capturer = GraphCapturer(encoder, self.config, self.state, progress, weight_casts)
        self.runner = CallRunner(encoder, self.config, self.state, self.capturer)
        #: Compiled capture's plans and how it ends (None uncompiled).
        self.compiling = None
        if self.compiled_encoder is not None:
            self.compiling = CompileLifecycle(
                self.compiled_encoder,
                self.config,
                self.state,
                choices,
                self.capturer,
                self.runner,
                self.clear,
            )
        compiled = self.compiled_encoder is not None
        #: What the capture rule learned, kept across processes (``state_dict``).
        self.run_state = RunState(
            self.state,
            self.runner.router,
            self._tower,
            self.compiled_encoder.encoder if compiled else encoder,
            compiled,
        )
        if self.config.plan is not None:
            state = read_plan(self.config.plan)
            if state is not None:
                self.load_state_dict(state, source=f"file {self.config.plan!r}")

    @property
    def stats(self) -> GraphStats:
        """The counters of every run (see :class:`~lightning_cg.core.stats.GraphStats`);
        memory is read from the allocator when a capture changed it."""
        if self.capturer.memory_stale:
            self.capturer.refresh_memory()
        return self.state.stats

    @property
    def cache(self) -> GraphCache:
        """The captured graphs, by key."""
        return self.state.cache

    @property
    def policy(self) -> CapturePolicy:
        """The capture rule and what it learned."""
        return self.state.policy

    @property
    def capture_error(self) -> str | None:
        """The capture error of unknown cause that turned every path eager, or None."""
        return self.capturer.capture_error

    @property
    def weight_casts(self) -> WeightCasts | None:
        """The low-precision weight copies graphs read (None: off, or compiled graphs)."""
        return self.capturer.weight_casts

    @property
    def paths(self) -> Mapping[str, PathPlan]:
        """Each path's current plan."""
        return self.state.plan.paths

    @property
    def max_items(self) -> int:
        """The most items of one sub-batch."""
        return self.state.plan.max_items

    def begin_run(self, expected_calls: int | None = None, later_runs: int | None = None) -> None:
        """Start a run: zero the run counters, tell the capture policy the calls to expect
        and the runs like it known to follow (None: unknown), and refresh the weight copies."""
        self.state.stats.reset_run()
        self.state.policy.begin_run(expected_calls, later_runs)
        self.run_state.begin_run()
        if self.weight_casts is not None:
            self.weight_casts.refresh()

    def is_captured(self) -> bool:
        """Whether any graph has been captured (or, without CUDA, prepared)."""
        return len(self.state.cache) > 0

    def clear(self, keep_timings: bool = False) -> None:
        """Drop every graph, buffer and the pool; keys are captured again when they pay.
        What capture faults taught (dropped budgets, eager paths) stays.

        Args:
            keep_timings: the same graphs would come back (the tower unchanged): keep what
                their replays measured, so a graph measured slower than eager stays eager.
        """
        self.state.cache.clear()
        if self.weight_casts is not None:
            self.weight_casts.clear()
        self.runner.forget_graphs()
        if not keep_timings:
            self.state.policy.forget_graphs()
            self.run_state.forget_graphs()
        self.state.stats.graphs = 0
        self.capturer.refresh_memory()

    def state_dict(self) -> dict[str, Any]:
        """What the capture rule learned, in JSON's types: per key (by a text of its graph
        set, path and budget) its sightings and measured times, the keys sent to eager and
        why, the paths capture faults changed, and what it was measured with."""
        return self.run_state.state_dict()

    def load_state_dict(self, state: Any, source: str = "the state given") -> bool:
        """Take what an earlier manager of the same tower learned (:meth:`state_dict`): a
        known key that repays its capture is captured at its first sighting; keys sent to
        eager stay eager. A state of another tower, adapter, torch or device, or one that
        cannot be read, warns once and changes nothing; returns whether it was taken."""
        return self.run_state.load_state_dict(state, source)

    def costly_captures(self) -> list[str]:
        """One line per capture of the current run that cost more than the run's eager
        tower time (the run was slower than eager by it): key, seconds, the run's eager time."""
        return [
            f"capturing the {cost.key.path!r} graph of {cost.key.descriptor.num_tokens} tokens "
            f"took {cost.seconds:.2f} s, more than the run's {cost.run_eager_seconds:.2f} s of "
            "eager tower time (kept with what the rule learned, in the checkpoint and plan: a "
            "later process captures it only where its calls repay that)"
            for cost in self.state.policy.costly_captures()
        ]

    def write_plan(self) -> None:
        """Write :meth:`state_dict` to the ``plan`` file, if the config names one."""
        if self.config.plan is not None:
            write_plan(self.config.plan, self.state_dict())

    def capture(self, signature: Hashable, paths: Sequence[str] | None = None) -> None:
        """Capture every key of ``paths`` (default: all) for one adapter signature now,
        whatever the capture policy says."""
        graph_set = GraphSet(signature, autocast_key())
        keys = [
            key
            for path in (paths or self.paths)
            if self.paths[path].eager_reason is None
            for key in path_keys(graph_set, path, self.paths[path])
        ]
        self.capturer.capture(keys)

    def execute(self, inputs: Any) -> Any:
        """Run the tower on ``inputs`` through graphs where they fit, eager elsewhere; the
        tower's own output format, items in order, aliasing no graph buffer."""
        specs = self._counted_specs(inputs)
        if (reason := self._eager_reason()) is not None:
            outputs = self.runner.run_eagerly(inputs, specs, reason)
        else:
            if self.compiling is not None:
                self.compiling.before_call()
            outputs = self.runner.run(inputs, specs)  # inline: a short call path to the replay
        joined = outputs.joined() if self._postprocess_joined is not None else None
        if joined is not None:
            return self._postprocess_joined(joined, inputs)
        return self.encoder.postprocess(outputs.per_item(), inputs)

    def execute_items(self, inputs: Any) -> list[dict[str, torch.Tensor]]:
        """Like :meth:`execute`, but per item: ``{path: output rows}`` in input order."""
        specs = self._counted_specs(inputs)
        if (reason := self._eager_reason()) is not None:
            return self.runner.run_eagerly(inputs, specs, reason).per_item()
        if self.compiling is not None:
            self.compiling.before_call()
        return self.runner.run(inputs, specs).per_item()

    def _eager_reason(self) -> str | None:
        """Why no graph may serve this call: graphs hold no autograd state, and a tower in
        train mode (dropout, batch norm over padded rows) must see exactly the caller's rows."""
        if torch.is_grad_enabled():
            return "grad_enabled"
        if self._tower is not None and self._tower.training:
            return "training"
        return None

    def _counted_specs(self, inputs: Any) -> list[ItemSpec]:
        specs = self.encoder.item_specs(inputs)
        stats = self.state.stats
        stats.items += len(specs)
        stats.tokens += sum(spec.output_tokens for spec in specs)
        return specs
