"""EncoderGraphManager: run a tower through graphs at token budgets, eager elsewhere.

One manager wraps one :class:`~lightning_cg.encoder.GraphableEncoder`. For every
call it packs the items into sub-batches that fit the budgets, asks each path's
:class:`~lightning_cg.dispatcher.CudagraphDispatcher` for the key of the
sub-batch, and replays that key's graph or runs the path eagerly. The work is
done by parts with one job each, which this façade wires together and whose
lifecycle (runs, clearing, learning budgets) it keeps:

- :class:`~lightning_cg.config.GraphConfig`: the validated options;
- :mod:`lightning_cg.plan`: each path's budgets and dispatcher;
- :class:`~lightning_cg.cache.GraphCache`: what is captured, by named key;
- :class:`~lightning_cg.capture_policy.CapturePolicy`: whether a key is worth
  capturing now (on demand, once its replays are expected to repay it);
- :class:`~lightning_cg.capture.GraphCapturer`: capture and fault recovery;
- :class:`~lightning_cg.compile_policy.CompilePolicy`: with ``compile="auto"``,
  when the run is expected to repay compiling the graph forward;
- :class:`~lightning_cg.call_runner.CallRunner`: one call, sub-batch by
  sub-batch (routing by :class:`~lightning_cg.routing.Router`, replay by
  :mod:`lightning_cg.replay`: fill, pad, replay, verify);
- :class:`~lightning_cg.auto_ladder.AutoLadder` and
  :class:`~lightning_cg.measured_dispatch.MeasuredDispatch`: the tuning options;
- :class:`~lightning_cg.stats.GraphStats`: counters.

Without CUDA the same path runs (static buffers, padding, graph forward or
pieces, scatter) without capture. The manager knows nothing of Lightning.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from lightning_cg.auto_ladder import AutoLadder
from lightning_cg.cache import GraphCache, GraphSet
from lightning_cg.call_runner import CallRunner
from lightning_cg.capture import GraphCapturer, ProgressFn, path_keys
from lightning_cg.capture_policy import CapturePolicy
from lightning_cg.compile_policy import COMPILE_SECONDS_PRIOR, CompilePolicy
from lightning_cg.compiled import compiled_encoder_for
from lightning_cg.config import BudgetConfig, GraphConfig
from lightning_cg.encoder import GraphableEncoder, ItemSpec
from lightning_cg.measured_dispatch import MeasuredDispatch
from lightning_cg.outputs import CallOutputs
from lightning_cg.plan import path_budget_choices, plan_paths, use_ladders
from lightning_cg.replay import autocast_key
from lightning_cg.stats import GraphStats
from lightning_cg.weight_casts import WeightCasts, weight_casts_for

__all__ = ["BudgetConfig", "EncoderGraphManager", "GraphConfig", "GraphStats"]

logger = logging.getLogger(__name__)


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
        # Adapters that build their output from each path's rows in item order
        # skip the per-item split and join (host time per item).
        self._postprocess_joined = getattr(encoder, "postprocess_joined", None)
        compile_now = self.config.compile is True
        #: The compiling wrapper of the adapter (None when nothing may compile).
        self.compiled_encoder = compiled_encoder_for(
            encoder, self.config, self._count_compile_seconds, self._compiling_given_up
        )
        encoder = self.compiled_encoder or encoder
        #: When ``compile="auto"`` starts compiling; None when it cannot or has.
        self.compile_policy = (
            CompilePolicy(
                COMPILE_SECONDS_PRIOR[self.compiled_encoder.compiles],
                repay_runs=self.config.compile_repay_runs,
            )
            if self.compiled_encoder is not None and not compile_now
            else None
        )
        self._cuda = torch.cuda.is_available()
        #: Compiling was given up: the next call restores the uncompiled plans.
        self._uncompiled_plans_due = False
        self.encoder = encoder
        self.encoder_config = encoder.graph_config()
        choices = self._budget_choices = path_budget_choices(self.encoder_config, self.config)
        self.paths, max_items = plan_paths(encoder, self.config, choices)
        self.cache = GraphCache()
        weight_casts = weight_casts_for(encoder, self.config.cast_weights_per_run)
        self.capturer = GraphCapturer(
            encoder, self.config, self.paths, self.cache, self.stats, progress, weight_casts
        )
        self.policy = CapturePolicy(
            first_use=self.config.capture == "first_use",
            min_sightings=self.config.min_sightings,
            drop_slower_graphs=self.config.drop_slower_graphs,
        )
        self.auto_ladder = AutoLadder(
            choices,
            self.paths,
            max_items,
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
        self.runner = CallRunner(
            encoder,
            self.config,
            self.paths,
            self.cache,
            self.capturer,
            self.policy,
            self.stats,
            max_items,
            self.encoder_config.padding_rules,
        )
        if compile_now:
            self._use_compiled_plans()

    # ------------------------------------------------------------- public API

    @property
    def capture_error(self) -> str | None:
        """The capture error that turned every path eager (``capture_errors="eager"``)."""
        return self.capturer.capture_error

    @property
    def weight_casts(self) -> WeightCasts | None:
        """The low-precision weight copies graphs are captured with (None: off,
        or compiled graphs); the capturer's, refreshed at each run's start."""
        return self.capturer.weight_casts

    @property
    def max_items(self) -> int:
        """The most items of one sub-batch."""
        return self.runner.router.max_items

    @max_items.setter
    def max_items(self, max_items: int) -> None:
        self.runner.router.max_items = max_items

    @property
    def measured(self) -> MeasuredDispatch:
        """Measured dispatch's decision tables (``dispatch="measured"``)."""
        return self.runner.measured

    @property
    def learned_budgets(self) -> dict[str, dict[str, Any]]:
        """Per auto path: the learned ladder, its expected padding and sample size."""
        return self.auto_ladder.learned

    def begin_run(self, expected_calls: int | None = None, later_runs: int | None = None) -> None:
        """Start a run: zero the run counters, tell the capture policy how many
        calls to expect (None: unknown), which bounds what a capture can repay,
        tell ``compile="auto"`` how many runs like it are known to follow (a
        fit's validation runs still to come; None: unknown), and bring the
        weight copies graphs read to the tower's current weights."""
        self.stats.reset_run()
        self.policy.begin_run(expected_calls)
        if self.compile_policy is not None:
            self.compile_policy.begin_run(later_runs)
        if self.weight_casts is not None:
            # Graphs read the copies: bring them to the weights of this run.
            self.weight_casts.refresh()

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
        if self.weight_casts is not None:
            self.weight_casts.clear()
        self.runner.forget_graphs()
        self.policy.forget_graphs()
        self.stats.graphs = 0
        self.stats.pool_bytes = 0

    def start_compiling(self) -> None:
        """Capture the compiled graph forward from now on (``compile="auto"`` does
        this when a run is expected to repay it). The graphs of the uncompiled
        forward are dropped; keys are captured again, compiled, as they pay.
        Nothing happens once compiling has started, or has been given up.

        Raises:
            RuntimeError: nothing may compile (``compile=False``, or a mode
                without FULL graphs).
        """
        if self.compiled_encoder is None:
            raise RuntimeError(
                f"start_compiling needs compile=True or 'auto' and a FULL mode; got "
                f"compile={self.config.compile!r}, mode={self.mode.value!r}"
            )
        if self.compiled_encoder.started or self.compiled_encoder.compile_error is not None:
            return
        self.clear()
        self.compiled_encoder.start()
        self.compile_policy = None
        self._use_compiled_plans()

    def _use_compiled_plans(self) -> None:
        """Plan for compiled graphs: finer ladders, no weight copies (their dtype
        would make the compiled code recompile: compiled graphs cast as they
        run), fused work expected, first replays checked against eager."""
        self._use_ladders(compiled=True)
        self.capturer.weight_casts = None
        self.policy.graphs_fuse_work = True
        self.runner.on_compiled_mismatch = self._stop_compiling

    def _use_ladders(self, compiled: bool) -> None:
        """The ladders of compiled graphs (finer) or of uncompiled ones, where one
        compile serves every budget (dynamic shapes): a budget then costs its
        capture alone, and padding costs fused work on every replay. Not with
        measured dispatch, which captures and times a path's whole ladder."""
        if not (self.compiled_encoder.static_shapes or self.config.dispatch == "measured"):
            use_ladders(
                self.encoder,
                self.paths,
                self._budget_choices,
                self.config.max_items_per_batch,
                compiled,
            )

    def _stop_compiling(self, reason: str) -> None:
        """A compiled graph's output differed from eager: drop the compiled graphs
        now, and capture the adapter's own forward from now on, for good."""
        self.compiled_encoder.give_up(reason)
        self.clear()

    def _compiling_given_up(self) -> None:
        """Graphs are uncompiled from now on (a failed compile, or outputs that
        differed): nothing to check against eager, no fused work to expect. The
        uncompiled ladders and weight copies come back at the next call: a
        failed compile is met inside a capture, where plans must not change."""
        self.runner.on_compiled_mismatch = None
        self.policy.graphs_fuse_work = False
        self._uncompiled_plans_due = True

    def _back_to_uncompiled_plans(self) -> None:
        """Drop the graphs of the compiled plans; the uncompiled ladders and
        weight copies serve from now on."""
        self._uncompiled_plans_due = False
        self.clear()
        self._use_ladders(compiled=False)
        self.capturer.weight_casts = weight_casts_for(
            self.encoder, self.config.cast_weights_per_run
        )

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
        outputs = self._run_call(inputs)
        joined = outputs.joined() if self._postprocess_joined is not None else None
        if joined is not None:
            return self._postprocess_joined(joined, inputs)
        return self.encoder.postprocess(outputs.per_item(), inputs)

    def execute_items(self, inputs: Any) -> list[dict[str, torch.Tensor]]:
        """Like :meth:`execute`, but per item: ``{path: output rows}`` in input order.

        Paths on which an item has no tokens are absent from its dict.
        """
        return self._run_call(inputs).per_item()

    def _run_call(self, inputs: Any) -> CallOutputs:
        specs = self.encoder.item_specs(inputs)
        self.stats.items += len(specs)
        self.stats.tokens += sum(spec.output_tokens for spec in specs)
        # Graphs hold no autograd state: a caller that needs gradients runs eagerly.
        if torch.is_grad_enabled() or self._sampling(specs):
            return self.runner.run_eagerly(inputs, specs)
        if self._uncompiled_plans_due:
            self._back_to_uncompiled_plans()
        if self.compile_policy is not None:
            return self._run_weighing_compile(inputs, specs)
        return self.runner.run(inputs, specs)

    def _run_weighing_compile(self, inputs: Any, specs: list[ItemSpec]) -> CallOutputs:
        """A call while ``compile="auto"`` waits: some calls are timed on the GPU,
        and before a call the run's remaining calls are weighed against the compile."""
        compile_policy = self.compile_policy
        policy = self.policy
        if compile_policy.decide(
            policy.remaining_calls(), policy.run_calls(), self.stats.capture_seconds
        ):
            estimates = compile_policy.estimates()
            logger.info("compile='auto': compiling the graph forward (%s)", estimates)
            self.start_compiling()
            return self.runner.run(inputs, specs)
        # Only GPU time decides: a tower on the CPU captures no graphs to compile.
        if not (self._cuda and compile_policy.wants_call_timing()):
            return self.runner.run(inputs, specs)
        with self.runner.timer.timed(compile_policy.record_call) as timing:
            timing.on_cuda = True
            return self.runner.run(inputs, specs)

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

    def _count_compile_seconds(self, seconds: float) -> None:
        self.stats.compile_seconds += seconds
        self.stats.compile_seconds_run += seconds
