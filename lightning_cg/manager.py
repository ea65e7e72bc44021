"""EncoderGraphManager: capture a tower's graphs at token budgets and replay them.

One manager wraps one :class:`~lightning_cg.encoder.GraphableEncoder`. For every
call it packs the items into sub-batches that fit the budgets, asks each path's
:class:`~lightning_cg.dispatcher.CudagraphDispatcher` how to run the sub-batch,
and either replays a captured graph (copying the real rows into the static
buffers and padding the rest by the buffer's rule) or runs the path eagerly.
Outputs are cloned out of the graph buffers and put back in item order.

Graphs are captured lazily, the first time a batch with a new signature (the
adapter's signature plus the autocast dtype) arrives: every key of every path,
largest budget first, into one shared memory pool. A FULL key captures the whole
graph forward; a PIECEWISE key captures the pieces between its attention ops
(see :mod:`lightning_cg.piecewise`), and attention runs eagerly at replay.
Without CUDA the same path runs (static buffers, padding, graph forward or
pieces, scatter) without capture.

Three options trade set-up for speed: ``ladder="auto"`` learns each path's
budgets from the item sizes of the first batches (:meth:`learn_budgets`);
``dispatch="measured"`` times every graph against eager on a path's first real
items and sends a sub-batch to a graph only where the graph is faster
(:mod:`lightning_cg.measured`);
``compile=True`` captures a ``torch.compile``'d graph forward
(:mod:`lightning_cg.compiled`).

The manager knows nothing of Lightning.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import warnings
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from lightning_cg.budgets import (
    AUTO_LADDER,
    LADDERS,
    choose_budgets,
    expected_padding,
    resolve_budgets,
)
from lightning_cg.compiled import CompiledEncoder, check_compile
from lightning_cg.dispatcher import BatchDescriptor, CudagraphDispatcher, GraphMode
from lightning_cg.encoder import CaptureSpec, GraphableEncoder, ItemSpec
from lightning_cg.faults import (
    CAPTURE_FAILED,
    OUT_OF_MEMORY,
    CaptureFault,
    capture_failed,
    capturing,
    diagnose,
    free_device_memory,
)
from lightning_cg.measured import (
    Decision,
    DecisionTable,
    TimingSample,
    check_dispatch,
    fill_budget,
    measure_decision_table,
)
from lightning_cg.packing import PACKING_STRATEGIES, pack_items
from lightning_cg.piecewise import (
    DEFAULT_SPLITTING_OPS,
    PiecewiseGraph,
    PiecewiseSplit,
    PiecewiseUnsupported,
    check_piecewise_fallback,
    check_splitting_ops,
    split_graph_forward,
)

#: What a capture error without a known fallback does (``capture_errors``).
CAPTURE_ERRORS = ("raise", "eager")
#: Largest relative error ||replay - eager|| / ||eager|| that ``verify`` accepts.
VERIFY_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}
#: fp32 tolerance while TF32 is on: cuBLAS/cuDNN pick other TF32 kernels for the
#: padded batch, which differ from eager by about 1e-3.
TF32_TOLERANCE = 5e-3

log = logging.getLogger(__name__)

ProgressFn = Callable[[int, int, CaptureSpec], None]
#: The mode a path falls back to when its tower cannot be split, by fallback and mode.
_FALLBACK_MODES = {
    "eager": {
        GraphMode.PIECEWISE: GraphMode.NONE,
        GraphMode.FULL_AND_PIECEWISE: GraphMode.FULL_UNIFORM_ONLY,
    },
    "full": {GraphMode.PIECEWISE: GraphMode.FULL, GraphMode.FULL_AND_PIECEWISE: GraphMode.FULL},
}


@dataclass(frozen=True)
class BudgetConfig:
    """How one encoder path's token budgets are chosen.

    Attributes:
        min_budget: smallest budget; None takes the adapter's default.
        max_budget: largest budget; None takes the adapter's default.
        budgets: an explicit ladder; overrides min/max.
        ladder: ``pow2`` (double from min), ``geometric`` (multiply by ratio) or
            ``auto`` (learned from the item sizes of the first batches; see
            :func:`~lightning_cg.budgets.choose_budgets`).
        ratio: growth of the geometric ladder.
        align: geometric budgets are rounded up to a multiple of this, auto
            budgets to a multiple of ``gcd(align, min_budget)``.
        k: most budgets of an auto ladder.
        auto_sample_batches: an auto ladder is learned from this many first
            batches; the ones before the last run eagerly.
    """

    min_budget: int | None = None
    max_budget: int | None = None
    budgets: Sequence[int] | None = None
    ladder: str = "pow2"
    ratio: float = 1.25
    align: int = 16
    k: int = 12
    auto_sample_batches: int = 1

    def __post_init__(self) -> None:
        for name in ("min_budget", "max_budget"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None; got {value!r}")
        if None not in (self.min_budget, self.max_budget) and self.min_budget > self.max_budget:
            raise ValueError(
                f"min_budget must be <= max_budget; got min_budget={self.min_budget}, "
                f"max_budget={self.max_budget}"
            )
        if self.budgets is not None and (
            not self.budgets or any(not isinstance(b, int) or b < 1 for b in self.budgets)
        ):
            raise ValueError(
                f"budgets must be a non-empty list of positive integers; got {self.budgets!r}"
            )
        ladders = (*LADDERS, AUTO_LADDER)
        if self.ladder not in ladders:
            raise ValueError(f"ladder must be one of {', '.join(ladders)}; got {self.ladder!r}")
        for name in ("k", "auto_sample_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {name}={value!r}")
        if self.ladder == AUTO_LADDER and self.budgets is not None:
            raise ValueError(
                "budgets (an explicit ladder) and ladder='auto' exclude each other; "
                f"got budgets={self.budgets!r}"
            )


@dataclass
class GraphStats:
    """Counters of one manager, reset by :meth:`EncoderGraphManager.reset_stats`.

    A hit is one path of one sub-batch served by a graph, a miss one that ran
    eagerly; piecewise hits are the hits served by PIECEWISE pieces. Padded
    tokens are the budget rows a replay computed beyond the real ones. Graphs
    count CUDA graphs: one per FULL key, one per piece of a PIECEWISE key.
    Host seconds add up the host time of replays (metadata, copies, launch,
    clone; nothing waits for the GPU); compile seconds the first graph forwards
    of a compiled encoder. With ``dispatch="measured"``, measured eager counts
    the path runs its table sent to eager though a graph fits, measured splits
    the ones it split into smaller graphs.
    """

    hits: int = 0
    piecewise_hits: int = 0
    misses: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    graphs: int = 0
    capture_seconds: float = 0.0
    pool_bytes: int = 0
    sub_batches: int = 0
    items: int = 0
    tokens: int = 0
    host_seconds: float = 0.0
    compile_seconds: float = 0.0
    measured_eager: int = 0
    measured_splits: int = 0

    @property
    def hit_rate(self) -> float:
        runs = self.hits + self.misses
        return self.hits / runs if runs else 0.0

    @property
    def padding_waste(self) -> float:
        """Padded tokens per real token served by graphs."""
        return self.padded_tokens / self.real_tokens if self.real_tokens else 0.0

    @property
    def host_us_per_replay(self) -> float:
        """Host microseconds of one graph replay, on average."""
        return 1e6 * self.host_seconds / self.hits if self.hits else 0.0

    def rates(self) -> dict[str, float]:
        """The stats derived from the counters (recomputed, not summed, over ranks)."""
        return {
            "hit_rate": self.hit_rate,
            "padding_waste": self.padding_waste,
            "host_us_per_replay": self.host_us_per_replay,
        }

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), **self.rates()}


@dataclass
class _Graph:
    """Static buffers of one key and how to run the tower on them.

    ``run`` replays the FULL graph or the PIECEWISE pieces (without CUDA, runs
    the graph forward or the pieces eagerly) on the buffers and returns the
    output, which the next run overwrites.
    """

    spec: CaptureSpec
    buffers: dict[str, torch.Tensor]
    run: Callable[[], torch.Tensor]
    cuda_graph: torch.cuda.CUDAGraph | None = None
    pieces: PiecewiseGraph | None = None
    verified: bool = False


@dataclass
class _PathPlan:
    """Resolved budgets and dispatcher of one encoder path."""

    budgets: list[int]
    dispatcher: CudagraphDispatcher
    allow_zero_tokens: bool
    item_frames: int
    max_frames: int = 0
    ladder: list[int] = field(default_factory=list)
    #: Why the path runs eagerly whatever the mode (a capture fault), else None.
    eager_reason: str | None = None


class EncoderGraphManager:
    """Budget-batched CUDA graph execution of one graphable encoder.

    Args:
        encoder: the adapter around the tower.
        mode: a :class:`GraphMode` or its lower-case name.
        budgets: budget choice for every path (see :class:`BudgetConfig`).
        path_budgets: per-path overrides of ``budgets``, by path name.
        max_items: most items in one sub-batch; None derives it from the budgets,
            and an ``auto`` ladder then lowers it to the most items a sampled
            sub-batch held (rounded up to a power of two).
        max_frames_per_batch: attention sequences a graph holds; None is
            ``max_items * max_frames_per_item``. Larger sub-batches skip FULL.
        packing: ``next_fit`` or ``min_padding``.
        uniform_item_counts: item counts of the exact uniform keys; None is a
            power-of-two ladder up to ``max_items``.
        verify: compare the first replay of every graph with eager and raise on
            a mismatch beyond :data:`VERIFY_TOLERANCE`.
        progress: called after each capture as ``progress(done, total, spec)``.
        splitting_ops: ops PIECEWISE graphs split the tower at, as
            ``namespace::name``; None is
            :data:`~lightning_cg.piecewise.DEFAULT_SPLITTING_OPS`.
        piecewise_fallback: when a path cannot be split: ``error`` raises
            :class:`~lightning_cg.piecewise.PiecewiseUnsupported` at capture;
            ``eager`` runs its PIECEWISE batches eagerly; ``full`` serves them
            with FULL graphs. Either fallback warns with the reason.
        dispatch: ``budget`` replays the smallest fitting budget's graph;
            ``measured`` times each graph and eager on a path's first real
            items (repeated to fill each budget) and runs a sub-batch in a
            graph only where that is faster, else eagerly or
            split into smaller graphs (needs CUDA; without it, ``budget``).
        compile: capture ``torch.compile(graph_forward, dynamic=True)``
            (:class:`~lightning_cg.compiled.CompiledEncoder`); not with
            PIECEWISE modes.
        capture_errors: what a capture error that is neither out of memory nor
            a known uncapturable op does: ``raise`` it, or ``eager``: warn and
            run every path eagerly from then on (:attr:`capture_error` says
            why), the call that captured included.

    Example:
        >>> manager = EncoderGraphManager(PackedEncoderAdapter(tower), mode="full")
        >>> tokens = manager.execute(manager.encoder.inputs_from_call((patches, grid), {}))
    """

    def __init__(
        self,
        encoder: GraphableEncoder,
        mode: GraphMode | str = GraphMode.FULL,
        budgets: BudgetConfig | None = None,
        path_budgets: Mapping[str, BudgetConfig] | None = None,
        max_items: int | None = None,
        max_frames_per_batch: int | None = None,
        packing: str = "next_fit",
        uniform_item_counts: Sequence[int] | None = None,
        verify: bool = False,
        progress: ProgressFn | None = None,
        splitting_ops: Sequence[str] | None = None,
        piecewise_fallback: str = "error",
        dispatch: str = "budget",
        compile: bool = False,
        capture_errors: str = "raise",
    ) -> None:
        if not isinstance(encoder, GraphableEncoder):
            raise TypeError(
                "encoder must implement lightning_cg.encoder.GraphableEncoder; "
                f"got {type(encoder)!r}"
            )
        if packing not in PACKING_STRATEGIES:
            raise ValueError(
                f"packing must be one of {', '.join(PACKING_STRATEGIES)}; got {packing!r}"
            )
        if max_frames_per_batch is not None and max_frames_per_batch < 1:
            raise ValueError(
                f"max_frames_per_batch must be >= 1 or None; got {max_frames_per_batch}"
            )
        self.mode = GraphMode.parse(mode)
        if check_compile(compile, self.mode):
            encoder = CompiledEncoder(encoder, on_compile=self._count_compile_seconds)
        self.encoder = encoder
        self.dispatch = check_dispatch(dispatch)
        self.splitting_ops = check_splitting_ops(
            DEFAULT_SPLITTING_OPS if splitting_ops is None else splitting_ops
        )
        self.piecewise_fallback = check_piecewise_fallback(piecewise_fallback)
        if capture_errors not in CAPTURE_ERRORS:
            raise ValueError(
                f"capture_errors must be one of {', '.join(CAPTURE_ERRORS)}; got {capture_errors!r}"
            )
        self.capture_errors = capture_errors
        #: The capture error that turned every path eager (``capture_errors="eager"``).
        self.capture_error: str | None = None
        self.config = encoder.graph_config()
        self.packing = packing
        self.verify = verify
        self.progress = progress
        self.stats = GraphStats()
        self._budget_configs = self._check_path_budgets(budgets or BudgetConfig(), path_budgets)
        self.max_items = self._resolve_max_items(max_items)
        # An auto ladder may lower the item cap to what its sample packs, unless
        # the user set the cap, the frames or the uniform counts.
        self._max_items_limit = self.max_items
        self._learn_max_items = all(
            given is None for given in (max_items, max_frames_per_batch, uniform_item_counts)
        )
        self.paths = self._plan_paths(max_items, uniform_item_counts, max_frames_per_batch)
        self._graphs: dict[tuple[Hashable, str, GraphMode, BatchDescriptor], _Graph] = {}
        self._graph_sets: set[Hashable] = set()
        self._pool: Any = None
        #: Measured decision tables by graph set and path (``dispatch="measured"``).
        self._tables: dict[tuple[Hashable, str], DecisionTable] = {}
        self._told_measured_needs_cuda = False
        #: Whether the current call came in under inference mode; eager runs
        #: return to it (it launches faster than plain no_grad).
        self._caller_inference_mode = False
        #: Per auto path, the learned ladder, its expected padding and sample size.
        self.learned_budgets: dict[str, dict[str, Any]] = {}
        # The (min, max) budgets of each auto path, and the item tokens of the
        # first batches until its ladder is learned.
        self._auto_ranges = {
            path: (self.paths[path].budgets[0], self.paths[path].budgets[-1])
            for path, choice in self._budget_configs.items()
            if choice.ladder == AUTO_LADDER
        }
        self._budget_sample: list[list[Mapping[str, int]]] | None = (
            [] if self._auto_ranges else None
        )

    # ------------------------------------------------------------------ setup

    def _check_path_budgets(
        self, budgets: BudgetConfig, path_budgets: Mapping[str, BudgetConfig] | None
    ) -> dict[str, BudgetConfig]:
        overrides = dict(path_budgets or {})
        unknown = sorted(set(overrides) - set(self.config.paths))
        if unknown:
            raise ValueError(
                f"path_budgets names unknown path(s) {unknown}; "
                f"allowed: {', '.join(self.config.paths)}"
            )
        return {path: overrides.get(path, budgets) for path in self.config.paths}

    def _resolve_path(self, path: str, max_items: int | None) -> tuple[list[int], int]:
        choice = self._budget_configs[path]
        default_min, default_max = self.encoder.token_budget_range(path)
        min_budget = choice.min_budget if choice.min_budget is not None else default_min
        max_budget = choice.max_budget if choice.max_budget is not None else default_max
        if choice.min_budget is None and choice.max_budget is not None:
            min_budget = min(min_budget, max_budget)
        return resolve_budgets(
            min_budget,
            max_budget,
            list(choice.budgets) if choice.budgets is not None else None,
            max_items,
            # An auto ladder is pow2 until learn_budgets replaces it.
            ladder="pow2" if choice.ladder == AUTO_LADDER else choice.ladder,
            ratio=choice.ratio,
            align=choice.align,
        )

    def _resolve_max_items(self, max_items: int | None) -> int:
        # One sub-batch crosses every path, so the tightest path sets the count.
        return min(self._resolve_path(path, max_items)[1] for path in self.config.paths)

    def _plan_paths(
        self,
        user_max_items: int | None,
        uniform_item_counts: Sequence[int] | None,
        max_frames_per_batch: int | None,
    ) -> dict[str, _PathPlan]:
        counts = list(uniform_item_counts or _pow2_counts(self.max_items))
        frames_per_item = self.config.max_frames_per_item
        max_frames = max_frames_per_batch or self.max_items * frames_per_item
        slot_counts = _slot_counts(self.max_items, max_frames, frames_per_item)
        plans = {}
        for path, path_config in self.config.paths.items():
            # The user's max_items, not the resolved one: that would start
            # every ladder at max_items (the seed's 'only max_items' branch).
            budgets, _ = self._resolve_path(path, user_max_items)
            plans[path] = _PathPlan(
                budgets=budgets,
                dispatcher=CudagraphDispatcher(
                    self.mode,
                    budgets,
                    counts,
                    mixed_item_counts=slot_counts if path_config.per_item_metadata else (),
                ),
                allow_zero_tokens=path_config.allow_zero_tokens,
                item_frames=frames_per_item,
                max_frames=max_frames,
                # Zero is a budget of its own for optional paths: it is never captured.
                ladder=([0] if path_config.allow_zero_tokens else []) + budgets,
            )
        return plans

    # ---------------------------------------------------------------- capture

    def capture(self, signature: Hashable, paths: Sequence[str] | None = None) -> None:
        """Capture every key of ``paths`` (default: all) for one adapter signature.

        Graphs are keyed by the signature and the current autocast dtype, and
        captured largest budget first into the manager's one memory pool. A path
        is captured once per signature; calls for captured paths do nothing.

        A capture that runs out of memory frees the graphs this call captured,
        drops the failing budget and the larger ones of its path, and retries
        with the budgets left (none left: the path runs eagerly). A path whose
        tower a graph cannot hold (a host sync, a CPU op, a data-dependent
        shape; see :mod:`lightning_cg.faults`) runs eagerly. Either warns once,
        naming the path, the budget or the cause, and the fix.

        Raises:
            PiecewiseUnsupported: a path with PIECEWISE keys cannot be split and
                ``piecewise_fallback`` is ``error``.
            Exception: any other error of the capture, as raised.
        """
        if self._budget_sample is not None:
            return  # captured at the learned budgets, once execute has learned them
        graph_set = (signature, _autocast_key())
        todo = [path for path in (paths or self.paths) if (graph_set, path) not in self._graph_sets]
        if not todo:
            return
        started = time.perf_counter()
        reserved_before = _reserved_bytes()
        with _graph_context():
            self._capture_paths(graph_set, signature, todo)
        if self._pool is not None:
            torch.cuda.synchronize()
        self.stats.capture_seconds += time.perf_counter() - started
        self.stats.pool_bytes += max(0, _reserved_bytes() - reserved_before)
        self._graph_sets.update((graph_set, path) for path in todo)

    def _capture_paths(self, graph_set: Hashable, signature: Hashable, paths: list[str]) -> None:
        """Capture ``paths``, giving up the budgets and paths a capture fault rules out."""
        out_of_memory: dict[str, list[int]] = {}
        while True:
            try:
                failure = self._capture_keys(graph_set, signature, paths)
            except PiecewiseUnsupported as error:
                self._fall_back(paths, error)
                continue
            if failure is None:
                break
            # Out of the except clause: the error's frames, which hold the failed
            # graph and its buffers, are gone before the memory is freed.
            spec, fault = failure
            self._drop_graphs(paths, graph_set=graph_set)
            if fault.kind == CAPTURE_FAILED:
                self._stop_capturing(fault)
                free_device_memory()
                break
            if fault.kind == OUT_OF_MEMORY:
                out_of_memory.setdefault(spec.path, []).append(spec.token_budget)
                self._drop_budgets(spec.path, spec.token_budget)
            else:
                self._run_eagerly(spec.path, fault)
            free_device_memory()
        for path, budgets in out_of_memory.items():
            self._warn_out_of_memory(path, budgets)

    def _capture_keys(
        self, graph_set: Hashable, signature: Hashable, paths: list[str]
    ) -> tuple[CaptureSpec, CaptureFault] | None:
        """Capture the keys of ``paths`` that have no graph yet.

        Returns:
            None, or the key that failed with a fault :func:`diagnose` knows,
            with the fault; the keys before it stay captured.
        """
        specs = [
            (runtime_mode, desc, spec)
            for runtime_mode, desc, spec in self._capture_specs(signature, paths)
            if (graph_set, spec.path, runtime_mode, desc) not in self._graphs
        ]
        for done, (runtime_mode, desc, spec) in enumerate(specs, start=1):
            try:
                graph = self._capture_one(runtime_mode, spec)
            except Exception as error:
                fault = diagnose(error)
                if isinstance(error, PiecewiseUnsupported) and (
                    fault is None or fault.kind != OUT_OF_MEMORY
                ):
                    raise  # piecewise_fallback decides
                if fault is None:
                    if self.capture_errors == "raise":
                        raise
                    fault = capture_failed(error)
                return spec, fault
            self._graphs[(graph_set, spec.path, runtime_mode, desc)] = graph
            if self.progress is not None:
                self.progress(done, len(specs), spec)
        return None

    def _drop_graphs(
        self, paths: Sequence[str], graph_set: Hashable | None = None, from_budget: int = 0
    ) -> None:
        """Forget the graphs of ``paths`` (of one graph set, from a budget up) and their tables."""

        def matches(owner: Hashable, path: str) -> bool:
            return path in paths and (graph_set is None or owner == graph_set)

        for key in [key for key in self._graphs if matches(*key[:2])]:
            if key[3].num_tokens >= from_budget:
                graph = self._graphs.pop(key)
                self.stats.graphs -= (
                    graph.pieces.num_graphs if graph.pieces else int(graph.cuda_graph is not None)
                )
        self._tables = {key: table for key, table in self._tables.items() if not matches(*key)}
        if not self._graphs:
            # A fresh pool: nothing may capture into a pool whose last graph is gone.
            self._pool = None

    def _drop_budgets(self, path: str, failed_budget: int) -> None:
        """Keep the budgets of ``path`` below ``failed_budget``; with none, run it eagerly."""
        plan = self.paths[path]
        kept = [budget for budget in plan.budgets if budget < failed_budget]
        if not kept:
            plan.eager_reason = f"out of memory at its smallest token budget {failed_budget}"
        else:
            plan.budgets = kept
            plan.ladder = ([0] if plan.allow_zero_tokens else []) + kept
            plan.dispatcher = plan.dispatcher.replace(budgets=kept)
        # Graphs of other signatures at the dropped budgets are of no use any more.
        self._drop_graphs([path], from_budget=0 if plan.eager_reason else failed_budget)

    def _run_eagerly(self, path: str, fault: CaptureFault) -> None:
        self.paths[path].eager_reason = str(fault)
        self._drop_graphs([path])
        warnings.warn(
            f"EncoderGraphManager: capturing path {path!r} failed: {fault.cause} "
            f"({fault.error}). Fix: {fault.fix}. Path {path!r} runs eagerly.",
            RuntimeWarning,
            stacklevel=4,
        )

    def _stop_capturing(self, fault: CaptureFault) -> None:
        """Every path eager from now on, after an error no fallback is known for."""
        self.capture_error = str(fault)
        for plan in self.paths.values():
            plan.eager_reason = self.capture_error
        self._drop_graphs(list(self.paths))
        warnings.warn(
            f"EncoderGraphManager: capturing graphs failed: {fault.error}; every path runs "
            "eagerly from now on (capture_errors='eager').",
            RuntimeWarning,
            stacklevel=4,
        )

    def _warn_out_of_memory(self, path: str, budgets: list[int]) -> None:
        plan = self.paths[path]
        if plan.eager_reason is not None:
            outcome = f"path {path!r} runs eagerly"
        else:
            outcome = (
                f"path {path!r} keeps budgets {plan.budgets}: larger sub-batches are split "
                f"and items above {plan.budgets[-1]} tokens run eagerly"
            )
        failed = ", then ".join(str(budget) for budget in budgets)
        warnings.warn(
            f"EncoderGraphManager: out of memory capturing path {path!r} at token budget "
            f"{failed}; freed the graphs of that capture; {outcome}. To keep the larger "
            "budgets, free device memory or lower max_budget / max_items_per_batch.",
            RuntimeWarning,
            stacklevel=4,
        )

    def _capture_specs(
        self, signature: Hashable, paths: Sequence[str]
    ) -> list[tuple[GraphMode, BatchDescriptor, CaptureSpec]]:
        specs = []
        for path in paths:
            plan = self.paths[path]
            if plan.eager_reason is not None:
                continue
            for runtime_mode, desc in plan.dispatcher.capture_descriptors():
                items = desc.num_items or self.max_items
                if runtime_mode is GraphMode.PIECEWISE:
                    # Attention runs eagerly, so the metadata may hold every frame a
                    # sub-batch can have, whatever limit FULL graphs keep to.
                    frames = max(plan.max_frames, items * plan.item_frames)
                elif desc.uniform:
                    frames = items * plan.item_frames
                elif desc.num_items is None or items >= min(desc.num_tokens, self.max_items):
                    # One graph for any item count, or a budget's most items.
                    frames = plan.max_frames
                else:
                    # A mixed key of fewer items: as many sequence slots as they need.
                    frames = min(items * plan.item_frames, plan.max_frames)
                spec = CaptureSpec(path, desc.num_tokens, items, frames, signature)
                specs.append((runtime_mode, desc, spec))
        # Largest first so smaller graphs reuse the pool blocks of larger ones.
        specs.sort(key=lambda triple: -triple[2].token_budget)
        return specs

    def _capture_one(self, runtime_mode: GraphMode, spec: CaptureSpec) -> _Graph:
        buffers = self._share_buffers(spec, self.encoder.capture_inputs(spec))
        pool = self._graph_pool() if _on_cuda(buffers) else None
        if runtime_mode is GraphMode.PIECEWISE:
            pieces = PiecewiseGraph(self._split_tower(spec.path, buffers), buffers, pool)
            self.stats.graphs += pieces.num_graphs
            return _Graph(spec, buffers, run=pieces.run, pieces=pieces)
        if pool is None:
            run = functools.partial(self.encoder.graph_forward, spec.path, buffers)
            return _Graph(spec, buffers, run=run)
        cuda_graph, output = self._record(spec.path, buffers)
        self.stats.graphs += 1
        return _Graph(spec, buffers, run=_replayer(cuda_graph, output), cuda_graph=cuda_graph)

    def _share_buffers(
        self, spec: CaptureSpec, buffers: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """``buffers``, each replaced by an equal-shaped one of a captured graph of
        the same path, budget and signature (filled with the new capture values).

        Graphs replay one at a time and every replay fills its buffers first,
        so the graphs of one budget (one per item count) need one set of input
        buffers, not one each.
        """
        for graph in self._graphs.values():
            other = graph.spec
            if (other.path, other.token_budget, other.signature) != (
                spec.path,
                spec.token_budget,
                spec.signature,
            ):
                continue
            for name, buffer in buffers.items():
                shared = graph.buffers.get(name)
                if shared is not None and _same_layout(shared, buffer):
                    buffers[name] = shared.copy_(buffer)
        return buffers

    def _count_compile_seconds(self, seconds: float) -> None:
        self.stats.compile_seconds += seconds

    def _split_tower(self, path: str, buffers: dict[str, torch.Tensor]) -> PiecewiseSplit:
        return split_graph_forward(
            functools.partial(self.encoder.graph_forward, path),
            buffers,
            self.splitting_ops,
            name=f"{type(self.encoder).__name__}.graph_forward on path {path!r}",
        )

    def _fall_back(self, paths: Sequence[str], error: PiecewiseUnsupported) -> None:
        """Give ``paths`` a mode without PIECEWISE keys, or raise ``error``."""
        if self.piecewise_fallback == "error":
            raise error
        mode = _FALLBACK_MODES[self.piecewise_fallback][self.mode]
        warnings.warn(
            f"{error}; paths {list(paths)} fall back to mode {mode.value!r} "
            f"(piecewise_fallback={self.piecewise_fallback!r})",
            RuntimeWarning,
            stacklevel=2,
        )
        for path in paths:
            plan = self.paths[path]
            plan.dispatcher = plan.dispatcher.replace(mode=mode)
        # Graph sets of other signatures recapture what the new mode needs.
        self._graph_sets = {key for key in self._graph_sets if key[1] not in paths}
        self._graphs = {
            key: graph
            for key, graph in self._graphs.items()
            if key[1] not in paths or key[2] is not GraphMode.PIECEWISE
        }

    def _graph_pool(self) -> Any:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def _record(
        self, path: str, buffers: dict[str, torch.Tensor]
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm up on a side stream so lazy initialisation (cuBLAS handles,
        # autotuning) stays out of the graph.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.encoder.graph_forward(path, buffers)
        torch.cuda.current_stream().wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        with capturing(), torch.cuda.graph(cuda_graph, pool=self._graph_pool()):
            output = self.encoder.graph_forward(path, buffers)
        return cuda_graph, output

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
        if torch.is_grad_enabled():
            # Graphs hold no autograd state: a caller that needs gradients runs eagerly.
            self._run_sub_batch(None, inputs, list(range(len(specs))), specs, outputs)
            return outputs
        signature = self.encoder.graph_signature(inputs)
        self._caller_inference_mode = torch.is_inference_mode_enabled()
        if self._sampling_budgets(specs):
            self._run_sub_batch(None, inputs, list(range(len(specs))), specs, outputs)
            return outputs
        with _graph_context():
            everything = list(range(len(specs)))
            for indices in self._pack(specs):
                # One sub-batch of every item in order needs no gather (a copy).
                sub_inputs = (
                    inputs if indices == everything else self.encoder.select_items(inputs, indices)
                )
                self.stats.sub_batches += 1
                self._run_sub_batch(signature, sub_inputs, indices, specs, outputs)
        return outputs

    def _run_sub_batch(
        self,
        signature: Hashable | None,
        sub_inputs: Any,
        indices: list[int],
        specs: list[ItemSpec],
        outputs: list[dict[str, torch.Tensor]],
    ) -> None:
        """Run every path of one sub-batch; ``signature`` None forces eager."""
        sub_specs = [specs[i] for i in indices]
        for path in self.paths:
            if signature is None:
                rows = self._split(self._eager(path, sub_inputs, sub_specs), path, sub_specs)
            else:
                rows = self._run_path(path, signature, sub_inputs, sub_specs)
            for index, item_rows in zip(indices, rows, strict=True):
                if item_rows is not None:
                    outputs[index][path] = item_rows

    def _pack(self, specs: list[ItemSpec]) -> list[list[int]]:
        item_tokens = [spec.path_tokens for spec in specs]
        max_budgets = {path: plan.budgets[-1] for path, plan in self.paths.items()}
        ladders = {path: plan.ladder for path, plan in self.paths.items()}
        return pack_items(item_tokens, self.max_items, max_budgets, self.packing, budgets=ladders)

    def _run_path(
        self, path: str, signature: Hashable, inputs: Any, specs: list[ItemSpec]
    ) -> list[torch.Tensor | None]:
        tokens = [spec.path_tokens.get(path, 0) for spec in specs]
        total = sum(tokens)
        if total == 0:
            return [None] * len(specs)
        if self.mode is not GraphMode.NONE:
            # Captured at a path's first use: an optional path that never has
            # tokens (a global view that is off) costs no graphs.
            self.capture(signature, [path])
        graph_set = (signature, _autocast_key())
        if self._needs_table(graph_set, path):
            self._measure(graph_set, path, inputs, specs)
        decision = self._decide(graph_set, path, tokens)
        if decision is not None and decision.runner == "split":
            self.stats.measured_splits += 1
            return self._run_parts(path, signature, inputs, specs, decision.parts)
        graph, key = self._lookup(path, graph_set, specs, tokens)
        if graph is not None and decision is not None and decision.runner == "eager":
            self.stats.measured_eager += 1
            graph = None
        if graph is None:
            rows = self._eager(path, inputs, specs)
            self.stats.misses += 1
            return self._split(rows, path, specs)
        started = time.perf_counter()
        rows = self._replay(graph, path, inputs, total)
        self.stats.host_seconds += time.perf_counter() - started
        # Counted once served: a replay that raised (a bad input) is no hit.
        self.stats.hits += 1
        self.stats.piecewise_hits += graph.pieces is not None
        self.stats.real_tokens += total
        self.stats.padded_tokens += key.num_tokens - total
        if self.verify and not graph.verified:
            self._verify(graph, path, inputs, specs, rows)
        return self._split(rows, path, specs)

    def _lookup(
        self, path: str, graph_set: Hashable, specs: list[ItemSpec], tokens: list[int]
    ) -> tuple[_Graph | None, BatchDescriptor | None]:
        plan = self.paths[path]
        if plan.eager_reason is not None:
            return None, None
        desc = BatchDescriptor(sum(tokens), len(tokens), uniform=len(set(tokens)) == 1)
        frames = sum(spec.num_frames for spec in specs)
        runtime_mode, key = plan.dispatcher.dispatch(desc)
        if not self._holds_frames(graph_set, path, runtime_mode, key, frames):
            # More attention sequences than the graph's metadata holds (items of
            # several frames): a mixed key with as many slots, else no FULL graph.
            slots = min(-(-frames // plan.item_frames), self.max_items)
            runtime_mode, key = plan.dispatcher.dispatch(BatchDescriptor(desc.num_tokens, slots))
            if not self._holds_frames(graph_set, path, runtime_mode, key, frames):
                runtime_mode, key = plan.dispatcher.dispatch(desc, disable_full=True)
        if runtime_mode is GraphMode.NONE:
            return None, None
        graph = self._captured(graph_set, path, runtime_mode, key)
        if frames > graph.spec.max_frames:
            # Only items with more frames than max_frames_per_item get here.
            return None, None
        return graph, key

    def _holds_frames(
        self,
        graph_set: Hashable,
        path: str,
        runtime_mode: GraphMode,
        key: BatchDescriptor | None,
        frames: int,
    ) -> bool:
        """False only for a FULL graph with fewer sequence slots than ``frames``."""
        if runtime_mode is not GraphMode.FULL:
            return True
        return frames <= self._captured(graph_set, path, runtime_mode, key).spec.max_frames

    def _captured(
        self, graph_set: Hashable, path: str, runtime_mode: GraphMode, key: BatchDescriptor
    ) -> _Graph:
        graph = self._graphs.get((graph_set, path, runtime_mode, key))
        if graph is None:
            raise RuntimeError(
                f"no captured graph for {runtime_mode.name} key {key} on path {path!r}"
            )
        return graph

    def _replay(self, graph: _Graph, path: str, inputs: Any, total: int) -> torch.Tensor:
        """Copy ``inputs`` into the graph's buffers, replay, and clone the real rows."""
        real = self.encoder.replay_inputs(path, inputs)
        missing = sorted(set(graph.buffers) - set(real))
        if missing:
            raise RuntimeError(f"replay_inputs for path {path!r} lacks buffer(s) {missing}")
        for name, buffer in graph.buffers.items():
            self._fill(name, buffer, real[name])
        # Clone: the next replay overwrites the graph's output buffer.
        return graph.run()[:total].clone()

    def _fill(self, name: str, buffer: torch.Tensor, rows: torch.Tensor) -> None:
        count = rows.shape[0]
        if rows.shape[1:] != buffer.shape[1:] or count > buffer.shape[0]:
            raise RuntimeError(
                f"buffer {name!r} holds {tuple(buffer.shape)}; replay rows {tuple(rows.shape)} "
                "do not fit (the adapter's capture_inputs and replay_inputs disagree)"
            )
        from_host = rows.device.type == "cpu" and buffer.device.type != "cpu"
        if rows.dtype != buffer.dtype or (rows.device != buffer.device and not from_host):
            raise RuntimeError(
                f"buffer {name!r} is {buffer.dtype} on {buffer.device}; replay rows are "
                f"{rows.dtype} on {rows.device}; the graph signature should have separated them"
            )
        rule = self.config.padding_rules.get(name, "zero")
        if from_host:
            # Host metadata: padded where it is, in pinned memory, then one copy
            # that does not wait for the GPU, instead of a copy and a padding kernel.
            buffer.copy_(
                _padded(rows, buffer.shape[0], rule, pin=buffer.is_cuda), non_blocking=True
            )
            return
        buffer[:count].copy_(rows, non_blocking=True)
        if count == buffer.shape[0]:
            return
        if rule == "repeat_last" and count > 0:
            buffer[count:].copy_(rows[-1:].expand_as(buffer[count:]), non_blocking=True)
        else:
            buffer[count:].zero_()

    def _eager(self, path: str, inputs: Any, specs: list[ItemSpec]) -> torch.Tensor:
        rows = self._eager_forward(path, inputs)
        expected = sum(spec.path_tokens.get(path, 0) for spec in specs)
        if rows.shape[0] != expected:
            raise RuntimeError(
                f"eager_forward on path {path!r} returned {rows.shape[0]} rows; "
                f"item_specs promise {expected}"
            )
        return rows

    def _eager_forward(self, path: str, inputs: Any) -> torch.Tensor:
        """The path eagerly, in the caller's inference mode (graph runs leave it)."""
        with torch.inference_mode(self._caller_inference_mode):
            return self.encoder.eager_forward(path, inputs)

    def _split(
        self, rows: torch.Tensor, path: str, specs: list[ItemSpec]
    ) -> list[torch.Tensor | None]:
        tokens = [spec.path_tokens.get(path, 0) for spec in specs]
        if sum(tokens) == 0:
            return [None] * len(specs)
        return [
            part if count else None for part, count in zip(rows.split(tokens), tokens, strict=True)
        ]

    def _verify(
        self, graph: _Graph, path: str, inputs: Any, specs: list[ItemSpec], rows: torch.Tensor
    ) -> None:
        reference = self._eager(path, inputs, specs)
        error = relative_error(rows, reference)
        tolerance = verify_tolerance(reference.dtype)
        if not error <= tolerance:
            spec = graph.spec
            raise RuntimeError(
                f"graph replay differs from eager on path {path!r}, budget {spec.token_budget}, "
                f"max_items {spec.max_items}: relative error {error:.3e} > {tolerance:.0e}. "
                "The tower reads something at capture time that changes between calls "
                "(a Python scalar, a host tensor, a data-dependent shape)."
            )
        graph.verified = True

    # ------------------------------------------ learned budgets, measured dispatch

    def learn_budgets(self, batches: Sequence[Sequence[Mapping[str, int]]]) -> dict[str, list[int]]:
        """Learn the ladder of every ``auto`` path from a sample of batches.

        The batches are packed as :meth:`execute` packs them (``next_fit`` at the
        largest budgets), and each auto path gets the ``k`` budgets that pad the
        sub-batches least (:func:`~lightning_cg.budgets.choose_budgets`); graphs
        captured before are dropped. The manager calls this itself on its first
        ``auto_sample_batches`` batches unless it was called before, e.g. with
        sizes a dataset gives without reading pixels.

        Args:
            batches: per batch, per item, the tokens on each path, as
                ``ItemSpec.path_tokens``, e.g. ``[[{"local": 256}, {"local": 1024}]]``.

        Returns:
            The learned ladder of each auto path (empty without one).
        """
        self._budget_sample = None
        if not self._auto_ranges:
            return {}
        max_budgets = {path: plan.budgets[-1] for path, plan in self.paths.items()}
        sums: dict[str, list[int]] = {path: [] for path in self._auto_ranges}
        most_items = 0
        for batch in batches:
            for sub_batch in pack_items(batch, self._max_items_limit, max_budgets):
                most_items = max(most_items, len(sub_batch))
                for path, path_sums in sums.items():
                    path_sums.append(sum(batch[i].get(path, 0) for i in sub_batch))
        if self._learn_max_items and most_items:
            self._cap_items(min(self._max_items_limit, _next_pow2(most_items)))
        for path, (min_budget, max_budget) in self._auto_ranges.items():
            choice, plan = self._budget_configs[path], self.paths[path]
            budgets = choose_budgets(sums[path], choice.k, min_budget, max_budget, choice.align)
            plan.budgets = budgets
            plan.ladder = ([0] if plan.allow_zero_tokens else []) + budgets
            plan.dispatcher = plan.dispatcher.replace(budgets=budgets)
            padding = expected_padding(sums[path], budgets)
            self.learned_budgets[path] = {
                "budgets": budgets,
                "expected_padding": padding,
                "sampled_sub_batches": len(sums[path]),
                "max_items": self.max_items,
            }
            log.info(
                "auto budgets of path %r: %s, expected padding %.1f%% on %d sampled sub-batches",
                path,
                budgets,
                100 * padding,
                len(sums[path]),
            )
        self.clear()
        return {path: self.paths[path].budgets for path in self._auto_ranges}

    def _cap_items(self, max_items: int) -> None:
        """Hold at most ``max_items`` items in a sub-batch, and their frames in a FULL graph.

        A FULL graph's attention is launched for every sequence slot it holds,
        empty or not (on an H200, 64 slots instead of 8 made packed_vit_small
        about 9% slower on four mixed images), so the cap follows the sample;
        larger batches pack into more sub-batches.
        """
        self.max_items = max_items
        counts = _pow2_counts(max_items)
        for plan in self.paths.values():
            plan.max_frames = max_items * plan.item_frames
            slot_counts = _slot_counts(max_items, plan.max_frames, plan.item_frames)
            plan.dispatcher = plan.dispatcher.replace(
                uniform_item_counts=counts,
                mixed_item_counts=slot_counts if plan.dispatcher.mixed_item_counts else (),
            )
        log.info("sub-batches hold at most %d item(s), as many as the sample needs", max_items)

    def _sampling_budgets(self, specs: list[ItemSpec]) -> bool:
        """Add a batch to the auto ladder's sample; True while it runs eagerly for that."""
        if self._budget_sample is None or not specs:
            return False
        self._budget_sample.append([spec.path_tokens for spec in specs])
        wanted = max(self._budget_configs[path].auto_sample_batches for path in self._auto_ranges)
        if len(self._budget_sample) < wanted:
            return True
        self.learn_budgets(self._budget_sample)
        return False

    def decision_table(self) -> list[dict[str, Any]]:
        """Rows of the measured decision tables: per path and budget, graph and eager ms.

        Empty unless ``dispatch="measured"`` has timed graphs (CUDA only).
        """
        return [
            {"path": path, "signature": str(graph_set[0]), **row}
            for (graph_set, path), table in self._tables.items()
            for row in table.rows()
        ]

    def _needs_table(self, graph_set: Hashable, path: str) -> bool:
        return (
            self.dispatch == "measured"
            and self.mode is not GraphMode.NONE
            and self.paths[path].eager_reason is None
            and (graph_set, path) not in self._tables
        )

    def _measure(self, graph_set: Hashable, path: str, inputs: Any, specs: list[ItemSpec]) -> None:
        """Time each graph of ``path`` against eager on sub-batches of these real items.

        Each budget is timed on the items repeated until they fill it, so both
        runners see the data's sequence lengths and host work. Budgets no item
        fits are timed on their capture buffers, graph only.
        """
        if self._pool is None:
            if not self._told_measured_needs_cuda:
                warnings.warn(
                    "dispatch='measured' times CUDA graphs, and none were captured (no CUDA): "
                    "sub-batches use the graph path as with dispatch='budget'",
                    RuntimeWarning,
                    stacklevel=4,
                )
                self._told_measured_needs_cuda = True
            return
        samples = [
            self._timing_sample(graph, path, inputs, specs)
            for (owner, graph_path, _, _), graph in self._graphs.items()
            if owner == graph_set and graph_path == path
        ]
        # Without real tokens (every item above every budget) eager cannot be
        # timed; a later sub-batch measures the path.
        if any(sample.tokens for sample in samples):
            self._tables[(graph_set, path)] = measure_decision_table(samples)

    def _timing_sample(
        self, graph: _Graph, path: str, inputs: Any, specs: list[ItemSpec]
    ) -> TimingSample:
        spec = graph.spec
        positions = fill_budget(
            [item.path_tokens.get(path, 0) for item in specs],
            [item.num_frames for item in specs],
            spec.token_budget,
            spec.max_items,
            spec.max_frames,
        )
        if not positions:
            return TimingSample(spec.token_budget, None, replay=lambda: graph.run().clone())
        sub_inputs = self.encoder.select_items(inputs, positions)
        tokens = sum(specs[i].path_tokens[path] for i in positions)
        return TimingSample(
            spec.token_budget,
            tokens,
            replay=functools.partial(self._replay, graph, path, sub_inputs, tokens),
            # As a miss runs: the tower as it is (never compiled), in the caller's mode.
            eager=functools.partial(self._eager_forward, path, sub_inputs),
        )

    def _decide(self, graph_set: Hashable, path: str, tokens: list[int]) -> Decision | None:
        table = self._tables.get((graph_set, path))
        return None if table is None else table.choose(tokens)

    def _run_parts(
        self,
        path: str,
        signature: Hashable,
        inputs: Any,
        specs: list[ItemSpec],
        parts: Sequence[Sequence[int]],
    ) -> list[torch.Tensor | None]:
        """Run ``path`` on groups of the sub-batch's items, each as a sub-batch of its own."""
        rows: list[torch.Tensor | None] = [None] * len(specs)
        for part in parts:
            part_inputs = self.encoder.select_items(inputs, part)
            part_rows = self._run_path(path, signature, part_inputs, [specs[i] for i in part])
            for index, item_rows in zip(part, part_rows, strict=True):
                rows[index] = item_rows
        return rows

    # ------------------------------------------------------------- lifecycle

    def is_captured(self) -> bool:
        """Whether any graph set has been captured (or, without CUDA, prepared)."""
        return bool(self._graph_sets)

    def clear(self) -> None:
        """Drop every graph, buffer and the pool; the next call captures again.

        What capture faults taught stays: budgets dropped for lack of memory are
        not tried again, and paths that cannot be captured keep running eagerly.
        """
        self._graphs.clear()
        self._graph_sets.clear()
        self._pool = None
        self._tables.clear()
        self.stats.graphs = 0
        self.stats.pool_bytes = 0

    def reset_stats(self) -> None:
        """Zero the run counters; graph count and pool size stay."""
        self.stats = GraphStats(
            graphs=self.stats.graphs,
            capture_seconds=self.stats.capture_seconds,
            pool_bytes=self.stats.pool_bytes,
            compile_seconds=self.stats.compile_seconds,
        )


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64 (0 for two empty tensors)."""
    actual, expected = actual.double(), expected.double()
    denominator = expected.norm().item()
    difference = (actual - expected).norm().item()
    return difference / denominator if denominator else difference


def verify_tolerance(dtype: torch.dtype) -> float:
    """The relative error ``verify`` accepts for outputs of ``dtype``."""
    tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32
    if dtype == torch.float32 and tf32 and torch.cuda.is_available():
        return TF32_TOLERANCE
    return VERIFY_TOLERANCE.get(dtype, VERIFY_TOLERANCE[torch.float32])


def module_fingerprint(module: torch.nn.Module) -> tuple:
    """Storage, dtype and device of every parameter and buffer.

    Captured graphs read parameters by address: equal fingerprints mean graphs
    stay valid (optimizers update in place); any change calls for a recapture.
    """
    tensors = list(module.parameters()) + list(module.buffers())
    return tuple((t.data_ptr(), t.dtype, t.device, tuple(t.shape)) for t in tensors)


def _padded(rows: torch.Tensor, size: int, rule: str, pin: bool = False) -> torch.Tensor:
    """Host ``rows`` grown to ``size`` rows by the padding rule (``zero`` or
    ``repeat_last``), in a new tensor, in pinned memory if ``pin``."""
    count = rows.shape[0]
    padded = torch.empty((size, *rows.shape[1:]), dtype=rows.dtype, pin_memory=pin)
    padded[:count] = rows
    if rule == "repeat_last" and count > 0:
        padded[count:] = rows[-1]
    else:
        padded[count:] = 0
    return padded


def _next_pow2(count: int) -> int:
    return 1 << (count - 1).bit_length()


def _pow2_counts(max_items: int) -> list[int]:
    counts = [1]
    while counts[-1] * 2 <= max_items:
        counts.append(counts[-1] * 2)
    if counts[-1] != max_items:
        counts.append(max_items)
    return counts


def _slot_counts(max_items: int, max_frames: int, frames_per_item: int) -> list[int]:
    """Item counts of the FULL graphs of a path with per-item metadata: the powers
    of two whose frames stay below ``max_frames``, then ``max_items``, whose
    graph holds all ``max_frames`` (the one graph per budget it replaces)."""
    return [
        count
        for count in _pow2_counts(max_items)
        if count < max_items and count * frames_per_item < max_frames
    ] + [max_items]


def _autocast_key() -> tuple:
    return tuple(
        (device, torch.get_autocast_dtype(device))
        for device in ("cuda", "cpu")
        if torch.is_autocast_enabled(device)
    )


@contextlib.contextmanager
def _graph_context() -> Iterator[None]:
    """Where graphs are captured and replayed.

    Outside inference mode, so static buffers are ordinary tensors that both
    ``Trainer(inference_mode=True)`` and ``False`` may write; without grad; and,
    under autocast, with its weight cache off: a cast cached before capture
    would be freed while the graph still reads it.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.no_grad())
        for device, dtype in _autocast_key():
            stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=False))
        yield


def _replayer(cuda_graph: torch.cuda.CUDAGraph, output: torch.Tensor) -> Callable[[], torch.Tensor]:
    def replay() -> torch.Tensor:
        cuda_graph.replay()
        return output

    return replay


def _same_layout(first: torch.Tensor, second: torch.Tensor) -> bool:
    return (first.shape, first.stride(), first.dtype, first.device) == (
        second.shape,
        second.stride(),
        second.dtype,
        second.device,
    )


def _on_cuda(buffers: Mapping[str, torch.Tensor]) -> bool:
    return any(buffer.is_cuda for buffer in buffers.values())


def _reserved_bytes() -> int:
    return torch.cuda.memory_reserved() if torch.cuda.is_available() else 0
