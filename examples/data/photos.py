"""Real photos shipped inside scikit-image, at (close to) their native size.

Only photos whose files are part of the scikit-image wheel are used, so loading
never touches the network. Each side is rounded down to a multiple of
``patch_size * merge_size`` so a packed tower takes the photo as it is; with
``fixed_size`` every photo is instead resized and centre-cropped to a square for
batch-first towers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from skimage import data as skdata
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms.functional import center_crop, resize

from examples.data.collate import (
    SplitsDataModule,
    collate_batched,
    collate_packed,
    normalize,
)
from examples.data.fits import check_batch_first, check_packed

# Natural photos of varied size and aspect; grayscale ones are repeated to RGB.
_PHOTOS: dict[str, Callable[[], np.ndarray]] = {
    "astronaut": skdata.astronaut,  # 512 x 512
    "camera": skdata.camera,  # 512 x 512, gray
    "chelsea": skdata.chelsea,  # 300 x 451
    "coffee": skdata.coffee,  # 400 x 600
    "coins": skdata.coins,  # 303 x 384, gray
    "hubble_deep_field": skdata.hubble_deep_field,  # 872 x 1000
    "immunohistochemistry": skdata.immunohistochemistry,  # 512 x 512
    "moon": skdata.moon,  # 512 x 512, gray
    "motorcycle": lambda: skdata.stereo_motorcycle()[0],  # 500 x 741
    "retina": skdata.retina,  # 1411 x 1411
    "rocket": skdata.rocket,  # 427 x 640
}


def photo_names() -> list[str]:
    """Names of the bundled photos, in dataset order."""
    return list(_PHOTOS)


def load_photo(name: str) -> torch.Tensor:
    """One photo at native size as RGB floats in ``[0, 1]``, shape ``[3, H, W]``.

    Args:
        name: one of :func:`photo_names`.
    """
    if name not in _PHOTOS:
        raise ValueError(f"unknown photo {name!r}; allowed: {', '.join(_PHOTOS)}")
    pixels = torch.from_numpy(np.ascontiguousarray(_PHOTOS[name]()))
    if pixels.dim() == 2:
        pixels = pixels.unsqueeze(-1).expand(-1, -1, 3)
    return pixels.permute(2, 0, 1).float() / 255.0


def fit_to_grid(image: torch.Tensor, multiple: int, max_side: int | None = None) -> torch.Tensor:
    """Resize ``image [C, H, W]`` so both sides are multiples of ``multiple``.

    The image is first scaled down (never up) so its longest side is at most
    ``max_side``; each side is then rounded down to a multiple, keeping the
    aspect ratio to within one multiple.

    Args:
        image: the image to resize.
        multiple: both output sides are multiples of this (``patch * merge``).
        max_side: cap on the longest side; None keeps the native size.
    """
    if max_side is not None and max_side < multiple:
        raise ValueError(f"max_side must be at least the grid multiple {multiple}; got {max_side}")
    height, width = image.shape[-2:]
    scale = min(1.0, max_side / max(height, width)) if max_side is not None else 1.0
    size = [max(multiple, int(side * scale) // multiple * multiple) for side in (height, width)]
    if size == [height, width]:
        return image
    resized = F.interpolate(image[None], size=size, mode="bilinear", antialias=True)
    return resized[0]


def load_photos(
    multiple: int = 32, max_side: int | None = None, fixed_size: int | None = None
) -> list[torch.Tensor]:
    """All bundled photos, normalized with the ImageNet mean and std.

    Args:
        multiple: sides are rounded down to multiples of this.
        max_side: cap on the longest side; None keeps native sizes.
        fixed_size: when set, every photo is resized (shorter side) and
            centre-cropped to ``fixed_size x fixed_size`` instead.
    """
    images = [load_photo(name) for name in _PHOTOS]
    if fixed_size is not None:
        images = [
            center_crop(resize(image, fixed_size, antialias=True), fixed_size) for image in images
        ]
    else:
        images = [fit_to_grid(image, multiple, max_side) for image in images]
    return [normalize(image) for image in images]


class PhotoDataset(Dataset):
    """``(image, target)`` pairs; the target of photo ``i`` is ``i % num_classes``."""

    def __init__(self, images: list[torch.Tensor], num_classes: int) -> None:
        self.images = images
        self.num_classes = num_classes

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], index % self.num_classes


class PhotosDataModule(SplitsDataModule):
    """The bundled photos as packed batches, or fixed-size batches for batch-first towers.

    Packed batches are ``{"pixel_patches", "grid_thw", "targets"}``; with
    ``fixed_size`` they are ``{"images": [B, 3, S, S], "targets": [B]}``. Every
    split serves the same photos in the same order (training shuffles).

    Args:
        batch_size: photos per batch.
        max_side: cap on the longest side of packed photos; None keeps native sizes.
        patch_size: the tower's patch size.
        merge_size: the tower's spatial merge size; sides are multiples of
            ``patch_size * merge_size``.
        fixed_size: square side for batch-first towers; None for packed batches.
        num_workers: DataLoader workers.
        repeats: times each split serves the photos (a longer run over the same set).
        num_classes: targets cycle through this many classes.
        temporal_patch_size: the tower's frames per patch (2 for the Qwen towers).

    Example:
        >>> datamodule = PhotosDataModule(batch_size=4, max_side=256, patch_size=16)
        >>> datamodule.setup("predict")
        >>> batch = next(iter(datamodule.predict_dataloader()))
    """

    @staticmethod
    def check_model_input(data: Mapping[str, Any], model_input: Mapping[str, Any]) -> None:
        """Refuse a tower the photos cannot feed: packed unless ``fixed_size`` is set."""
        if data.get("fixed_size") is None:
            check_packed(data, model_input, "; set data.fixed_size=model.input.image_size")
        else:
            check_batch_first(data, model_input, "fixed_size", "; set data.fixed_size=null")

    def __init__(
        self,
        batch_size: int = 4,
        max_side: int | None = None,
        patch_size: int = 16,
        merge_size: int = 2,
        fixed_size: int | None = None,
        num_workers: int = 0,
        num_classes: int = 10,
        temporal_patch_size: int = 1,
        repeats: int = 1,
    ) -> None:
        super().__init__()
        positive = {
            "batch_size": batch_size,
            "repeats": repeats,
            "patch_size": patch_size,
            "merge_size": merge_size,
            "num_classes": num_classes,
            "temporal_patch_size": temporal_patch_size,
        }
        if fixed_size is not None:
            positive["fixed_size"] = fixed_size
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be a positive int; got {value}")
        if max_side is not None and max_side < patch_size * merge_size:
            raise ValueError(
                f"max_side must be at least patch_size * merge_size = {patch_size * merge_size}; "
                f"got {max_side}"
            )
        self.batch_size = batch_size
        self.max_side = max_side
        self.patch_size = patch_size
        self.merge_size = merge_size
        self.temporal_patch_size = temporal_patch_size
        self.fixed_size = fixed_size
        self.num_workers = num_workers
        self.num_classes = num_classes
        self.repeats = repeats
        self.dataset: PhotoDataset | None = None

    def setup(self, stage: str) -> None:
        if self.dataset is None:
            images = load_photos(self.patch_size * self.merge_size, self.max_side, self.fixed_size)
            self.dataset = PhotoDataset(images * self.repeats, self.num_classes)

    def _loader(self, shuffle: bool) -> DataLoader:
        if self.fixed_size is None:
            collate = partial(
                collate_packed,
                patch_size=self.patch_size,
                merge_size=self.merge_size,
                temporal_patch_size=self.temporal_patch_size,
            )
        else:
            collate = collate_batched
        return DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            collate_fn=collate,
        )
