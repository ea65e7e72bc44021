"""The Hydra apps' work as plain functions: build from a config, run, report.

``scripts/predict.py``, ``validate.py`` and ``train.py`` are thin entry points
around :func:`run`; tests call it with composed configs.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from lightning_cg.callback import CUDAGraphCallback

STAGES = ("predict", "validate", "fit")
#: ``last_stats`` keys of one run's capture: graphs captured and seconds spent in it.
RUN_CAPTURE_KEYS = ("graphs_captured", "capture_seconds_run")
#: What callbacks without per-run keys report: graphs held, capture seconds since built.
HELD_CAPTURE_KEYS = ("graphs", "capture_seconds")


def run_capture(stats: Mapping[str, float]) -> tuple[int, float, str]:
    """Graphs captured and capture seconds of the run ``stats`` (``last_stats``) describe.

    Reads :data:`RUN_CAPTURE_KEYS`, or :data:`HELD_CAPTURE_KEYS` where they are
    missing; the third value names the keys read, ``graphs/capture_seconds``
    meaning held totals rather than this run's.
    """
    for keys in (RUN_CAPTURE_KEYS, HELD_CAPTURE_KEYS):
        if all(key in stats for key in keys):
            return int(stats[keys[0]]), stats[keys[1]], "/".join(keys)
    return 0, 0.0, "none"


@dataclass
class RunReport:
    """What one run did: the callback's stats, wall time and, if asked, the eager comparison."""

    stage: str
    seconds: float
    stats: dict[str, float]
    outputs: list = field(default_factory=list)
    eager_seconds: float | None = None
    max_abs_difference: float | None = None


def build(cfg: DictConfig) -> tuple[pl.LightningModule, pl.LightningDataModule]:
    """The LightningModule and DataModule of a config, seeded."""
    pl.seed_everything(cfg.seed, verbose=False)
    return instantiate(cfg.model.module), instantiate(cfg.data)


def make_trainer(
    cfg: DictConfig, with_callback: bool = True
) -> tuple[pl.Trainer, CUDAGraphCallback | None]:
    """A Trainer from ``cfg.trainer``, with the config's CUDAGraphCallback appended."""
    callback = instantiate(cfg.cudagraph) if with_callback else None
    trainer = instantiate(cfg.trainer, callbacks=[callback] if callback else [])
    return trainer, callback


def run(cfg: DictConfig, stage: str) -> RunReport:
    """Run ``stage`` (predict, validate or fit) with the callback; optionally eagerly too."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {', '.join(STAGES)}; got {stage!r}")
    model, datamodule = build(cfg)
    trainer, callback = make_trainer(cfg)
    seconds, outputs = _timed(trainer, stage, model, datamodule)
    report = RunReport(stage, seconds, dict(callback.last_stats), outputs or [])
    if cfg.compare_eager and stage != "fit":
        eager_trainer, _ = make_trainer(cfg, with_callback=False)
        report.eager_seconds, eager_outputs = _timed(eager_trainer, stage, model, datamodule)
        report.max_abs_difference = _max_abs_difference(outputs, eager_outputs)
    return report


def _timed(trainer: pl.Trainer, stage: str, model, datamodule) -> tuple[float, list | None]:
    # Data loading (photos decoded on first setup) stays out of the timing.
    datamodule.setup(stage)
    _synchronize()
    started = time.perf_counter()
    if stage == "predict":
        outputs = trainer.predict(model, datamodule=datamodule)
    elif stage == "validate":
        outputs = trainer.validate(model, datamodule=datamodule, verbose=False)
    else:
        outputs = trainer.fit(model, datamodule=datamodule)
    _synchronize()
    return time.perf_counter() - started, outputs


def _max_abs_difference(graphed: list, eager: list) -> float:
    differences = [
        (a.float() - b.float()).abs().max().item()
        if isinstance(a, torch.Tensor)
        else abs(a["val_loss"] - b["val_loss"])
        for a, b in zip(graphed, eager, strict=True)
    ]
    return max(differences, default=0.0)


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@rank_zero_only
def print_report(report: RunReport, console: Console | None = None) -> None:
    """A rich table of the run: images, tokens, graphs, hit rate, padding, time per image.

    Prints on global rank 0 only: under DDP every rank holds the same summed stats.
    """
    console = console or Console()
    stats = report.stats
    images = int(stats.get("items", 0))
    # Capture is a one-off; the steady cost per image leaves it out.
    steady = max(report.seconds - stats.get("capture_seconds", 0.0), 0.0)
    table = Table(title=f"lightning-cg {report.stage}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    rows = [
        ("images", f"{images}"),
        ("tokens", f"{int(stats.get('tokens', 0))}"),
        ("sub-batches", f"{int(stats.get('sub_batches', 0))}"),
        ("graphs captured", f"{int(stats.get('graphs', 0))}"),
        ("capture seconds", f"{stats.get('capture_seconds', 0.0):.2f}"),
        ("hit rate", f"{stats.get('hit_rate', 0.0):.0%}"),
        ("padding waste", f"{stats.get('padding_waste', 0.0):.1%}"),
        ("ms per image (without capture)", f"{1000 * steady / images:.1f}" if images else "-"),
        ("wall seconds", f"{report.seconds:.2f}"),
    ]
    if report.eager_seconds is not None:
        rows += [
            ("eager wall seconds", f"{report.eager_seconds:.2f}"),
            ("largest |graph - eager|", f"{report.max_abs_difference:.3e}"),
        ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    if not torch.cuda.is_available():
        console.print(
            "No CUDA device: graphs need CUDA, so the callback ran its CPU path (no capture)."
        )
