"""CompileLifecycle: compiled capture (``compile=True``), start to end.

Its one job is which forward the graphs capture, and the plans that go with it.
It wraps the adapter in the compiling wrapper (:mod:`lightning_cg.engine.compiled`)
and plans compiled graphs from the start (finer ladders, no weight copies,
fused work expected, first replays checked against eager); when compiling is
given up it brings the uncompiled plans back at the next call. The manager
builds it, hands it the parts whose plans it changes
(:meth:`CompileLifecycle.connect`) and asks it before each call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from lightning_cg.core.capture_policy import CapturePolicy
from lightning_cg.core.stats import GraphStats
from lightning_cg.engine.call_runner import CallRunner
from lightning_cg.engine.capture import GraphCapturer
from lightning_cg.engine.compiled import CompiledEncoder, compiled_encoder_for
from lightning_cg.engine.config import BudgetConfig, GraphConfig
from lightning_cg.engine.encoder import GraphableEncoder
from lightning_cg.engine.plan import PlanRef, use_ladders
from lightning_cg.engine.weight_casts import weight_casts_for


class CompileLifecycle:
    """The compiled capture of one manager: the wrapper, its plans, how it ends.

    It is built before the parts that capture, since they are built over
    :attr:`encoder` (the wrapper's callbacks land here), and handed those parts
    by :meth:`connect` once they exist.

    Args:
        encoder: the adapter around the tower.
        config: the graph options (``compile`` and ``compile_scope``, ``mode``;
            ``max_items_per_batch`` and
            ``cast_weights_per_run`` for the plans).
        stats: the counters the compile seconds are added to.
    """

    # The parts whose plans compiling changes, handed over by connect().
    _plans: PlanRef
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
        #: Compiling was given up: the next call restores the uncompiled plans.
        self._uncompiled_plans_due = False

    def connect(
        self,
        plans: PlanRef,
        budget_choices: Mapping[str, BudgetConfig],
        capturer: GraphCapturer,
        capture_policy: CapturePolicy,
        runner: CallRunner,
        clear: Callable[[], None],
    ) -> None:
        """Hand over the parts whose plans compiling changes; with ``compile=True``,
        plan compiled graphs now. Called once, before the first call.

        Args:
            plans: the current plan, whose ladders compiled graphs refine.
            budget_choices: each path's budget choice, which the ladders come from.
            capturer: holds the weight copies uncompiled graphs read.
            capture_policy: told whether graphs fuse work.
            runner: runs the calls, and checks compiled graphs' first replays.
            clear: drops every graph, buffer and the pool (the manager's ``clear``).
        """
        self._plans = plans
        self._budget_choices = budget_choices
        self._capturer = capturer
        self._capture_policy = capture_policy
        self._runner = runner
        self._clear = clear
        if self.config.compile is True:
            self._use_compiled_plans()

    def before_call(self) -> None:
        """Before a call through the graphs: bring back the uncompiled plans if
        compiling was given up since the last call."""
        if self._uncompiled_plans_due:
            self._back_to_uncompiled_plans()

    def _use_compiled_plans(self) -> None:
        """Plan for compiled graphs: finer ladders, no weight copies (their dtype
        would make the compiled code recompile: compiled graphs cast as they
        run), fused work expected, first replays checked against eager."""
        self._use_ladders(compiled=True)
        self._capturer.weight_casts = None
        self._capture_policy.graphs_fuse_work = True
        self._runner.on_compiled_mismatch = self._stop_compiling

    def _use_ladders(self, compiled: bool) -> None:
        """The ladders of compiled graphs (finer) or of uncompiled ones, where one
        compile serves every budget (dynamic shapes): a budget then costs its
        capture alone, and padding costs fused work on every replay."""
        if not self.compiled_encoder.static_shapes:
            use_ladders(
                self.encoder,
                self._plans,
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
        self._capture_policy.graphs_fuse_work = False
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
