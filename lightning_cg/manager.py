"""EncoderGraphManager: capture a tower's graphs at token budgets and replay them.

One manager wraps one :class:`~lightning_cg.encoder.GraphableEncoder`. For every
call it packs the items into sub-batches that fit the budgets, asks each path's
:class:`~lightning_cg.dispatcher.CudagraphDispatcher` how to run the sub-batch,
and either replays a captured graph (copying the real rows into the static
buffers and padding the rest by the buffer's rule) or runs the path eagerly.
Outputs are cloned out of the graph buffers and put back in item order.

Graphs are captured lazily, the first time a batch with a new signature (the
adapter's signature plus the autocast dtype) arrives: every FULL key of every
path, largest budget first, into one shared memory pool. Without CUDA the same
path runs (static buffers, padding, graph forward, scatter) without capture.

The manager knows nothing of Lightning.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from lightning_cg.budgets import LADDERS, resolve_budgets
from lightning_cg.dispatcher import BatchDescriptor, CudagraphDispatcher, GraphMode
from lightning_cg.encoder import CaptureSpec, GraphableEncoder, ItemSpec
from lightning_cg.packing import PACKING_STRATEGIES, pack_items

#: Largest relative error ||replay - eager|| / ||eager|| that ``verify`` accepts.
VERIFY_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}
#: fp32 tolerance while TF32 is on: cuBLAS/cuDNN pick other TF32 kernels for the
#: padded batch, which differ from eager by about 1e-3.
TF32_TOLERANCE = 5e-3

ProgressFn = Callable[[int, int, CaptureSpec], None]


@dataclass(frozen=True)
class BudgetConfig:
    """How one encoder path's token budgets are chosen.

    Attributes:
        min_budget: smallest budget; None takes the adapter's default.
        max_budget: largest budget; None takes the adapter's default.
        budgets: an explicit ladder; overrides min/max.
        ladder: ``pow2`` (double from min) or ``geometric`` (multiply by ratio).
        ratio: growth of the geometric ladder.
        align: geometric budgets are rounded up to a multiple of this.
    """

    min_budget: int | None = None
    max_budget: int | None = None
    budgets: Sequence[int] | None = None
    ladder: str = "pow2"
    ratio: float = 1.25
    align: int = 16

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
        if self.ladder not in LADDERS:
            raise ValueError(f"ladder must be one of {', '.join(LADDERS)}; got {self.ladder!r}")


@dataclass
class GraphStats:
    """Counters of one manager, reset by :meth:`EncoderGraphManager.reset_stats`.

    A hit is one path of one sub-batch served by a graph, a miss one that ran
    eagerly. Padded tokens are the budget rows a replay computed beyond the real ones.
    """

    hits: int = 0
    misses: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    graphs: int = 0
    capture_seconds: float = 0.0
    pool_bytes: int = 0
    sub_batches: int = 0
    items: int = 0
    tokens: int = 0

    @property
    def hit_rate(self) -> float:
        runs = self.hits + self.misses
        return self.hits / runs if runs else 0.0

    @property
    def padding_waste(self) -> float:
        """Padded tokens per real token served by graphs."""
        return self.padded_tokens / self.real_tokens if self.real_tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "hit_rate": self.hit_rate, "padding_waste": self.padding_waste}


@dataclass
class _Graph:
    """Static buffers, output and (on CUDA) the captured graph of one key."""

    spec: CaptureSpec
    buffers: dict[str, torch.Tensor]
    output: torch.Tensor | None = None
    cuda_graph: torch.cuda.CUDAGraph | None = None
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


class EncoderGraphManager:
    """Budget-batched CUDA graph execution of one graphable encoder.

    Args:
        encoder: the adapter around the tower.
        mode: a :class:`GraphMode` or its lower-case name.
        budgets: budget choice for every path (see :class:`BudgetConfig`).
        path_budgets: per-path overrides of ``budgets``, by path name.
        max_items: most items in one sub-batch; None derives it from the budgets.
        max_frames_per_batch: attention sequences a graph holds; None is
            ``max_items * max_frames_per_item``. Larger sub-batches skip FULL.
        packing: ``next_fit`` or ``min_padding``.
        uniform_item_counts: item counts of the exact uniform keys; None is a
            power-of-two ladder up to ``max_items``.
        verify: compare the first replay of every graph with eager and raise on
            a mismatch beyond :data:`VERIFY_TOLERANCE`.
        progress: called after each capture as ``progress(done, total, spec)``.

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
        self.encoder = encoder
        self.mode = GraphMode.parse(mode)
        if self.mode.requires_piecewise():
            raise ValueError(
                f"mode {self.mode.name.lower()!r} needs piecewise graphs, which this build "
                "does not provide; allowed: none, full, full_uniform_only"
            )
        self.config = encoder.graph_config()
        self.packing = packing
        self.verify = verify
        self.progress = progress
        self.stats = GraphStats()
        self._budget_configs = self._check_path_budgets(budgets or BudgetConfig(), path_budgets)
        self.max_items = self._resolve_max_items(max_items)
        self.paths = self._plan_paths(max_items, uniform_item_counts, max_frames_per_batch)
        self._graphs: dict[tuple[Hashable, str, BatchDescriptor], _Graph] = {}
        self._graph_sets: set[Hashable] = set()
        self._pool: Any = None

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
            ladder=choice.ladder,
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
        plans = {}
        for path, path_config in self.config.paths.items():
            # The user's max_items, not the resolved one: that would start
            # every ladder at max_items (the seed's 'only max_items' branch).
            budgets, _ = self._resolve_path(path, user_max_items)
            plans[path] = _PathPlan(
                budgets=budgets,
                dispatcher=CudagraphDispatcher(self.mode, budgets, counts),
                allow_zero_tokens=path_config.allow_zero_tokens,
                item_frames=frames_per_item,
                max_frames=max_frames,
                # Zero is a budget of its own for optional paths: it is never captured.
                ladder=([0] if path_config.allow_zero_tokens else []) + budgets,
            )
        return plans

    # ---------------------------------------------------------------- capture

    def capture(self, signature: Hashable, paths: Sequence[str] | None = None) -> None:
        """Capture every FULL key of ``paths`` (default: all) for one adapter signature.

        Graphs are keyed by the signature and the current autocast dtype, and
        captured largest budget first into the manager's one memory pool. A path
        is captured once per signature; calls for captured paths do nothing.
        """
        graph_set = (signature, _autocast_key())
        todo = [path for path in (paths or self.paths) if (graph_set, path) not in self._graph_sets]
        if not todo:
            return
        specs = self._capture_specs(signature, todo)
        started = time.perf_counter()
        reserved_before = _reserved_bytes()
        with _graph_context():
            for done, (desc, spec) in enumerate(specs, start=1):
                self._graphs[(graph_set, spec.path, desc)] = self._capture_one(spec)
                if self.progress is not None:
                    self.progress(done, len(specs), spec)
        if self._pool is not None:
            torch.cuda.synchronize()
        self.stats.capture_seconds += time.perf_counter() - started
        self.stats.pool_bytes += max(0, _reserved_bytes() - reserved_before)
        self._graph_sets.update((graph_set, path) for path in todo)

    def _capture_specs(
        self, signature: Hashable, paths: Sequence[str]
    ) -> list[tuple[BatchDescriptor, CaptureSpec]]:
        specs = []
        for path in paths:
            plan = self.paths[path]
            for runtime_mode, desc in plan.dispatcher.capture_descriptors():
                if runtime_mode is not GraphMode.FULL:
                    continue
                items = desc.num_items or self.max_items
                frames = plan.max_frames if desc.num_items is None else items * plan.item_frames
                spec = CaptureSpec(path, desc.num_tokens, items, frames, signature)
                specs.append((desc, spec))
        # Largest first so smaller graphs reuse the pool blocks of larger ones.
        specs.sort(key=lambda pair: -pair[1].token_budget)
        return specs

    def _capture_one(self, spec: CaptureSpec) -> _Graph:
        graph = _Graph(spec=spec, buffers=self.encoder.capture_inputs(spec))
        if _on_cuda(graph.buffers):
            graph.cuda_graph, graph.output = self._record(spec.path, graph.buffers)
            self.stats.graphs += 1
        return graph

    def _record(
        self, path: str, buffers: dict[str, torch.Tensor]
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # Warm up on a side stream so lazy initialisation (cuBLAS handles,
        # autotuning) stays out of the graph.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.encoder.graph_forward(path, buffers)
        torch.cuda.current_stream().wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph, pool=self._pool):
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
        with _graph_context():
            for indices in self._pack(specs):
                sub_inputs = self.encoder.select_items(inputs, indices)
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
        graph, key = self._lookup(path, (signature, _autocast_key()), specs, tokens)
        if graph is None:
            self.stats.misses += 1
            return self._split(self._eager(path, inputs, specs), path, specs)
        self.stats.hits += 1
        self.stats.real_tokens += total
        self.stats.padded_tokens += key.num_tokens - total
        rows = self._replay(graph, path, inputs, total)
        if self.verify and not graph.verified:
            self._verify(graph, path, inputs, specs, rows)
        return self._split(rows, path, specs)

    def _lookup(
        self, path: str, graph_set: Hashable, specs: list[ItemSpec], tokens: list[int]
    ) -> tuple[_Graph | None, BatchDescriptor | None]:
        plan = self.paths[path]
        desc = BatchDescriptor(sum(tokens), len(tokens), uniform=len(set(tokens)) == 1)
        frames = sum(spec.num_frames for spec in specs)
        runtime_mode, key = plan.dispatcher.dispatch(desc)
        graph = self._graphs.get((graph_set, path, key)) if runtime_mode is GraphMode.FULL else None
        if graph is not None and frames > graph.spec.max_frames:
            # More attention sequences than the graph's metadata holds.
            runtime_mode, key = plan.dispatcher.dispatch(desc, disable_full=True)
            graph = None
        if runtime_mode is GraphMode.FULL and graph is None:
            raise RuntimeError(f"no captured graph for FULL key {key} on path {path!r}")
        return graph, key

    def _replay(self, graph: _Graph, path: str, inputs: Any, total: int) -> torch.Tensor:
        real = self.encoder.replay_inputs(path, inputs)
        missing = sorted(set(graph.buffers) - set(real))
        if missing:
            raise RuntimeError(f"replay_inputs for path {path!r} lacks buffer(s) {missing}")
        for name, buffer in graph.buffers.items():
            self._fill(name, buffer, real[name])
        if graph.cuda_graph is not None:
            graph.cuda_graph.replay()
            output = graph.output
        else:
            output = self.encoder.graph_forward(path, graph.buffers)
        # Clone: the next replay overwrites the graph's output buffer.
        return output[:total].clone()

    def _fill(self, name: str, buffer: torch.Tensor, rows: torch.Tensor) -> None:
        count = rows.shape[0]
        if rows.shape[1:] != buffer.shape[1:] or count > buffer.shape[0]:
            raise RuntimeError(
                f"buffer {name!r} holds {tuple(buffer.shape)}; replay rows {tuple(rows.shape)} "
                "do not fit (the adapter's capture_inputs and replay_inputs disagree)"
            )
        if rows.dtype != buffer.dtype or rows.device != buffer.device:
            raise RuntimeError(
                f"buffer {name!r} is {buffer.dtype} on {buffer.device}; replay rows are "
                f"{rows.dtype} on {rows.device}; the graph signature should have separated them"
            )
        buffer[:count].copy_(rows, non_blocking=True)
        if count == buffer.shape[0]:
            return
        rule = self.config.padding_rules.get(name, "zero")
        if rule == "repeat_last" and count > 0:
            buffer[count:].copy_(rows[-1:].expand_as(buffer[count:]), non_blocking=True)
        else:
            buffer[count:].zero_()

    def _eager(self, path: str, inputs: Any, specs: list[ItemSpec]) -> torch.Tensor:
        rows = self.encoder.eager_forward(path, inputs)
        expected = sum(spec.path_tokens.get(path, 0) for spec in specs)
        if rows.shape[0] != expected:
            raise RuntimeError(
                f"eager_forward on path {path!r} returned {rows.shape[0]} rows; "
                f"item_specs promise {expected}"
            )
        return rows

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

    # ------------------------------------------------------------- lifecycle

    def is_captured(self) -> bool:
        """Whether any graph set has been captured (or, without CUDA, prepared)."""
        return bool(self._graph_sets)

    def clear(self) -> None:
        """Drop every graph, buffer and the pool; the next call captures again."""
        self._graphs.clear()
        self._graph_sets.clear()
        self._pool = None
        self.stats.graphs = 0
        self.stats.pool_bytes = 0

    def reset_stats(self) -> None:
        """Zero the run counters; graph count and pool size stay."""
        self.stats = GraphStats(
            graphs=self.stats.graphs,
            capture_seconds=self.stats.capture_seconds,
            pool_bytes=self.stats.pool_bytes,
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


def _pow2_counts(max_items: int) -> list[int]:
    counts = [1]
    while counts[-1] * 2 <= max_items:
        counts.append(counts[-1] * 2)
    if counts[-1] != max_items:
        counts.append(max_items)
    return counts


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


def _on_cuda(buffers: Mapping[str, torch.Tensor]) -> bool:
    return any(buffer.is_cuda for buffer in buffers.values())


def _reserved_bytes() -> int:
    return torch.cuda.memory_reserved() if torch.cuda.is_available() else 0
