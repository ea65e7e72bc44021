"""Benchmark: lightning-cg against eager, the exact-shape CUDA graph and torch.compile.

Plain functions behind ``scripts/bench.py`` (a Hydra app; every field is
explained in ``conf/bench.yaml``). One run builds each tower with random
weights, builds its workloads from seeded random data (and the bundled photos),
and times every method on every workload in this one process:

- ``eager``: the tower as it is, cast to ``dtype``, under ``torch.inference_mode``.
- ``lightning-cg/<mode>``: :class:`~lightning_cg.manager.EncoderGraphManager` on
  ``adapter_for(tower)``, one row per configured mode.
- ``exact``: one CUDA graph per batch, captured on exactly that batch's rows
  (the adapter's graph forward, no padding, no packing, no copies): the limit
  of any graph method.
- ``compile``: ``torch.compile(tower, mode="reduce-overhead")``.

A pass runs every batch of a workload once; a row reports the median pass over
``repeats`` passes after ``warmup`` passes, divided by the batches of a pass.
Without CUDA the ``exact`` and ``compile`` rows say ``unavailable: needs CUDA``
and the manager runs its CPU path (no capture). A new method is one function
``(tower, workload, settings) -> Runner`` added to :data:`METHODS`.

Example:
    ``python scripts/bench.py quick=true workloads=[vit_b_16]``, or from Python
    ``main(OmegaConf.to_container(compose("bench", overrides)))``.
"""

from __future__ import annotations

import gc
import json
import logging
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_cg.adapters import adapter_for
from lightning_cg.dispatcher import GraphMode
from lightning_cg.manager import BudgetConfig, EncoderGraphManager
from lightning_cg.models.packed_vit import (
    PackedViT,
    packed_vit_config,
    packed_vit_small_config,
    patchify,
)

log = logging.getLogger(__name__)

BATCHED_TOWERS = ("vit_b_16", "resnet50")
PACKED_TOWERS = ("packed_vit_small", "packed_vit")
STREAM = "stream"
WORKLOADS = (*BATCHED_TOWERS, *PACKED_TOWERS, STREAM)
#: Packed-tower scenarios: images per batch and the side range (a key of ``sizes``).
SCENARIOS = {
    "single_mixed": (1, "mixed_sides"),
    "single_small": (1, "small_sides"),
    "mixed_4": (4, "mixed_sides"),
    "small_16": (16, "small_sides"),
    "photos": (None, None),
}
GRAPH_METHOD = "lightning-cg"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: Keys every row carries, in table order.
ROW_KEYS = (
    "workload",
    "method",
    "ms_per_batch",
    "images_per_s",
    "vs_eager",
    "vs_exact",
    "padding_waste",
    "capture_s",
    "pool_bytes",
    "peak_mem_bytes",
    "total_s",
    "hit_rate",
    "host_us_per_replay",
    "decision_table",
    "images",
    "batches",
    "device",
    "dtype",
    "status",
    "note",
)
NEEDS_CUDA = "unavailable: needs CUDA"
#: Status of manager rows without CUDA: the same pack/pad/scatter path, no capture.
CPU_PATH = "ok: cpu path, no CUDA graphs"

Batch = tuple[torch.Tensor, ...]


# ------------------------------------------------------------------ settings


@dataclass
class BenchSettings:
    """One run, resolved from ``conf/bench.yaml`` by :func:`resolve_settings`.

    Attributes:
        device: where towers and inputs live.
        dtype: towers and inputs are cast to it.
        seed: seeds the weights, the image sizes and the pixels.
        workloads: tower names and/or ``stream``, in run order.
        batch_sizes: batches of the batch-first towers.
        scenarios: packed-tower scenarios, names of :data:`SCENARIOS`.
        methods: ``eager``, ``lightning-cg``, ``exact``, ``compile`` (or any
            other name in :data:`METHODS`).
        modes: graph modes of the ``lightning-cg`` rows.
        skip_methods: methods reported as skipped instead of run.
        warmup: untimed passes before timing.
        repeats: timed passes; the median is reported.
        stream: the stream workload: ``tower``, ``shapes``, ``max_images``,
            ``warmup``, ``repeats``.
        sizes: tower constructor overrides and image side ranges.
        packed: batches per pass of the packed scenarios.
        manager: keyword arguments of the manager (budgets as dicts).
        profile: ``quick`` or ``full``, for the notes of skipped rows.
        fail_fast: raise the first error instead of recording it in its row.
    """

    device: torch.device
    dtype: torch.dtype
    seed: int
    workloads: list[str]
    batch_sizes: list[int]
    scenarios: list[str]
    methods: list[str]
    modes: list[str]
    skip_methods: list[str]
    warmup: int
    repeats: int
    stream: dict[str, Any]
    sizes: dict[str, Any]
    packed: dict[str, int]
    manager: dict[str, Any]
    profile: str = "full"
    fail_fast: bool = False


def resolve_settings(config: Mapping[str, Any]) -> BenchSettings:
    """Apply the profile (``quick``) and ``tiny`` to a plain config dict and check it.

    Fields left null take the value of ``profiles.quick`` or ``profiles.full``;
    ``tiny=true`` takes ``tiny_sizes`` instead of ``sizes``.

    Raises:
        ValueError: a field has a value outside what it allows; the message names it.
    """
    profile = "quick" if config["quick"] else "full"
    defaults = config["profiles"][profile]

    def pick(name: str) -> Any:
        value = config.get(name)
        return defaults[name] if value is None else value

    settings = BenchSettings(
        device=_resolve_device(config["device"]),
        dtype=_choice("dtype", config["dtype"], DTYPES),
        seed=int(config["seed"]),
        workloads=list(pick("workloads")),
        batch_sizes=[int(size) for size in pick("batch_sizes")],
        scenarios=list(pick("scenarios")),
        methods=list(config["methods"]),
        modes=list(config["modes"]),
        skip_methods=list(pick("skip_methods")),
        warmup=int(pick("warmup")),
        repeats=int(pick("repeats")),
        stream=dict(config["stream"]),
        sizes=dict(config["tiny_sizes"] if config["tiny"] else config["sizes"]),
        packed=dict(config["packed"]),
        manager=dict(config["manager"]),
        profile=profile,
        fail_fast=bool(config.get("fail_fast", False)),
    )
    _check(settings)
    return settings


def _check(settings: BenchSettings) -> None:
    _check_names("workloads", settings.workloads, WORKLOADS)
    _check_names("scenarios", settings.scenarios, tuple(SCENARIOS))
    _check_names("methods", settings.methods, (*METHODS, GRAPH_METHOD))
    _check_names("skip_methods", settings.skip_methods, (*METHODS, GRAPH_METHOD))
    _check_names("stream.tower", [settings.stream["tower"]], (*BATCHED_TOWERS, *PACKED_TOWERS))
    for mode in settings.modes:
        GraphMode.parse(mode)
    if settings.warmup < 0 or settings.repeats < 1:
        raise ValueError(
            f"need warmup >= 0 and repeats >= 1; got warmup={settings.warmup}, "
            f"repeats={settings.repeats}"
        )
    if any(size < 1 for size in settings.batch_sizes):
        raise ValueError(f"batch_sizes must be positive; got {settings.batch_sizes}")
    stream = settings.stream
    if min(stream["shapes"], stream["repeats"], stream["max_images"]) < 1:
        raise ValueError(
            "stream.shapes, stream.repeats and stream.max_images must be >= 1; got "
            f"{stream['shapes']}, {stream['repeats']}, {stream['max_images']}"
        )
    _manager_kwargs(settings.manager)


def _check_names(field_name: str, names: Sequence[str], allowed: Sequence[str]) -> None:
    unknown = [name for name in names if name not in allowed]
    if unknown:
        raise ValueError(f"{field_name} has unknown {unknown}; allowed: {', '.join(allowed)}")


def _choice(field_name: str, value: str, allowed: Mapping[str, Any]) -> Any:
    if value not in allowed:
        raise ValueError(f"{field_name} is {value!r}; allowed: {', '.join(allowed)}")
    return allowed[value]


def _resolve_device(name: str) -> torch.device:
    _choice("device", name, {"auto": None, "cuda": None, "cpu": None})
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but CUDA is not available; use device=auto or cpu")
    return torch.device(name)


def _manager_kwargs(manager: Mapping[str, Any]) -> dict[str, Any]:
    kwargs = dict(manager)
    try:
        kwargs["budgets"] = BudgetConfig(**_budget_dict(kwargs.get("budgets")))
        kwargs["path_budgets"] = {
            path: BudgetConfig(**_budget_dict({**(manager.get("budgets") or {}), **choice}))
            for path, choice in (kwargs.get("path_budgets") or {}).items()
        }
    except TypeError as error:
        raise ValueError(f"manager.budgets / manager.path_budgets: {error}") from None
    return kwargs


def _budget_dict(choice: Mapping[str, Any] | None) -> dict[str, Any]:
    choice = dict(choice or {})
    if choice.get("budgets") is not None:
        choice["budgets"] = [int(budget) for budget in choice["budgets"]]
    return choice


# ------------------------------------------------------------ towers and data


def build_tower(name: str, overrides: Mapping[str, Any], settings: BenchSettings) -> nn.Module:
    """A tower with seeded random weights, cast to ``settings.dtype``, in eval mode.

    Args:
        name: ``vit_b_16``, ``resnet50`` (torchvision), ``packed_vit_small`` or
            ``packed_vit`` (:mod:`lightning_cg.models.packed_vit` presets).
        overrides: constructor fields replaced, e.g. ``num_layers`` of the ViT,
            ``layers`` of the ResNet, any ``PackedViTConfig`` field;
            ``image_size`` is the input side of batch-first towers.
    """
    from torchvision.models.resnet import Bottleneck, ResNet
    from torchvision.models.vision_transformer import VisionTransformer

    overrides = dict(overrides)
    torch.manual_seed(settings.seed)
    with torch.device(settings.device):
        if name == "vit_b_16":
            # torchvision's vit_b_16(weights=None), sizes overridable.
            sizes = dict(patch_size=16, num_layers=12, num_heads=12, hidden_dim=768, mlp_dim=3072)
            tower = VisionTransformer(**{**sizes, **overrides})
        elif name == "resnet50":
            overrides.pop("image_size", None)
            layers = list(overrides.pop("layers", [3, 4, 6, 3]))
            tower = ResNet(Bottleneck, layers, **overrides)  # resnet50(weights=None)
        elif name == "packed_vit_small":
            tower = PackedViT(packed_vit_small_config(**overrides))
        elif name == "packed_vit":
            tower = PackedViT(packed_vit_config(**overrides))
        else:
            raise ValueError(f"unknown tower {name!r}; allowed: {', '.join(WORKLOADS[:-1])}")
    return tower.to(settings.dtype).eval()


@dataclass
class Workload:
    """Batches one pass runs, in order, with the tower they are for.

    Attributes:
        name: ``<tower>/<scenario>`` or ``stream/<tower>``.
        batches: call arguments of each batch: ``(x,)`` or ``(pixel_patches, grid_thw)``.
        images: images in one pass.
        stream: every batch has a distinct shape; ``total_s`` is the headline.
    """

    name: str
    batches: list[Batch]
    images: int
    stream: bool = False


def tower_workloads(tower_name: str, tower: nn.Module, settings: BenchSettings) -> list[Workload]:
    """The workloads of one tower: its batch sizes, or the packed scenarios."""
    if tower_name in BATCHED_TOWERS:
        side = settings.sizes["towers"][tower_name]["image_size"]
        return [
            Workload(f"{tower_name}/batch_{size}", [_batched(size, side, settings)], size)
            for size in settings.batch_sizes
        ]
    workloads = []
    for scenario in settings.scenarios:
        if scenario == "photos":
            batches = _photo_batches(tower, settings)
        else:
            per_batch, sides = SCENARIOS[scenario]
            count = per_batch * settings.packed[f"{scenario}_batches"]
            images = _images(tower, count, settings.sizes[sides], _Random(settings.seed))
            batches = [
                _packed(images[start : start + per_batch], tower, settings)
                for start in range(0, count, per_batch)
            ]
        workloads.append(Workload(f"{tower_name}/{scenario}", batches, _count_images(batches)))
    return workloads


def stream_workload(tower_name: str, tower: nn.Module, settings: BenchSettings) -> Workload:
    """``stream.shapes`` batches of pairwise distinct input shapes.

    Batch-first towers: batch sizes 1 to ``stream.shapes``, shuffled. Packed
    towers: 1 to ``stream.max_images`` images of random sides per batch, no two
    batches with the same number of patches.
    """
    shapes = settings.stream["shapes"]
    random_state = _Random(settings.seed)
    name = f"{STREAM}/{tower_name}"
    if tower_name in BATCHED_TOWERS:
        side = settings.sizes["towers"][tower_name]["image_size"]
        sizes = random_state.rng.sample(range(1, shapes + 1), shapes)
        batches = [_batched(size, side, settings, random_state.generator) for size in sizes]
        return Workload(name, batches, sum(sizes), stream=True)
    batches, seen = [], set()
    for _ in range(100 * shapes):
        count = random_state.rng.randint(1, settings.stream["max_images"])
        images = _images(tower, count, settings.sizes["stream_sides"], random_state)
        pixels = sum(image.shape[-2] * image.shape[-1] for image in images)
        if pixels not in seen:
            seen.add(pixels)
            batches.append(_packed(images, tower, settings))
        if len(batches) == shapes:
            return Workload(name, batches, _count_images(batches), stream=True)
    raise ValueError(
        f"found only {len(batches)} distinct batch shapes of stream.shapes={shapes}: widen "
        "sizes.stream_sides or raise stream.max_images"
    )


class _Random:
    """Seeded sources of sizes (``rng``) and pixels (``generator``)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.generator = torch.Generator().manual_seed(seed)


def _batched(
    size: int, side: int, settings: BenchSettings, generator: torch.Generator | None = None
) -> Batch:
    generator = generator or torch.Generator().manual_seed(settings.seed)
    x = torch.randn(size, 3, side, side, generator=generator)
    return (x.to(settings.device, settings.dtype),)


def _grid_multiple(tower: PackedViT) -> int:
    return tower.config.patch_size * tower.config.spatial_merge_size


def _images(
    tower: PackedViT, count: int, sides: Sequence[int], random_state: _Random
) -> list[torch.Tensor]:
    """``count`` standard-normal images ``[3, H, W]``, sides multiples of the tower's grid
    within ``sides = [min, max]``."""
    multiple = _grid_multiple(tower)
    low, high = max(1, -(-sides[0] // multiple)), max(1, sides[1] // multiple)
    rng, generator = random_state.rng, random_state.generator
    grids = [(rng.randint(low, high), rng.randint(low, high)) for _ in range(count)]
    return [torch.randn(3, h * multiple, w * multiple, generator=generator) for h, w in grids]


def _packed(images: Sequence[torch.Tensor], tower: PackedViT, settings: BenchSettings) -> Batch:
    config = tower.config
    patches, grid_thw = patchify(images, config.patch_size, config.spatial_merge_size)
    # grid_thw stays on the host, where the tower and the adapter read it.
    return patches.to(settings.device, settings.dtype), grid_thw


def _count_images(batches: Sequence[Batch]) -> int:
    return sum(len(grid_thw) for _, grid_thw in batches)


def _photo_batches(tower: PackedViT, settings: BenchSettings) -> list[Batch]:
    photos = _load_photos(_grid_multiple(tower), settings.sizes["photos_max_side"])
    per_batch = settings.packed["photos_per_batch"]
    return [
        _packed(photos[start : start + per_batch], tower, settings)
        for start in range(0, len(photos), per_batch)
    ]


def _load_photos(multiple: int, max_side: int | None) -> list[torch.Tensor]:
    """The bundled real photos, sides rounded down to ``multiple``, longest side capped."""
    try:
        from lightning_cg.data.photos import load_photos
    except ImportError:
        return _skimage_photos(multiple, max_side)
    return load_photos(multiple, max_side)


def _skimage_photos(multiple: int, max_side: int | None) -> list[torch.Tensor]:
    from skimage import data

    photos = []
    for name in ("astronaut", "chelsea", "coffee", "rocket"):
        image = torch.from_numpy(getattr(data, name)()).permute(2, 0, 1).float() / 255.0
        height, width = image.shape[-2:]
        scale = min(1.0, max_side / max(height, width)) if max_side else 1.0
        size = [max(multiple, int(side * scale) // multiple * multiple) for side in (height, width)]
        photos.append(F.interpolate(image[None], size=size, mode="bilinear", antialias=True)[0])
    return photos


# ------------------------------------------------------------------- methods


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


MethodFn = Callable[[nn.Module, Workload, BenchSettings], Runner]


def eager_method(tower: nn.Module, workload: Workload, settings: BenchSettings) -> Runner:
    """The tower as it is."""
    return Runner(step=lambda index: tower(*workload.batches[index]))


def graph_method(
    tower: nn.Module, workload: Workload, settings: BenchSettings, mode: str = "full"
) -> Runner:
    """Through :class:`EncoderGraphManager` on ``adapter_for(tower)``; captures lazily.

    An ``auto`` ladder is learned from the item sizes of every batch of the
    workload, read without running the tower, as a dataset's sizes would be.
    """
    manager = EncoderGraphManager(
        adapter_for(tower), mode=mode, **_manager_kwargs(settings.manager)
    )
    encoder = manager.encoder
    manager.learn_budgets(
        [
            [spec.path_tokens for spec in encoder.item_specs(encoder.inputs_from_call(batch, {}))]
            for batch in workload.batches
        ]
    )

    def step(index: int) -> object:
        return manager.execute(encoder.inputs_from_call(workload.batches[index], {}))

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
    for batch in workload.batches:
        inputs = encoder.inputs_from_call(batch, {})
        specs = encoder.item_specs(inputs)
        batch_graphs = []
        for path in encoder.graph_config().paths:
            if sum(spec.path_tokens.get(path, 0) for spec in specs):
                # Metadata may come on the host; the graph reads it on the device.
                buffers = {
                    name: rows.to(settings.device)
                    for name, rows in encoder.replay_inputs(path, inputs).items()
                }
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


def compile_method(tower: nn.Module, workload: Workload, settings: BenchSettings) -> Runner:
    """``torch.compile(tower, mode="reduce-overhead")``, compiled afresh for this workload."""
    torch._dynamo.reset()
    compiled = torch.compile(tower, mode="reduce-overhead")

    def step(index: int) -> object:
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*workload.batches[index])

    note = "capture_s: first pass minus a steady pass (compilation and recording)"
    return Runner(step=step, setup_in_first_pass=True, close=torch._dynamo.reset, note=note)


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


# ------------------------------------------------------------------- timing


def measure(
    method: Method, tower: nn.Module, workload: Workload, settings: BenchSettings
) -> dict[str, Any]:
    """Time one method on one workload; returns its row (ratios come later)."""
    row = _empty_row(workload, method.name, settings)
    if method.family in settings.skip_methods:
        row["status"] = f"skipped: skip_methods of the {settings.profile} profile"
        return row
    if method.needs_cuda and settings.device.type != "cuda":
        row["status"] = NEEDS_CUDA
        return row
    cuda = settings.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else _no_sync
    warmup, repeats = settings.warmup, settings.repeats
    if workload.stream:
        warmup, repeats = settings.stream["warmup"], settings.stream["repeats"]
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    reserved_before = _reserved()
    batches = len(workload.batches)
    with torch.inference_mode():
        started = time.perf_counter()
        runner = method.build(tower, workload, settings)
        try:
            first_pass = _timed_pass(runner.step, batches, sync)
            total_s = time.perf_counter() - started
            reserved_after_first = _reserved()
            for _ in range(warmup):
                _timed_pass(runner.step, batches, sync)
            if runner.manager is not None:
                runner.manager.reset_stats()
            passes = [_timed_pass(runner.step, batches, sync) for _ in range(repeats)]
        finally:
            if runner.close is not None:
                runner.close()
    pass_s = statistics.median(passes)
    row.update(
        ms_per_batch=1e3 * pass_s / batches,
        images_per_s=workload.images / pass_s,
        padding_waste=0.0,
        capture_s=runner.capture_s,
        pool_bytes=runner.pool_bytes,
        peak_mem_bytes=torch.cuda.max_memory_allocated() if cuda else None,
        total_s=total_s,
        status="ok",
        note=runner.note,
    )
    if runner.setup_in_first_pass:
        row.update(
            capture_s=max(0.0, first_pass - pass_s),
            pool_bytes=max(0, reserved_after_first - reserved_before),
        )
    if runner.manager is not None:
        stats = runner.manager.stats
        decisions = runner.manager.decision_table()
        for decision in decisions:
            log.info("%s %s decision table: %s", workload.name, method.name, decision)
        row.update(
            padding_waste=stats.padding_waste,
            hit_rate=stats.hit_rate,
            host_us_per_replay=stats.host_us_per_replay,
            decision_table=decisions or None,
            capture_s=stats.capture_seconds,
            pool_bytes=stats.pool_bytes if cuda else None,
            status="ok" if cuda else CPU_PATH,
        )
    return row


def _timed_pass(step: Callable[[int], object], batches: int, sync: Callable[[], None]) -> float:
    sync()
    started = time.perf_counter()
    for index in range(batches):
        step(index)
    sync()
    return time.perf_counter() - started


def _no_sync() -> None:
    pass


def _reserved() -> int:
    return torch.cuda.memory_reserved() if torch.cuda.is_available() else 0


def _empty_row(workload: Workload, method: str, settings: BenchSettings) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(ROW_KEYS)
    device = settings.device
    row.update(
        workload=workload.name,
        method=method,
        images=workload.images,
        batches=len(workload.batches),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        dtype=str(settings.dtype).removeprefix("torch."),
        note="",
    )
    return row


# ---------------------------------------------------------------------- run


def run_benchmarks(settings: BenchSettings) -> list[dict[str, Any]]:
    """Every configured method on every configured workload; rows with ratios.

    One tower is alive at a time; methods run one after another on its workloads.
    """
    rows = []
    methods = expand_methods(settings)
    for name in settings.workloads:
        tower_name = settings.stream["tower"] if name == STREAM else name
        tower = build_tower(tower_name, settings.sizes["towers"][tower_name], settings)
        if name == STREAM:
            workloads = [stream_workload(tower_name, tower, settings)]
        else:
            workloads = tower_workloads(tower_name, tower, settings)
        for workload in workloads:
            for method in methods:
                row = _measure_safely(method, tower, workload, settings)
                rows.append(row)
                log.info(
                    "%s %s: %s ms/batch (%s)",
                    row["workload"],
                    row["method"],
                    _fmt(row["ms_per_batch"]),
                    row["status"],
                )
        del tower, workloads
        _free_memory()
    return add_ratios(rows)


def _measure_safely(
    method: Method, tower: nn.Module, workload: Workload, settings: BenchSettings
) -> dict[str, Any]:
    try:
        return measure(method, tower, workload, settings)
    except Exception as error:
        if settings.fail_fast:
            raise
        log.exception("%s %s failed", workload.name, method.name)
        row = _empty_row(workload, method.name, settings)
        row["status"] = f"error: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
        return row
    finally:
        _free_memory()


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def add_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fill ``vs_eager`` (eager time / time: speed-up) and ``vs_exact`` (time / exact
    time: cost over the limit) from the rows of the same workload."""
    reference: dict[tuple[str, str], float] = {
        (row["workload"], row["method"]): row["ms_per_batch"]
        for row in rows
        if row["method"] in ("eager", "exact") and row["ms_per_batch"]
    }
    for row in rows:
        ms = row["ms_per_batch"]
        eager = reference.get((row["workload"], "eager"))
        exact = reference.get((row["workload"], "exact"))
        row["vs_eager"] = eager / ms if ms and eager else None
        row["vs_exact"] = ms / exact if ms and exact else None
    return rows


# ------------------------------------------------------------------- report


def write_json(rows: list[dict[str, Any]], path: Path, meta: Mapping[str, Any]) -> None:
    """The rows as a JSON list at ``path``; run metadata beside it as ``<stem>.meta.json``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1) + "\n")
    path.with_suffix(".meta.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")


def plot_speedups(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Bars of speed-up over eager per workload and method; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot (render it later with from_json=[...])")
        return None
    workloads = list(dict.fromkeys(row["workload"] for row in rows))
    speedups = {(row["workload"], row["method"]): row["vs_eager"] for row in rows}
    methods = list(
        dict.fromkeys(row["method"] for row in rows if row["method"] != "eager" and row["vs_eager"])
    )
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(workloads) * max(1, len(methods))), 4.5))
    for offset, method in enumerate(methods):
        values = [speedups.get((name, method)) or float("nan") for name in workloads]
        positions = [
            index + (offset - (len(methods) - 1) / 2) * width for index in range(len(workloads))
        ]
        ax.bar(positions, values, width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(workloads)), workloads, rotation=40, ha="right")
    ax.set_ylabel("speed-up over eager (x)")
    devices = ", ".join(sorted({f"{row['device']} {row['dtype']}" for row in rows}))
    ax.set_title(f"lightning-cg benchmark: {devices}")
    if methods:
        ax.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


TABLE_COLUMNS = (
    ("workload", "workload"),
    ("method", "method"),
    ("ms_per_batch", "ms/batch"),
    ("images_per_s", "img/s"),
    ("vs_eager", "vs eager"),
    ("vs_exact", "vs exact"),
    ("padding_waste", "pad"),
    ("host_us_per_replay", "host us"),
    ("capture_s", "capture s"),
    ("total_s", "total s"),
    ("pool_bytes", "pool MiB"),
    ("peak_mem_bytes", "peak MiB"),
    ("status", "status"),
)


def format_table(rows: list[dict[str, Any]]) -> list[list[str]]:
    """The printed table's cells: a header, then one line per row."""
    lines = [[title for _, title in TABLE_COLUMNS]]
    for row in rows:
        cells = []
        for key, _ in TABLE_COLUMNS:
            value = row.get(key)
            if key.endswith("_bytes") and value is not None:
                value = value / 2**20
            cells.append(_fmt(value) if key not in ("workload", "method", "status") else value)
        lines.append(cells)
    return lines


def print_table(rows: list[dict[str, Any]]) -> None:
    """The rows as a rich table (plain text without rich)."""
    header, *lines = format_table(rows)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(str(line[i])) for line in [header, *lines]) for i in range(len(header))]
        for line in [header, *lines]:
            print(
                "  ".join(str(cell).ljust(width) for cell, width in zip(line, widths, strict=True))
            )
        return
    table = Table(
        title="lightning-cg benchmark (vs eager: speed-up; vs exact: time over the limit)"
    )
    for index, title in enumerate(header):
        table.add_column(
            title, justify="left" if index < 2 or index == len(header) - 1 else "right"
        )
    for line in lines:
        table.add_row(*line)
    Console(width=200).print(table)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def load_rows(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """Rows of earlier runs, later files replacing rows of the same workload and method."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for path in paths:
        for row in json.loads(Path(path).read_text()):
            rows[(row["workload"], row["method"])] = row
    return add_ratios(list(rows.values()))


def environment() -> dict[str, Any]:
    """Versions and device of this process, for the ``.meta.json`` file."""
    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "python": sys.version.split()[0],
        "argv": sys.argv,
    }


def main(config: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Run (or, with ``from_json``, re-render) the benchmark and write its report.

    Args:
        config: the fields of ``conf/bench.yaml`` as plain Python values.

    Returns:
        The rows written to ``config["output"]``.
    """
    sources = list(config.get("from_json") or [])
    if sources:
        rows = load_rows(sources)
        meta: dict[str, Any] = {"from_json": sources}
    else:
        settings = resolve_settings(config)
        rows = run_benchmarks(settings)
        meta = {**environment(), "config": dict(config)}
    output = Path(config["output"])
    write_json(rows, output, meta)
    plot = plot_speedups(rows, Path(config["plot"])) if config.get("plot") else None
    print_table(rows)
    log.info("wrote %s%s", output, f" and {plot}" if plot else "")
    return rows
