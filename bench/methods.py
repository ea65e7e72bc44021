"""The benchmark's methods: the ways to run a tower on a workload, one :class:`Runner` each.

A new method is one function ``(tower, workload, settings) -> Runner`` added to
:data:`METHODS`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from bench.workloads import Workload
from lightning_cg.adapters import adapter_for
from lightning_cg.engine.config import GraphConfig
from lightning_cg.engine.encoder import GraphableEncoder
from lightning_cg.engine.manager import EncoderGraphManager

if TYPE_CHECKING:  # bench.settings imports this module to check method names
    from bench.settings import BenchSettings

GRAPH_METHOD = "lightning-cg"


@dataclass
class Runner:
    """One method set up on one workload.

    Attributes:
        step: runs batch ``index`` of the workload.
        capture_s: seconds the set-up spent capturing graphs.
        pool_bytes: memory the set-up's graphs reserved.
        manager: the graph manager of ``lightning-cg`` rows; its stats fill the
            capture, pool, padding and hit-rate columns.
        setup_in_first_pass: the method compiles and records inside its first
            pass (torch.compile); ``capture_s`` is then the first pass minus a
            steady pass, ``pool_bytes`` the memory reserved by the first pass.
        close: called once timing is over, e.g. to drop compiled code.
        note: said in the row.
    """

    step: Callable[[int], object]
    capture_s: float | None = None
    pool_bytes: int | None = None
    manager: EncoderGraphManager | None = None
    setup_in_first_pass: bool = False
    close: Callable[[], None] | None = None
    note: str = ""


MethodFn = Callable[[nn.Module, Workload, "BenchSettings"], Runner]


def eager_method(tower: nn.Module, workload: Workload, settings: BenchSettings) -> Runner:
    """The tower as it is, called as its users call it."""
    calls = _calls(workload)

    def step(index: int) -> object:
        args, kwargs = calls[index]
        return tower(*args, **kwargs)

    return Runner(step=step)


def graph_method(
    tower: nn.Module, workload: Workload, settings: BenchSettings, mode: str = "full"
) -> Runner:
    """Through :class:`EncoderGraphManager` on ``adapter_for(tower)``; captures lazily."""
    manager = EncoderGraphManager(adapter_for(tower), graph_config(settings.manager, mode))
    encoder = manager.encoder
    calls = _calls(workload)
    # The capture policy weighs a capture against the calls the measurement makes.
    passes = 1 + settings.warmup + settings.repeats
    if workload.stream:
        passes = 1 + settings.stream["warmup"] + settings.stream["repeats"]
    manager.begin_run(expected_calls=passes * len(workload.batches))

    def step(index: int) -> object:
        return manager.execute(encoder.inputs_from_call(*calls[index]))

    return Runner(step=step, manager=manager)


def exact_method(tower: nn.Module, workload: Workload, settings: BenchSettings) -> Runner:
    """One CUDA graph per batch and path, captured on exactly the batch's rows."""
    encoder = adapter_for(tower)
    pool = torch.cuda.graph_pool_handle()
    reserved_before = torch.cuda.memory_reserved()
    started = time.perf_counter()
    # Per batch: (graph, buffers, output). A graph reads its inputs and writes its
    # output by address, so both must live as long as it does.
    graphs: list[list[tuple[torch.cuda.CUDAGraph, dict, object]]] = []
    for call in _calls(workload):
        batch_graphs = []
        for path, buffers in exact_buffers(encoder, encoder.inputs_from_call(*call), settings):
            graph, output = _capture(partial(encoder.graph_forward, path, buffers), pool)
            batch_graphs.append((graph, buffers, output))
        graphs.append(batch_graphs)
    torch.cuda.synchronize()

    def step(index: int) -> None:
        for graph, _, _ in graphs[index]:
            graph.replay()

    return Runner(
        step=step,
        capture_s=time.perf_counter() - started,
        pool_bytes=max(0, torch.cuda.memory_reserved() - reserved_before),
    )


def exact_buffers(
    encoder: GraphableEncoder, inputs: object, settings: BenchSettings
) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """The static buffers of the ``exact`` graphs of one batch: per path with tokens,
    exactly the batch's rows (and metadata) on ``settings.device``, what
    ``encoder.graph_forward(path, buffers)`` runs on.

    The Qwen towers' metadata (``cu_seqlens``, ``position_ids``, ...) come precomputed
    from ``grid_thw`` on the host, so the graph forward makes no host sync.
    """
    specs = encoder.item_specs(inputs)
    paths = []
    for path in encoder.graph_config().paths:
        if sum(spec.path_tokens.get(path, 0) for spec in specs):
            # Metadata may come on the host; the graph reads it on the device.
            buffers = {
                name: rows.to(settings.device)
                for name, rows in encoder.replay_inputs(path, inputs).items()
            }
            paths.append((path, buffers))
    return paths


def compile_method(tower: nn.Module, workload: Workload, settings: BenchSettings) -> Runner:
    """``torch.compile(tower, mode="reduce-overhead")``, compiled afresh for this workload."""
    torch._dynamo.reset()
    compiled = torch.compile(tower, mode="reduce-overhead")
    calls = _calls(workload)

    def step(index: int) -> object:
        torch.compiler.cudagraph_mark_step_begin()
        args, kwargs = calls[index]
        return compiled(*args, **kwargs)

    note = "capture_s: first pass minus a steady pass (compilation and recording)"
    return Runner(step=step, setup_in_first_pass=True, close=torch._dynamo.reset, note=note)


def _calls(workload: Workload) -> list[tuple[tuple, dict[str, torch.Tensor]]]:
    return [workload.call(index) for index in range(len(workload.batches))]


def _capture(run: Callable[[], object], pool: Any) -> tuple[torch.cuda.CUDAGraph, object]:
    # Warm up on a side stream so lazy initialisation stays out of the graph.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = run()
    return graph, output


@dataclass(frozen=True)
class Method:
    """A row label and how to set it up."""

    name: str
    build: MethodFn
    family: str  # the name ``methods`` and ``skip_methods`` use (``lightning-cg`` for every mode)
    needs_cuda: bool = False


#: Methods by config name; ``lightning-cg`` expands to one row per mode.
METHODS: dict[str, Method] = {
    "eager": Method("eager", eager_method, "eager"),
    "exact": Method("exact", exact_method, "exact", needs_cuda=True),
    "compile": Method("compile", compile_method, "compile", needs_cuda=True),
}


def expand_methods(settings: BenchSettings) -> list[Method]:
    """The configured methods as rows, ``eager`` first (every ratio needs it)."""
    methods = []
    for name in sorted(settings.methods, key=lambda name: name != "eager"):
        if name == GRAPH_METHOD:
            methods += [
                Method(f"{GRAPH_METHOD}/{mode}", partial(graph_method, mode=mode), name)
                for mode in settings.modes
            ]
        else:
            methods.append(METHODS[name])
    return methods


def graph_config(manager: Mapping[str, Any], mode: str) -> GraphConfig:
    """The ``manager`` settings, in ``mode``, as one checked :class:`GraphConfig`.

    Raises:
        ValueError: a field is unknown or bad; the message names it.
    """
    try:
        return GraphConfig.from_options(**{**manager, "mode": mode})
    except ValueError as error:
        raise ValueError(f"manager settings: manager.{error}") from None
