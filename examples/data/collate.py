"""Batch assembly and normalization shared by the data modules.

Datasets yield ``(image_or_video, target)`` pairs. Packed towers get
``{"pixel_patches", "grid_thw", "targets"}`` batches, batch-first towers
``{"images", "targets"}``.
"""

from __future__ import annotations

from collections.abc import Sequence

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

Sample = tuple[torch.Tensor, int]


def normalize(image: torch.Tensor) -> torch.Tensor:
    """ImageNet normalization of RGB floats in ``[0, 1]``, shape ``[..., 3, H, W]``."""
    mean = torch.tensor(IMAGENET_MEAN, dtype=image.dtype).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD, dtype=image.dtype).view(3, 1, 1)
    return (image - mean) / std


def collate_packed(
    samples: Sequence[Sample], patch_size: int, merge_size: int = 2, temporal_patch_size: int = 1
) -> dict[str, torch.Tensor]:
    """Pack images ``[C, H, W]`` and videos ``[T, C, H, W]`` into one batch.

    Args:
        samples: ``(item, target)`` pairs; item sides are multiples of
            ``patch_size * merge_size``.
        patch_size: the tower's patch size.
        merge_size: the tower's spatial merge size.
        temporal_patch_size: the tower's frames per patch (2 for the Qwen towers).

    Returns:
        ``pixel_patches`` ``[sum(t*h*w), C*tp*p*p]``, ``grid_thw`` ``[N, 3]`` and
        ``targets`` ``[N]``.
    """
    from examples.models.packed_patches import patchify

    items, targets = zip(*samples, strict=True)
    pixel_patches, grid_thw = patchify(list(items), patch_size, merge_size, temporal_patch_size)
    return {
        "pixel_patches": pixel_patches,
        "grid_thw": grid_thw,
        "targets": torch.tensor(targets, dtype=torch.long),
    }


def collate_batched(samples: Sequence[Sample]) -> dict[str, torch.Tensor]:
    """Stack same-size images into ``{"images": [B, C, H, W], "targets": [B]}``."""
    images, targets = zip(*samples, strict=True)
    return {"images": torch.stack(images), "targets": torch.tensor(targets, dtype=torch.long)}


class SplitsDataModule(pl.LightningDataModule):
    """A DataModule whose splits all serve one dataset; training shuffles.

    Subclasses provide ``_loader(shuffle) -> DataLoader``.
    """

    def _loader(self, shuffle: bool) -> DataLoader:
        raise NotImplementedError

    def train_dataloader(self) -> DataLoader:
        return self._loader(shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(shuffle=False)
