"""What a Lightning Trainer tells of a run's length, for the callback's capture policy."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn


def total_batches(batches: Any) -> int | None:
    """The batches a run will see (Lightning gives one count per dataloader); None if unknown."""
    counts = batches if isinstance(batches, list | tuple) else [batches]
    if not counts or any(
        not isinstance(count, int | float) or count == float("inf") for count in counts
    ):
        return None
    return int(sum(counts))


def validation_runs_after(trainer: pl.Trainer) -> int | None:
    """The validation runs a fit still makes after the current one; None outside a fit
    or when that is not known in epochs (unlimited epochs, ``max_steps``, early stopping,
    validation every so many batches)."""
    epochs, every = trainer.max_epochs, trainer.check_val_every_n_epoch
    once_per_epoch = isinstance(trainer.val_check_interval, float) and (
        trainer.val_check_interval == 1.0
    )
    if (
        trainer.state.fn != TrainerFn.FITTING
        or epochs is None
        or epochs < 0
        or trainer.max_steps != -1
        or trainer.early_stopping_callbacks
        or every is None
        or not once_per_epoch
    ):
        return None
    # Validation follows the epochs whose number (from 1) is a multiple of ``every``.
    return max(epochs // every - (trainer.current_epoch + 1) // every, 0)
