"""The whole Trainer benchmark: every workload, run length and method, rows to a JSON file.

Predict workloads run :func:`~bench.trainer.runs.predict_runs`, multiscale ones
:func:`~bench.trainer.runs.validate_runs` (four ``trainer.validate`` runs),
each for every run length of ``batches`` (or, without it, the workload's own
:attr:`~bench.trainer.workloads.Workload.default_batches`); fit workloads
:func:`~bench.trainer.runs.fit_runs`. With ``check``, each workload's runs are
checked after its rows are written (:mod:`bench.trainer.checks`).
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning
import torch
from torch import nn

from bench.trainer.checks import CheckResult, check_runs, tolerance
from bench.trainer.rows import (
    describe,
    fit_row,
    merge_rows,
    multiscale_rows,
    predict_rows,
    read_rows,
    write_json,
)
from bench.trainer.runs import (
    CALLBACK,
    EAGER,
    TrainerSettings,
    fit_runs,
    predict_runs,
    release,
    validate_runs,
)
from bench.trainer.workloads import Sizes, SyntheticBatches, Workload, make_tower

_AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


@dataclass(frozen=True)
class BenchSettings:
    """One benchmark invocation.

    Attributes:
        workloads: in run order; fit workloads run ``trainer.fit``, multiscale
            ones ``trainer.validate`` four times.
        batches: run lengths of the predict and multiscale workloads, in
            batches; None: each workload's own (``Workload.default_batches``).
        methods: ``eager``, ``callback``, ``compile`` (fits run eager and callback only).
        trainer: device, precision and callback arguments.
        sizes: image sides and tower shapes.
        seed: seeds weights and batches.
        fresh_trainer: predict a third time with a new Trainer (a ``second`` row,
            ``trainer: fresh``).
        predict_runs: ``trainer.predict`` runs per method on one Trainer, 2 to 4.
        repeats: times each method runs its predict runs afresh (a new module,
            callback and Trainer each time), the methods' order alternating;
            a row reports each run's median repeat.
        fit_epochs: epochs of a fit.
        fit_val_batches: validation batches per epoch.
        fit_train_batches: training batches per epoch.
        output: JSON file of the rows; run metadata go beside it (``.meta.json``).
        overwrite: start the file anew instead of merging into its rows.
        check: after each workload, check its runs (:mod:`bench.trainer.checks`)
            and stop with :class:`SystemExit` if they fail.
        check_tolerance: the relative difference of outputs that the check
            allows; None: :func:`~bench.trainer.checks.tolerance` of the precision.
    """

    workloads: list[Workload]
    batches: list[int] | None
    methods: list[str]
    trainer: TrainerSettings
    sizes: Sizes
    seed: int = 0
    fresh_trainer: bool = False
    predict_runs: int = 2
    repeats: int = 1
    fit_epochs: int = 5
    fit_val_batches: int = 50
    fit_train_batches: int = 2
    output: Path = Path("benchmarks/h100-trainer.json")
    overwrite: bool = False
    check: bool = False
    check_tolerance: float | None = None


def run_benchmark(
    settings: BenchSettings, echo: Callable[[str], None] = print
) -> list[dict[str, Any]]:
    """Run every workload; after each, merge its rows into ``settings.output``
    and, with ``settings.check``, check its runs.

    Returns:
        The new rows of this invocation (the file may hold others too).

    Raises:
        SystemExit: with ``settings.check``, a workload's runs failed the check
            (its rows are written first); the message says what failed.
    """
    quiet_lightning()
    rows = [] if settings.overwrite else read_rows(settings.output)
    _write_meta(settings)
    new_rows = []
    for workload in settings.workloads:
        tower = make_tower(workload, settings.sizes, settings.seed)
        checks: list[CheckResult] = []
        if workload.fit:
            workload_rows = [_fit(workload, tower, settings)]
        else:
            workload_rows = []
            for count in settings.batches or workload.default_batches:
                count_rows, check = _predict(workload, tower, count, settings)
                workload_rows += count_rows
                checks += [check] if check is not None else []
        for row in workload_rows:
            echo(describe(row))
        new_rows += workload_rows
        rows = merge_rows(rows, workload_rows)
        write_json(settings.output, rows)
        if settings.check and workload.fit:
            echo(f"check skipped: {workload.name}: a fit keeps no outputs")
        for check in checks:
            if check.ok:
                echo(check.line)
        failed = [check.line for check in checks if not check.ok]
        if failed:
            raise SystemExit("\n".join(failed))
    return new_rows


def _predict(
    workload: Workload, tower: nn.Module, count: int, settings: BenchSettings
) -> tuple[list[dict[str, Any]], CheckResult | None]:
    """The rows of a predict or multiscale workload's runs of ``count`` batches,
    and their check (None without ``settings.check``)."""
    batches = _batches(workload, tower, count, settings.seed, settings)
    repeats: dict[str, list] = {method: [] for method in settings.methods}
    for repeat in range(settings.repeats):
        # Every other repeat in reverse, so that no method always runs first.
        order = settings.methods if repeat % 2 == 0 else settings.methods[::-1]
        for method in order:
            warm_up(tower, batches, settings.trainer.device, settings.trainer.precision)
            if workload.multiscale:
                runs = validate_runs(tower, batches, method, settings.trainer)
            else:
                runs = predict_runs(
                    tower,
                    batches,
                    method,
                    settings.trainer,
                    settings.fresh_trainer,
                    settings.predict_runs,
                )
            repeats[method].append(runs)
            release(method)
    if workload.multiscale:
        sides = settings.sizes.multiscale_sides
        rows = multiscale_rows(workload.name, count, batches.images(), sides, repeats)
    else:
        rows = predict_rows(workload.name, count, batches.images(), repeats)
    check = None
    if settings.check:
        tol = settings.check_tolerance
        tol = tolerance(settings.trainer.precision) if tol is None else tol
        check = check_runs(workload.name, count, repeats, tol)
    return rows, check


def _fit(workload: Workload, tower: nn.Module, settings: BenchSettings) -> dict[str, Any]:
    train = _batches(workload, tower, settings.fit_train_batches, settings.seed + 1, settings)
    val = _batches(workload, tower, settings.fit_val_batches, settings.seed, settings)
    methods = [method for method in settings.methods if method in (EAGER, CALLBACK)]
    results = {}
    for method in methods:
        warm_up(tower, val, settings.trainer.device, settings.trainer.precision)
        results[method] = fit_runs(tower, train, val, method, settings.trainer, settings.fit_epochs)
        release(method)
    return fit_row(workload.name, val.images(), settings.fit_epochs, len(val), results)


def _batches(
    workload: Workload, tower: nn.Module, count: int, seed: int, settings: BenchSettings
) -> SyntheticBatches:
    device = torch.device(settings.trainer.device)
    return SyntheticBatches(workload, tower, count, settings.sizes, seed, device)


def warm_up(tower: nn.Module, batches: SyntheticBatches, device: str, precision: str) -> None:
    """Two eager calls on the first batch (multiscale: of each side) before each
    method, so no method's first run pays for the device's start or for growing
    the memory cache.

    cuBLAS and cuDNN initialize on the first call of a process, and the caching
    allocator, emptied after each method (:func:`release`), would otherwise
    allocate a first batch's activations inside the next method's first run
    alone (eager runs first, right after the warm-up).
    """
    dtype = _AUTOCAST.get(precision)
    tower.to(device)
    for batch in batches.shape_examples():
        packed = "grid_thw" in batch
        inputs = (batch["pixel_patches"], batch["grid_thw"]) if packed else (batch["images"],)
        inputs = tuple(tensor.to(device) for tensor in inputs)  # as Lightning moves a batch
        with torch.inference_mode(), torch.autocast(device, dtype=dtype, enabled=dtype is not None):
            for _ in range(2):
                tower(*inputs)
    tower.cpu()


def quiet_lightning() -> None:
    """Keep Lightning's per-Trainer banners and the data-loader advice out of the output."""
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")


def _write_meta(settings: BenchSettings) -> None:
    meta_path = settings.output.with_suffix(".meta.json")
    invocations = [] if settings.overwrite else read_rows(meta_path)
    invocations.append(
        {
            "command": " ".join(sys.argv),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "torch": torch.__version__,
            "lightning": lightning.__version__,
            "device": torch.cuda.get_device_name() if settings.trainer.device == "cuda" else "cpu",
            "precision": settings.trainer.precision,
            "callback_kwargs": dict(settings.trainer.callback_kwargs),
            "methods": settings.methods,
        }
    )
    write_json(meta_path, invocations)
