"""Trainer runs of one workload with one method: eager, the callback, or torch.compile.

Each method gets its own copy of the workload's tower (the same seeded
weights), its own :class:`~bench.trainer.module.UserModule` and Trainer, and
runs ``trainer.predict`` twice on one set of batches: the first run pays for
capture or compilation, the second shows what a later run costs. With a fresh
Trainer it also runs a third time on a new Trainer (same module and callback).
A multiscale workload runs ``trainer.validate`` four times the same way
(``first`` to ``fourth``), keeping the tower outputs of its steps.
A fit runs ``trainer.fit`` with a validation loop each epoch.
"""

from __future__ import annotations

import copy
import gc
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from bench.trainer.module import RunClock, RunRecord, UserModule
from bench.trainer.workloads import SyntheticBatches
from lightning_cg import CUDAGraphCallback

EAGER, CALLBACK, COMPILE = "eager", "callback", "compile"
METHODS = (EAGER, CALLBACK, COMPILE)
#: The runs of :func:`validate_runs` and the names of :func:`predict_runs`' runs, in order.
RUN_NAMES = ("first", "second", "third", "fourth")


@dataclass(frozen=True)
class TrainerSettings:
    """How the Trainers of a benchmark are built.

    Attributes:
        device: ``cuda`` or ``cpu``.
        precision: a Lightning precision, e.g. ``bf16-mixed`` or ``32-true``.
        callback_kwargs: :class:`~lightning_cg.CUDAGraphCallback` arguments
            besides ``module``.
    """

    device: str
    precision: str
    callback_kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class PredictRun:
    """One ``trainer.predict`` call (or ``trainer.validate``, see :func:`validate_runs`):
    its record, wall time around the call, and outputs (one tensor per batch)."""

    record: RunRecord
    call_s: float
    outputs: list[torch.Tensor]


def predict_runs(
    tower: nn.Module,
    batches: SyntheticBatches,
    method: str,
    settings: TrainerSettings,
    fresh_trainer: bool = False,
    runs_count: int = 2,
) -> dict[str, PredictRun]:
    """The ``first`` to ``runs_count``-th predict runs of ``method`` (named as
    :data:`RUN_NAMES`), and ``second_fresh`` if asked.

    Args:
        tower: the workload's tower; the method runs a deep copy of it.
        batches: what every run predicts on.
        method: ``eager``, ``callback`` or ``compile``.
        settings: device, precision and callback arguments.
        fresh_trainer: also run once more on a new Trainer.
        runs_count: runs on the one Trainer, 2 to 4.
    """
    module, callback = _module_and_callback(tower, method, settings)
    clock = RunClock(callback)
    trainer = make_trainer(settings, [callback, clock] if callback else [clock])
    runs = {}
    names = [*RUN_NAMES[:runs_count]] + (["second_fresh"] if fresh_trainer else [])
    for name in names:
        if name == "second_fresh":
            trainer = make_trainer(settings, [callback, clock] if callback else [clock])
        started = time.perf_counter()
        outputs = trainer.predict(module, dataloaders=batches.loader())
        runs[name] = PredictRun(clock.records[-1], time.perf_counter() - started, outputs)
    return runs


def validate_runs(
    tower: nn.Module,
    batches: SyntheticBatches,
    method: str,
    settings: TrainerSettings,
) -> dict[str, PredictRun]:
    """The ``first`` to ``fourth`` validation runs of ``method``:
    one module, one callback and one Trainer, ``trainer.validate`` four times.

    Each run's outputs are the tower outputs of its validation steps (one
    embedding per image, batch by batch), as a predict run returns them.

    Args:
        tower: the workload's tower; the method runs a deep copy of it.
        batches: what every run validates on.
        method: ``eager``, ``callback`` or ``compile``.
        settings: device, precision and callback arguments.
    """
    module, callback = _module_and_callback(tower, method, settings)
    clock = RunClock(callback)
    trainer = make_trainer(settings, [callback, clock] if callback else [clock])
    runs = {}
    for name in RUN_NAMES:
        module.val_outputs = []
        started = time.perf_counter()
        trainer.validate(module, dataloaders=batches.loader(), verbose=False)
        call_s = time.perf_counter() - started
        runs[name] = PredictRun(clock.records[-1], call_s, module.val_outputs)
        module.val_outputs = None
    return runs


def fit_runs(
    tower: nn.Module,
    train_batches: SyntheticBatches,
    val_batches: SyntheticBatches,
    method: str,
    settings: TrainerSettings,
    epochs: int,
) -> tuple[list[RunRecord], float, list[float]]:
    """The validation runs of ``trainer.fit`` for ``epochs`` epochs, the wall time of the
    fit, and each training epoch's peak device memory allocated (MiB; empty off CUDA).

    Args:
        tower: the workload's tower; the method trains a deep copy of it.
        train_batches: the training batches of one epoch.
        val_batches: the validation batches of one epoch.
        method: ``eager`` or ``callback``.
        settings: device, precision and callback arguments.
        epochs: epochs to train, each followed by a validation run.
    """
    module, callback = _module_and_callback(tower, method, settings)
    module.train()  # the tower comes in eval mode; Lightning keeps the modes it finds
    clock = RunClock(callback)
    trainer = make_trainer(settings, [callback, clock] if callback else [clock], max_epochs=epochs)
    started = time.perf_counter()
    trainer.fit(module, train_batches.loader(), val_batches.loader())
    fit_s = time.perf_counter() - started
    return clock.records, fit_s, clock.train_peaks_mib


def make_trainer(
    settings: TrainerSettings, callbacks: list[pl.Callback], devices: int = 1, **kwargs
) -> pl.Trainer:
    """A quiet Trainer on ``devices`` devices: no logger, checkpoint, summary,
    progress bar, sanity check."""
    return pl.Trainer(
        accelerator="gpu" if settings.device == "cuda" else "cpu",
        devices=devices,
        precision=settings.precision,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def release(method: str) -> None:
    """Free what a method's finished runs leave behind: compiled code, graphs, cached memory."""
    if method == COMPILE:
        torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _module_and_callback(
    tower: nn.Module, method: str, settings: TrainerSettings
) -> tuple[UserModule, CUDAGraphCallback | None]:
    if method not in METHODS:
        raise ValueError(f"methods has {method!r}; allowed: {', '.join(METHODS)}")
    torch.manual_seed(0)  # the head's weights, the same for every method
    backbone = copy.deepcopy(tower)
    if method == COMPILE:
        backbone = torch.compile(backbone, mode="reduce-overhead")
    callback = None
    if method == CALLBACK:
        callback = CUDAGraphCallback(module="backbone", **settings.callback_kwargs)
    return UserModule(backbone), callback
