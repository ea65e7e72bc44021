"""CompileLifecycle: which forward the graphs capture (``compile=True``), and its plans.

Compiled graphs get finer ladders, no weight copies, fused work expected and first
replays checked against eager; once compiling is given up the next call restores the
uncompiled plans.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from lightning_cg.engine.call_runner import CallRunner
from lightning_cg.engine.capture import GraphCapturer
from lightning_cg.engine.compiled import CompiledEncoder
from lightning_cg.engine.config import BudgetConfig, GraphConfig, weight_copies
from lightning_cg.engine.plan import use_ladders
from lightning_cg.engine.state import EngineState
from lightning_cg.engine.weight_casts import weight_casts_for


class CompileLifecycle:
    """The compiled capture of one manager (``compile=True``): its plans, and how it ends.

    Built once the parts that capture exist (they capture ``compiled``); plans
    compiled graphs from the start.

    Args:
        compiled: the compiling wrapper of the adapter, which the parts capture.
        state: the manager's state: its plan, whose ladders compiled graphs refine; its
            capture policy, told whether graphs fuse work; its stats (compile seconds).
        budget_choices: each path's budget choice, which the ladders come from.
        capturer: holds the weight copies uncompiled graphs read.
        runner: checks compiled graphs' first replays against eager.
        clear: drops every graph, buffer and the pool.
    """

    def __init__(
        self,
        compiled: CompiledEncoder,
        config: GraphConfig,
        state: EngineState,
        budget_choices: Mapping[str, BudgetConfig],
        capturer: GraphCapturer,
        runner: CallRunner,
        clear: Callable[[], None],
    ) -> None:
        self.compiled_encoder = compiled
        self.config = config
        self._state = state
        self._budget_choices = budget_choices
        self._capturer = capturer
        self._runner = runner
        self._clear = clear
        #: Compiling was given up: the next call restores the uncompiled plans.
        self._uncompiled_plans_due = False
        compiled.on_compile = self._count_compile_seconds
        compiled.on_give_up = self._compiling_given_up
        # Plan for compiled graphs (no weight copies: their dtype would recompile).
        self._use_ladders(compiled=True)
        capturer.weight_casts = None
        state.policy.graphs_fuse_work = True
        runner.on_compiled_mismatch = self._stop_compiling

    def before_call(self) -> None:
        """Bring back the uncompiled plans if compiling was given up since the last call:
        drop the compiled plans' graphs; uncompiled ladders and weight copies serve."""
        if not self._uncompiled_plans_due:
            return
        self._uncompiled_plans_due = False
        self._clear()
        self._use_ladders(compiled=False)
        self._capturer.weight_casts = weight_casts_for(
            self.compiled_encoder, weight_copies(self.config)
        )

    def _use_ladders(self, compiled: bool) -> None:
        """The ladders of compiled (finer) or uncompiled graphs, where one compile serves
        every budget (dynamic shapes)."""
        if not self.compiled_encoder.static_shapes:
            self._state.plan = use_ladders(
                self.compiled_encoder,
                self._state.plan,
                self._budget_choices,
                self.config.max_items_per_batch,
                compiled,
            )

    def _stop_compiling(self, reason: str) -> None:
        """A compiled graph differed from eager: drop the compiled graphs; uncompiled for good."""
        self.compiled_encoder.give_up(reason)
        self._clear()

    def _compiling_given_up(self) -> None:
        """Graphs are uncompiled from now on. The uncompiled plans come back at the next
        call: a failed compile is met inside a capture, where plans must not change."""
        self._runner.on_compiled_mismatch = None
        self._state.policy.graphs_fuse_work = False
        self._uncompiled_plans_due = True

    def _count_compile_seconds(self, seconds: float) -> None:
        stats = self._state.stats
        stats.compile_seconds += seconds
        stats.compile_seconds_run += seconds
