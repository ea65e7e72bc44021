"""CompileLifecycle: compiled capture (``compile=True`` or ``"auto"``), start to end.

Its one job is which forward the graphs capture, and the plans that go with it.
It wraps the adapter in the compiling wrapper (:mod:`lightning_cg.compiled`);
with ``compile="auto"`` it weighs, before each call, whether the run repays the
compile (:class:`~lightning_cg.compile_policy.CompilePolicy`); when compiling
starts it drops the uncompiled graphs and switches the parts to compiled plans
(finer ladders, no weight copies, fused work expected, first replays checked
against eager); when compiling is given up it brings the uncompiled plans back
at the next call. The manager builds it, hands it the parts whose plans it
changes (:meth:`CompileLifecycle.connect`) and asks it before each call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from lightning_cg.call_runner import CallRunner
from lightning_cg.capture import GraphCapturer
from lightning_cg.capture_policy import CapturePolicy
from lightning_cg.compile_policy import COMPILE_SECONDS_PRIOR, CompilePolicy
from lightning_cg.compiled import CompiledEncoder, compiled_encoder_for
from lightning_cg.config import BudgetConfig, GraphConfig
from lightning_cg.encoder import GraphableEncoder, ItemSpec
from lightning_cg.outputs import CallOutputs
from lightning_cg.plan import PathPlan, use_ladders
from lightning_cg.stats import GraphStats
from lightning_cg.weight_casts import weight_casts_for

logger = logging.getLogger(__name__)


class CompileLifecycle:
    """The compiled capture of one manager: the wrapper, when it starts, how it ends.

    It is built before the parts that capture, since they are built over
    :attr:`encoder` (the wrapper's callbacks land here), and handed those parts
    by :meth:`connect` once they exist.

    Args:
        encoder: the adapter around the tower.
        config: the graph options (``compile`` and ``compile_scope``, ``mode``;
            ``dispatch``, ``max_items_per_batch`` and
            ``cast_weights_per_run`` for the plans).
        stats: the counters the compile seconds are added to.
    """

    # The parts whose plans compiling changes, handed over by connect().
    _paths: Mapping[str, PathPlan]
    _budget_choices: Mapping[str, BudgetConfig]
    _capturer: GraphCapturer
    _capture_policy: CapturePolicy
    _runner: CallRunner
    _clear: Callable[[], None]

    def __init__(self, encoder: GraphableEncoder, config: GraphConfig, stats: GraphStats) -> None:
        self.config = config
        self.stats = stats
        #: The compiling wrapper of the adapter (None when nothing may compile).
        self.compiled_encoder: CompiledEncoder | None = compiled_encoder_for(
            encoder, config, self._count_compile_seconds, self._compiling_given_up
        )
        #: What the graphs run: the compiling wrapper, or the adapter itself.
        self.encoder: GraphableEncoder = self.compiled_encoder or encoder
        #: When ``compile="auto"`` starts compiling; None when it cannot or has.
        self.compile_policy = (
            CompilePolicy(COMPILE_SECONDS_PRIOR[self.compiled_encoder.compiles])
            if self.compiled_encoder is not None and config.compile is not True
            else None
        )
        self._cuda = torch.cuda.is_available()
        #: Compiling was given up: the next call restores the uncompiled plans.
        self._uncompiled_plans_due = False
        # Whether the log said once that the compile would overrun a run's allowance.
        self._told_overrun = False

    def connect(
        self,
        paths: Mapping[str, PathPlan],
        budget_choices: Mapping[str, BudgetConfig],
        capturer: GraphCapturer,
        capture_policy: CapturePolicy,
        runner: CallRunner,
        clear: Callable[[], None],
    ) -> None:
        """Hand over the parts whose plans compiling changes; with ``compile=True``,
        plan compiled graphs now. Called once, before the first call.

        Args:
            paths: the path plans, whose ladders compiled graphs refine.
            budget_choices: each path's budget choice, which the ladders come from.
            capturer: holds the weight copies uncompiled graphs read.
            capture_policy: told whether graphs fuse work; its horizon (the
                calls a graph would serve) weighs the compile.
            runner: runs the calls, and checks compiled graphs' first replays.
            clear: drops every graph, buffer and the pool (the manager's ``clear``).
        """
        self._paths = paths
        self._budget_choices = budget_choices
        self._capturer = capturer
        self._capture_policy = capture_policy
        self._runner = runner
        self._clear = clear
        if self.config.compile is True:
            self._use_compiled_plans()

    def start(self) -> None:
        """Capture the compiled graph forward from now on: drop the uncompiled graphs
        and plan compiled ones. Nothing happens once compiling has started, or has
        been given up.

        Raises:
            RuntimeError: nothing may compile (``compile=False``, or a mode
                without FULL graphs).
        """
        if self.compiled_encoder is None:
            raise RuntimeError(
                f"start_compiling needs compile=True or 'auto' and a FULL mode; got "
                f"compile={self.config.compile!r}, mode={self.config.mode.value!r}"
            )
        if self.compiled_encoder.started or self.compiled_encoder.compile_error is not None:
            return
        self._clear()
        self.compiled_encoder.start()
        self.compile_policy = None
        self._use_compiled_plans()

    def before_call(self) -> None:
        """Before a call through the graphs: bring back the uncompiled plans if
        compiling was given up since the last call."""
        if self._uncompiled_plans_due:
            self._back_to_uncompiled_plans()

    def run_weighing_compile(self, inputs: Any, specs: list[ItemSpec]) -> CallOutputs:
        """A call while ``compile="auto"`` waits: some calls are timed on the GPU,
        and before a call the calls a graph would serve (the capture policy's
        horizon), the calls known to come and the run's allowance are weighed
        against the compile."""
        compile_policy = self.compile_policy
        capture_policy = self._capture_policy
        weighed = {
            "horizon_calls": capture_policy.horizon_calls(),
            "capture_seconds": self.stats.capture_seconds,
            "committed_calls": capture_policy.committed_calls(),
            "allowance": capture_policy.run_allowance(),
        }
        if compile_policy.decide(**weighed):
            estimates = compile_policy.estimates() | weighed
            logger.info("compile='auto': compiling the graph forward (%s)", estimates)
            self.start()
            return self._runner.run(inputs, specs)
        if compile_policy.overrun_seconds is not None and not self._told_overrun:
            self._told_overrun = True
            logger.info(
                "compile='auto': not compiling: the runs repay_runs counts on would repay "
                "the compile, but this run would pay %.1f s more than its allowance for "
                "them; compile=true compiles from the first capture, for runs that repeat",
                compile_policy.overrun_seconds,
            )
        # Only GPU time decides: a tower on the CPU captures no graphs to compile.
        if not (self._cuda and compile_policy.wants_call_timing()):
            return self._runner.run(inputs, specs)
        with self._runner.timer.timed(compile_policy.record_call) as timing:
            timing.on_cuda = True
            return self._runner.run(inputs, specs)

    def _use_compiled_plans(self) -> None:
        """Plan for compiled graphs: finer ladders, no weight copies (their dtype
        would make the compiled code recompile: compiled graphs cast as they
        run), fused work expected, first replays checked against eager."""
        self._use_ladders(compiled=True)
        self._capturer.weight_casts = None
        self._capture_policy.costs.graphs_fuse_work = True
        self._runner.on_compiled_mismatch = self._stop_compiling

    def _use_ladders(self, compiled: bool) -> None:
        """The ladders of compiled graphs (finer) or of uncompiled ones, where one
        compile serves every budget (dynamic shapes): a budget then costs its
        capture alone, and padding costs fused work on every replay. Not with
        measured dispatch, which captures and times a path's whole ladder."""
        if not (self.compiled_encoder.static_shapes or self.config.dispatch == "measured"):
            use_ladders(
                self.encoder,
                self._paths,
                self._budget_choices,
                self.config.max_items_per_batch,
                compiled,
            )

    def _stop_compiling(self, reason: str) -> None:
        """A compiled graph's output differed from eager: drop the compiled graphs
        now, and capture the adapter's own forward from now on, for good."""
        self.compiled_encoder.give_up(reason)
        self._clear()

    def _compiling_given_up(self) -> None:
        """Graphs are uncompiled from now on (a failed compile, or outputs that
        differed): nothing to check against eager, no fused work to expect. The
        uncompiled ladders and weight copies come back at the next call: a
        failed compile is met inside a capture, where plans must not change."""
        self._runner.on_compiled_mismatch = None
        self._capture_policy.costs.graphs_fuse_work = False
        self._uncompiled_plans_due = True

    def _back_to_uncompiled_plans(self) -> None:
        """Drop the graphs of the compiled plans; the uncompiled ladders and
        weight copies serve from now on."""
        self._uncompiled_plans_due = False
        self._clear()
        self._use_ladders(compiled=False)
        self._capturer.weight_casts = weight_casts_for(
            self.encoder, self.config.cast_weights_per_run
        )

    def _count_compile_seconds(self, seconds: float) -> None:
        self.stats.compile_seconds += seconds
        self.stats.compile_seconds_run += seconds
