"""Capture: record the graphs of given keys, and recover from what a capture can hit.

Out of memory drops the failing budget and larger ones and retries; an uncapturable
tower turns its path eager; any other error turns every path eager (an eager run of the
tower still raises it).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import warnings
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from lightning_cg.engine.cache import CapturedGraph, GraphKey, GraphSet
from lightning_cg.engine.config import GraphConfig
from lightning_cg.engine.encoder import CaptureSpec, GraphableEncoder
from lightning_cg.engine.faults import (
    CAPTURE_FAILED,
    OUT_OF_MEMORY,
    CaptureFault,
    ChangesState,
    capture_failed,
    capturing,
    diagnose,
    free_device_memory,
)
from lightning_cg.engine.memory import graph_memory
from lightning_cg.engine.plan import PathPlan
from lightning_cg.engine.replay import graph_context
from lightning_cg.engine.replay_checks import BufferState
from lightning_cg.engine.state import EngineState
from lightning_cg.engine.weight_casts import WeightCasts

logger = logging.getLogger(__name__)
ProgressFn = Callable[[int, int, CaptureSpec], None]
#: Largest relative difference of warm-ups with and without the weight copies that lets
#: a graph read them (they agree to the bit unless a weight is used outside autocast).
CAST_TOLERANCE = 1e-3


class GraphCapturer:
    """Captures keys into a :class:`GraphCache`, changing the plans a fault rules out.

    Under autocast, graphs read ``weight_casts`` (None: every replay casts) when a
    warm-up with them agrees with one without.
    """

    def __init__(
        self,
        encoder: GraphableEncoder,
        config: GraphConfig,
        state: EngineState,
        progress: ProgressFn | None = None,
        weight_casts: WeightCasts | None = None,
    ) -> None:
        self.encoder = encoder
        self.weight_casts = weight_casts
        self._casts_disagree = False
        # The dtypes whose copies a warm-up found to agree with autocast.
        self._casts_agree: set[torch.dtype] = set()
        self.config = config
        self.state = state
        self.progress = progress
        self.padding_rules = encoder.graph_config().padding_rules
        tower = getattr(encoder, "tower", None)
        self._tower = tower if isinstance(tower, nn.Module) else None
        #: The capture error of unknown cause that turned every path eager.
        self.capture_error: str | None = None
        #: A capture changed what the graphs hold since :meth:`refresh_memory` last ran.
        self.memory_stale = False

    def capture(self, keys: Sequence[GraphKey]) -> float:
        """Capture those of ``keys`` not captured nor ruled out; returns the seconds it took."""
        started = time.perf_counter()
        stats = self.state.stats
        graphs_before = self.state.cache.num_cuda_graphs
        with graph_context():
            self._capture_recovering(list(keys))
        if self.state.cache.has_pool:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        # Without a pool no graph was captured (a CPU tower's buffers only): the stats say 0.
        if self.state.cache.has_pool:
            stats.capture_seconds += seconds
            stats.capture_seconds_run += seconds
        stats.graphs_captured += max(0, self.state.cache.num_cuda_graphs - graphs_before)
        stats.graphs = self.state.cache.num_cuda_graphs
        # Read from the allocator when the stats are read: a snapshot walks every block.
        self.memory_stale = True
        return seconds

    def refresh_memory(self) -> None:
        """Set the stats' memory fields to what the graphs hold now: the whole pool (not a
        capture's growth: captures share it and reuse its free blocks), the input buffers
        outside it and the weight copies."""
        stats = self.state.stats
        stats.weight_copy_bytes = 0 if self.weight_casts is None else self.weight_casts.nbytes
        memory = graph_memory(self.state.cache)
        stats.pool_bytes = memory.pool_bytes
        stats.held_bytes = memory.pool_bytes + memory.input_bytes + stats.weight_copy_bytes
        self.memory_stale = False

    def _capture_recovering(self, keys: list[GraphKey]) -> None:
        out_of_memory: dict[str, list[int]] = {}
        while True:
            failure = self._capture_keys(self._still_wanted(keys))
            if failure is None:
                break
            # Out of the except clause: the error's frames (the failed graph) are gone.
            key, fault = failure
            if fault.kind == CAPTURE_FAILED:
                self.stop_capturing(fault)
                free_device_memory()
                break
            if fault.kind == OUT_OF_MEMORY:
                budget = key.descriptor.num_tokens
                out_of_memory.setdefault(key.path, []).append(budget)
                plan = self.state.plan.paths[key.path].below(budget)
                self.state.update(key.path, plan)
                # Graphs of every signature at the dropped budgets are of no use any more.
                self.state.cache.drop([key.path], from_budget=0 if plan.eager_reason else budget)
            else:
                self._run_eagerly(key.path, fault)
            free_device_memory()
        for path, budgets in out_of_memory.items():
            self._warn_out_of_memory(path, budgets)

    def _still_wanted(self, keys: list[GraphKey]) -> list[GraphKey]:
        """Keys not captured whose path still graphs their budget, largest first (smaller
        graphs reuse the pool blocks of larger ones)."""
        paths = self.state.plan.paths
        wanted = [
            key
            for key in keys
            if key not in self.state.cache
            and paths[key.path].eager_reason is None
            and key.descriptor.num_tokens in paths[key.path].budgets
        ]
        return sorted(wanted, key=lambda key: -key.descriptor.num_tokens)

    def _capture_keys(self, keys: list[GraphKey]) -> tuple[GraphKey, CaptureFault] | None:
        """Capture ``keys`` in turn; the first that fails with a known fault, and the fault.
        On a fault this call's graphs are dropped, freeing their memory for the retry."""
        captured: list[GraphKey] = []
        for done, key in enumerate(keys, start=1):
            plan = self.state.plan
            spec = plan.paths[key.path].capture_spec(
                key.path, key.descriptor, key.graph_set.signature, plan.max_items
            )
            try:
                graph = self._capture_one(spec)
            except Exception as error:
                fault = diagnose(error) or capture_failed(error)
                self.state.cache.remove(captured)
                return key, fault
            self.state.cache.add(key, graph)
            captured.append(key)
            if self.progress is not None:
                self.progress(done, len(keys), spec)
        return None

    def _capture_one(self, spec: CaptureSpec) -> CapturedGraph:
        buffers = self.state.cache.share_buffers(spec, self.encoder.capture_inputs(spec))
        pool = self.state.cache.pool() if any(b.is_cuda for b in buffers.values()) else None
        rules = self.padding_rules
        if pool is None:
            run = functools.partial(self.encoder.graph_forward, spec.path, buffers)
            return CapturedGraph(spec, buffers, run, rules)
        # Warm-ups run the forward for real: whatever they change in the tower is put back.
        saved = BufferState(self._tower)
        cuda_graph = torch.cuda.CUDAGraph()
        with cublas_workspaces_dropped():
            with side_stream():
                cast_dtype = self._warm_up(spec.path, buffers)
            with self._casts_in(cast_dtype), capturing(), torch.cuda.graph(cuda_graph, pool=pool):
                output = self.encoder.graph_forward(spec.path, buffers)
        if changed := saved.changed():
            saved.restore()
            raise ChangesState(changed)
        run = _replayer(cuda_graph, output)
        return CapturedGraph(spec, buffers, run, rules, cuda_graph=cuda_graph, output=output)

    def _warm_up(self, path: str, buffers: dict[str, torch.Tensor]) -> torch.dtype | None:
        """One warm-up forward, with the weight copies when they may serve; the autocast
        dtype to capture with copies, or None. The first capture of a dtype also runs one
        without them and keeps the copies only if the two agree."""
        dtype = self._cast_dtype()
        if dtype is None:
            self.encoder.graph_forward(path, buffers)
            return None
        if dtype in self._casts_agree:
            with self._casts_in(dtype):
                self.encoder.graph_forward(path, buffers)
            return dtype
        reference = self.encoder.graph_forward(path, buffers)
        try:
            with self._casts_in(dtype):
                trial = self.encoder.graph_forward(path, buffers)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as error:  # e.g. a weight read outside autocast
            return self._refuse_casts(f"the forward with them fails ({error})")
        if not WeightCasts.agree(trial, reference, CAST_TOLERANCE):
            return self._refuse_casts("the forward with them differs from autocast's")
        self._casts_agree.add(dtype)
        return dtype

    def _refuse_casts(self, why: str) -> None:
        # The copies stay: graphs captured before may read them.
        self._casts_disagree = True
        logger.info(
            "%s: graphs cast weights on every replay, not once per run: %s",
            type(self.encoder).__name__,
            why,
        )

    def _cast_dtype(self) -> torch.dtype | None:
        """The autocast dtype weight copies would be made in, if they may serve."""
        if self.weight_casts is None or self._casts_disagree:
            return None
        return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None

    def _casts_in(self, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
        if dtype is None or self.weight_casts is None:
            return contextlib.nullcontext()
        return self.weight_casts.swapped_in(dtype)

    def _run_eagerly(self, path: str, fault: CaptureFault) -> None:
        self.state.update(path, self.state.plan.paths[path].eager(str(fault)))
        self.state.cache.drop([path])
        _warn(
            f"EncoderGraphManager: capturing path {path!r} failed: {fault.cause} "
            f"({fault.error}). Fix: {fault.fix}. Path {path!r} runs eagerly."
        )

    def stop_capturing(self, fault: CaptureFault) -> None:
        """Every path eager from now on, after an error no fallback is known for."""
        self.capture_error = str(fault)
        paths = self.state.plan.paths
        self.state.plan = self.state.plan.with_paths(
            {path: plan.eager(self.capture_error) for path, plan in paths.items()}
        )
        self.state.cache.drop(list(paths))
        _warn(
            f"EncoderGraphManager: capturing graphs failed: {fault.error}; every path runs "
            "eagerly from now on."
        )

    def _warn_out_of_memory(self, path: str, budgets: list[int]) -> None:
        plan = self.state.plan.paths[path]
        if plan.eager_reason is not None:
            outcome = f"path {path!r} runs eagerly"
        else:
            outcome = (
                f"path {path!r} keeps budgets {list(plan.budgets)}: larger sub-batches are split "
                f"and items above {plan.budgets[-1]} tokens run eagerly"
            )
        failed = ", then ".join(str(budget) for budget in budgets)
        _warn(
            f"EncoderGraphManager: out of memory capturing path {path!r} at token budget "
            f"{failed}; freed the graphs of that capture; {outcome}. To keep the larger "
            "budgets, free device memory or lower max_budget / max_items_per_batch."
        )


def path_keys(graph_set: GraphSet, path: str, plan: PathPlan) -> list[GraphKey]:
    """Every key of ``path``'s dispatcher (its whole ladder) in ``graph_set``."""
    return [GraphKey(graph_set, path, desc) for desc in plan.dispatcher.capture_descriptors()]


@contextlib.contextmanager
def side_stream() -> Iterator[None]:
    """Run the ``with`` body on a side stream, so lazy initialisation stays out of graphs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        yield
    torch.cuda.current_stream().wait_stream(side)


@contextlib.contextmanager
def cublas_workspaces_dropped() -> Iterator[None]:
    """Drop cuBLAS's workspaces before and after the ``with`` body. cuBLAS keeps one per
    stream for good: those of the warm-up's side stream and of the capture (taken from the
    pool) would stay allocated after it. Dropped, the capture's is a free block of the pool
    its graph still uses, as any activation is (graphs of one pool replay one at a time);
    the eager stream takes its workspace again from the cache."""
    torch._C._cuda_clearCublasWorkspaces()
    try:
        yield
    finally:
        torch._C._cuda_clearCublasWorkspaces()


def _replayer(cuda_graph: torch.cuda.CUDAGraph, output: torch.Tensor) -> Callable[[], torch.Tensor]:
    def replay() -> torch.Tensor:
        cuda_graph.replay()
        return output

    return replay


def _warn(message: str, stacklevel: int = 5) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)
