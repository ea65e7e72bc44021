"""The Hydra apps' work as plain functions (build, run, report); ``scripts/`` wrap :func:`run`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Column, Table
from torch import nn

# Also registers the apps' config schema with Hydra.
from lightning_cg.app.preflight import ConfigError, check_config, check_tower
from lightning_cg.callback.graph_callback import CUDAGraphCallback

STAGES = ("predict", "validate", "test", "fit")
#: Passes over the data on a GPU when ``passes`` is null: enough for the steady state.
GPU_PASSES = 5
#: Passes the report shows one by one; more are summed up after the second.
PASS_ROWS = 10


@dataclass
class PassReport:
    """One pass over the data (one Trainer call): seconds inside the tower (synchronized),
    seconds of the whole call, and the callback's ``last_stats`` after it."""

    tower_seconds: float
    wall_seconds: float
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class RunReport:
    """What one app run's passes did, with the callback and, if asked, eagerly: wall seconds
    of all passes, the callback's stats of the last, every pass's outputs in turn."""

    stage: str
    seconds: float
    stats: dict[str, float]
    outputs: list = field(default_factory=list)
    eager_seconds: float | None = None
    max_abs_difference: float | None = None
    device: str = "cpu"
    passes: list[PassReport] = field(default_factory=list)
    eager_passes: list[PassReport] | None = None


class TowerClock:
    """Seconds spent in a module's forward, synchronized around every call (a context manager).

    Forward hooks, so it also times a forward the callback swapped in."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.seconds = 0.0

    def __enter__(self) -> TowerClock:
        self._handles = [
            self.module.register_forward_pre_hook(self._start),
            self.module.register_forward_hook(self._stop),
        ]
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self._handles:
            handle.remove()

    def _start(self, *hook_args: object) -> None:
        _synchronize()
        self._started = time.perf_counter()

    def _stop(self, *hook_args: object) -> None:
        _synchronize()
        self.seconds += time.perf_counter() - self._started


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


def run_app(cfg: DictConfig, stage: str) -> None:
    """An app's Hydra main: :func:`run` ``stage`` and print its report; a config refused
    before any work exits with its message, without a traceback."""
    try:
        report = run(cfg, stage)
    except ConfigError as error:
        raise SystemExit(f"error: {error}") from None
    print_report(report)


def run(cfg: DictConfig, stage: str) -> RunReport:
    """Run ``stage`` (predict, validate, test or fit) with the callback; optionally eagerly too.

    Stages other than ``fit`` run ``cfg.passes`` Trainer calls (null: :data:`GPU_PASSES` on a
    GPU, else 1), after one untimed eager batch on a GPU; ``cfg.compare_eager`` (null: on a GPU)
    repeats them without the callback. A config that cannot work is refused first."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {', '.join(STAGES)}; got {stage!r}")
    checked_callback = check_config(cfg, stage)
    model, datamodule = build(cfg)
    tower = check_tower(cfg, model, checked_callback)
    trainer, callback = make_trainer(cfg)
    on_gpu, evaluating = trainer.strategy.root_device.type == "cuda", stage != "fit"
    # passes (null: auto) and compare_eager are checked by check_config.
    passes = (cfg.get("passes", 1) or (GPU_PASSES if on_gpu else 1)) if evaluating else 1
    if on_gpu and evaluating:
        # One untimed eager batch, so that neither method's first pass pays for the GPU's start.
        limit = "limit_val_batches" if stage == "validate" else f"limit_{stage}_batches"
        _timed(instantiate(cfg.trainer, callbacks=[], **{limit: 1}), stage, model, datamodule)

    def run_passes(trainer: pl.Trainer, callback: CUDAGraphCallback | None = None) -> tuple:
        """Each pass's report, every pass's outputs, and the wall seconds of all passes."""
        reports, outputs = [], []
        with TowerClock(tower) as clock:
            for _ in range(passes):
                clock.seconds = 0.0
                seconds, pass_outputs = _timed(trainer, stage, model, datamodule)
                stats = dict(callback.last_stats) if callback else {}
                reports.append(PassReport(clock.seconds, seconds, stats))
                outputs += pass_outputs or []
        return reports, outputs, sum(report.wall_seconds for report in reports)

    pass_reports, outputs, seconds = run_passes(trainer, callback)
    report = RunReport(
        stage,
        seconds,
        dict(callback.last_stats),
        outputs,
        device=str(trainer.strategy.root_device),
        passes=pass_reports,
    )
    compare_eager = cfg.get("compare_eager")
    if (on_gpu if compare_eager is None else compare_eager) and evaluating:
        eager_trainer, _ = make_trainer(cfg, with_callback=False)
        report.eager_passes, eager_outputs, report.eager_seconds = run_passes(eager_trainer)
        report.max_abs_difference = _max_abs_difference(outputs, eager_outputs)
    return report


def _timed(trainer: pl.Trainer, stage: str, model, datamodule) -> tuple[float, list | None]:
    # Data loading (photos decoded on first setup) stays out of the timing.
    datamodule.setup(stage)
    _synchronize()
    started = time.perf_counter()
    quiet = {"verbose": False} if stage in ("validate", "test") else {}
    outputs = getattr(trainer, stage)(model, datamodule=datamodule, **quiet)
    _synchronize()
    return time.perf_counter() - started, outputs


def _max_abs_difference(graphed: list, eager: list) -> float:
    """Largest difference between the passes' outputs: predictions, or returned metrics."""
    differences = [
        (a.float() - b.float()).abs().max().item()
        if isinstance(a, torch.Tensor)
        else max((abs(a[name] - b[name]) for name in a), default=0.0)
        for a, b in zip(graphed, eager, strict=True)
    ]
    return max(differences, default=0.0)


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@rank_zero_only
def print_report(report: RunReport, console: Console | None = None) -> None:
    """The run's table, the tower seconds of its passes against eager, and its capture.

    Rank 0 only: under DDP every rank holds the same summed stats."""
    console = console or Console()
    on_gpu = report.device.startswith("cuda")
    console.print(_run_table(report, on_gpu))
    if report.stage != "fit" and (len(report.passes) > 1 or report.eager_passes is not None):
        console.print(_pass_table(report))
    if on_gpu:
        graphs = [int(times.stats["graphs_captured"]) for times in report.passes]
        seconds = sum(times.stats["capture_seconds_run"] for times in report.passes)
        console.print(
            f"capture: {sum(graphs)} graphs in {seconds:.2f} s (graphs per pass: "
            f"{', '.join(map(str, graphs))}); the tower seconds above include it"
        )
    else:
        console.print(
            "The tower ran on the CPU: CUDA graphs need a CUDA device, so the callback ran "
            "its CPU path (eager, or the padded budget path; nothing captured or replayed)."
        )


def _run_table(report: RunReport, on_gpu: bool) -> Table:
    stats, count = report.stats, len(report.passes)
    images = int(stats.get("items", 0))
    title = f"lightning-cg {report.stage}" + (f", pass {count} of {count}" if count > 1 else "")
    counts = {"images": "items", "tokens": "tokens", "sub-batches": "sub_batches"}
    if on_gpu:
        counts |= {"graph replays": "hits", "eager runs": "misses"}
    rows = [(name, f"{int(stats.get(key, 0))}") for name, key in counts.items()]
    rows.append(("padding waste", f"{stats.get('padding_waste', 0.0):.1%}"))
    if report.stage != "fit" and images:
        tower_ms = 1000 * report.passes[-1].tower_seconds / images
        rows.append(("tower ms per image", f"{tower_ms:.2f}"))
    rows.append(("wall seconds" + (", all passes" if count > 1 else ""), f"{report.seconds:.2f}"))
    if report.eager_seconds is not None:
        rows += [
            ("eager wall seconds", f"{report.eager_seconds:.2f}"),
            ("largest |callback - eager|", f"{report.max_abs_difference:.3e}"),
        ]
    table = Table("measure", Column("value", justify="right"), title=title)
    for row in rows:
        table.add_row(*row)
    return table


def _pass_table(report: RunReport) -> Table:
    """Tower seconds of every pass (or of passes 1, 2 and the mean of the rest), against eager."""
    eager, count = report.eager_passes, len(report.passes)
    columns = {} if eager is None else {"eager": eager}
    columns["lightning-cg"] = report.passes
    headers = [*columns] + ([] if eager is None else ["vs eager"])
    table = Table(
        "pass", *(Column(name, justify="right") for name in headers), title="tower seconds per pass"
    )
    groups = [(f"{index + 1}", slice(index, index + 1)) for index in range(count)]
    if count > PASS_ROWS:
        groups = [("1", slice(0, 1)), ("2", slice(1, 2)), (f"3-{count}, mean", slice(2, count))]
    for label, rows in groups:
        chosen = [passes[rows] for passes in columns.values()]
        seconds = [sum(times.tower_seconds for times in group) / len(group) for group in chosen]
        cells = [f"{value:.3f}" for value in seconds]
        if eager is not None:
            cells.append(f"{seconds[0] / seconds[1]:.2f}x" if seconds[1] else "-")
        table.add_row(label, *cells)
    return table
