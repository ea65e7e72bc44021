"""A LightningModule as a user writes one, timing its tower, and a clock per Trainer run."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from bench.hf_towers import is_hf_tower, merged_tokens
from examples.models.lit import embed_dim_of, pool_items
from examples.models.packed_vit import tokens_per_item

Batch = dict[str, torch.Tensor]


class UserModule(pl.LightningModule):
    """The tower at ``self.backbone`` under a linear head, called in every step.

    Each tower call is timed with a synchronize on each side: the seconds add
    up in :attr:`tower_seconds`, and each call's are kept in
    :attr:`tower_call_seconds` (both reset by :class:`RunClock` at each run).
    While :attr:`val_outputs` is a list, each validation step appends a copy of
    its tower output (one embedding per image, as a predict step returns it) to
    it, so a validation run's outputs can be compared as a predict run's are. A
    copy, as Lightning's predict loop copies each step's output to the CPU: under
    ``torch.compile(mode="reduce-overhead")`` a later call overwrites the output.
    A transformers tower is called as its users call it: a batch-first one as
    ``backbone(pixel_values=images).pooler_output``, a Qwen vision tower as
    ``backbone(pixel_patches, grid_thw=grid_thw).pooler_output`` (its merged tokens).

    Args:
        backbone: the tower, a batch-first one (``backbone(images)``) or a packed
            one (``backbone(pixel_patches, grid_thw)`` with a ``config``), or a
            transformers tower; it may be a ``torch.compile``'d module.
        num_classes: classes of the head.
        lr: AdamW learning rate.
    """

    def __init__(self, backbone: nn.Module, num_classes: int = 10, lr: float = 1e-4) -> None:
        super().__init__()
        self.backbone = backbone
        tower = getattr(backbone, "_orig_mod", backbone)  # the module under torch.compile
        self.packed_config = getattr(tower, "config", None)
        self.transformers = is_hf_tower(tower)
        # A transformers tower's pooler output is config.hidden_size wide (Qwen: the merger's).
        width = tower.config.hidden_size if self.transformers else embed_dim_of(tower)
        self.head = nn.Linear(width, num_classes)
        self.lr = lr
        self.tower_seconds = 0.0
        self.tower_calls = 0
        self.tower_call_seconds: list[float] = []
        self.val_outputs: list[torch.Tensor] | None = None

    def embed(self, batch: Batch) -> torch.Tensor:
        """One embedding per image: the tower's output, packed rows averaged per image."""
        if "pixel_patches" in batch:
            tokens = self._timed_tower(self._packed_call, batch["pixel_patches"], batch["grid_thw"])
            return pool_items(tokens, self._tokens_per_item(batch["grid_thw"]))
        return self._timed_tower(self._batched_call, batch["images"]).flatten(1)

    def predict_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        return self.embed(batch)

    def validation_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        embedding = self.embed(batch)
        if self.val_outputs is not None:
            self.val_outputs.append(embedding.detach().clone())
        loss = self._loss(embedding, batch)
        self.log("val_loss", loss, batch_size=len(batch["targets"]))
        return loss

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        return self._loss(self.embed(batch), batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def _loss(self, embedding: torch.Tensor, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(self.head(embedding).float(), batch["targets"])

    def _packed_call(self, pixel_patches: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        if self.transformers:
            return self.backbone(pixel_patches, grid_thw=grid_thw).pooler_output
        return self.backbone(pixel_patches, grid_thw)

    def _batched_call(self, images: torch.Tensor) -> torch.Tensor:
        if self.transformers:
            return self.backbone(pixel_values=images).pooler_output
        return self.backbone(images)

    def _tokens_per_item(self, grid_thw: torch.Tensor) -> list[int]:
        if self.transformers:
            return merged_tokens(grid_thw, self.packed_config.spatial_merge_size)
        return tokens_per_item(grid_thw, self.packed_config)

    def _timed_tower(
        self, call: Callable[..., torch.Tensor], *inputs: torch.Tensor
    ) -> torch.Tensor:
        _synchronize(self.device)
        started = time.perf_counter()
        outputs = call(*inputs)
        _synchronize(self.device)
        seconds = time.perf_counter() - started
        self.tower_seconds += seconds
        self.tower_calls += 1
        self.tower_call_seconds.append(seconds)
        return outputs


@dataclass
class RunRecord:
    """One validation or predict run of a Trainer.

    Attributes:
        tower_s: seconds inside the tower, summed over the run's calls.
        wall_s: seconds from the run's start hook to its end hook.
        calls: tower calls.
        graphs_captured: graphs the callback captured (None without a callback).
        capture_s: seconds of capture (None without a callback).
        stats: the callback's ``last_stats`` after the run.
        first_call_s: seconds of the run's first tower call (None without calls):
            what a run pays once shows here, apart from the calls that follow.
        median_call_s: the median seconds of the run's tower calls (None without calls).
        peak_mib: peak device memory allocated during the run, in MiB (None off CUDA):
            what the graphs hold plus the run's own activations.
    """

    tower_s: float
    wall_s: float
    calls: int
    graphs_captured: float | None = None
    capture_s: float | None = None
    stats: dict[str, float] = field(default_factory=dict)
    first_call_s: float | None = None
    median_call_s: float | None = None
    peak_mib: float | None = None


class RunClock(pl.Callback):
    """Records a :class:`RunRecord` per validation and predict run of a :class:`UserModule`.

    Place it after the CUDA graph callback so that its ``last_stats`` are
    those of the run that just ended.

    Args:
        graph_callback: the callback whose ``last_stats`` to read, if any.
    """

    def __init__(self, graph_callback: pl.Callback | None = None) -> None:
        self.graph_callback = graph_callback
        self.records: list[RunRecord] = []
        #: Peak device memory allocated in each training epoch (MiB; CUDA only).
        self.train_peaks_mib: list[float] = []
        self._started = 0.0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            self.train_peaks_mib.append(torch.cuda.max_memory_allocated(pl_module.device) / 2**20)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start(pl_module)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end(pl_module)

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start(pl_module)

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end(pl_module)

    def _start(self, pl_module: UserModule) -> None:
        pl_module.tower_seconds, pl_module.tower_calls = 0.0, 0
        pl_module.tower_call_seconds = []
        _synchronize(pl_module.device)
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        self._started = time.perf_counter()

    def _end(self, pl_module: UserModule) -> None:
        _synchronize(pl_module.device)
        record = RunRecord(
            pl_module.tower_seconds, time.perf_counter() - self._started, pl_module.tower_calls
        )
        if pl_module.device.type == "cuda":
            record.peak_mib = torch.cuda.max_memory_allocated(pl_module.device) / 2**20
        calls = pl_module.tower_call_seconds
        if calls:
            record.first_call_s, record.median_call_s = calls[0], statistics.median(calls)
        if self.graph_callback is not None:
            stats: Mapping[str, float] = self.graph_callback.last_stats
            record.graphs_captured = int(stats["graphs_captured"])
            record.capture_s = stats["capture_seconds_run"]
            record.stats = dict(stats)
        self.records.append(record)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
