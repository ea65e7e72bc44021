"""Synthetic data: variable-resolution images and videos, and fixed-size FakeData.

Everything is a function of its seed, so a benchmark or test sees the same
sizes and pixels on every run. Sides are multiples of ``patch * merge`` so a
packed tower takes each item at its own size.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset
from torchvision.datasets import FakeData
from torchvision.transforms import Compose, Normalize, ToTensor

from examples.data.collate import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    SplitsDataModule,
    collate_batched,
    collate_packed,
)
from examples.data.fits import check_batch_first, check_packed

# Seeds of per-item generators are seed * _SEED_STRIDE + index, so items of
# neighbouring seeds never share pixels.
_SEED_STRIDE = 1_000_003


def check_counts(**counts: object) -> None:
    """Refuse a count that is not a positive integer, naming it."""
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer; got {name}={value!r}")


def grid_sides(min_side: int, max_side: int, multiple: int) -> list[int]:
    """The sides in ``[min_side, max_side]`` that are multiples of ``multiple``."""
    if multiple < 1:
        raise ValueError(f"multiple must be a positive int; got {multiple}")
    first = max(multiple, -(-min_side // multiple) * multiple)
    sides = list(range(first, max_side + 1, multiple))
    if not sides:
        raise ValueError(
            f"no multiple of {multiple} lies in [min_side={min_side}, max_side={max_side}]"
        )
    return sides


def random_image_sizes(
    n: int, seed: int, min_side: int = 64, max_side: int = 448, multiple: int = 32
) -> list[tuple[int, int]]:
    """``n`` random ``(height, width)`` pairs, each side a multiple of ``multiple``.

    Args:
        n: number of sizes.
        seed: the same seed gives the same sizes.
        min_side: smallest side in pixels (rounded up to a multiple).
        max_side: largest side in pixels.
        multiple: ``patch_size * merge_size`` of the tower.
    """
    sides = grid_sides(min_side, max_side, multiple)
    rng = random.Random(seed)
    return [(rng.choice(sides), rng.choice(sides)) for _ in range(n)]


def synthetic_images(
    n: int,
    seed: int,
    min_side: int = 64,
    max_side: int = 448,
    multiple: int = 32,
    channels: int = 3,
) -> list[torch.Tensor]:
    """``n`` standard-normal images ``[C, H, W]`` of the sizes :func:`random_image_sizes` gives.

    Example:
        >>> [tuple(x.shape) for x in synthetic_images(2, seed=0, max_side=128)]
        [(3, 96, 96), (3, 64, 96)]
    """
    generator = torch.Generator().manual_seed(seed)
    sizes = random_image_sizes(n, seed, min_side, max_side, multiple)
    return [torch.randn(channels, h, w, generator=generator) for h, w in sizes]


def synthetic_videos(
    n: int,
    seed: int,
    min_side: int = 64,
    max_side: int = 448,
    multiple: int = 32,
    min_frames: int = 2,
    max_frames: int = 4,
    channels: int = 3,
) -> list[torch.Tensor]:
    """``n`` standard-normal videos ``[T, C, H, W]`` with ``T`` in ``[min_frames, max_frames]``."""
    if not 1 <= min_frames <= max_frames:
        raise ValueError(
            f"need 1 <= min_frames <= max_frames; got min_frames={min_frames}, "
            f"max_frames={max_frames}"
        )
    generator = torch.Generator().manual_seed(seed)
    sides = grid_sides(min_side, max_side, multiple)
    rng = random.Random(seed)
    videos = []
    for _ in range(n):
        frames, height, width = rng.randint(min_frames, max_frames), *rng.choices(sides, k=2)
        videos.append(torch.randn(frames, channels, height, width, generator=generator))
    return videos


class SyntheticItems(Dataset):
    """``(item, target)`` pairs of random images and videos, generated on access.

    Shapes and targets are drawn up front from the seed; the pixels of item
    ``i`` come from a generator of its own, so workers and reruns agree.

    Args:
        num_items: dataset length.
        seed: the same seed gives the same items.
        multiple: sides are multiples of this (``patch * merge``).
        min_side: smallest side in pixels.
        max_side: largest side in pixels.
        video_fraction: probability that an item is a video.
        num_classes: targets are drawn from ``range(num_classes)``.
        max_frames: videos have 2 to ``max_frames`` frames.
    """

    def __init__(
        self,
        num_items: int,
        seed: int,
        multiple: int,
        min_side: int,
        max_side: int,
        video_fraction: float = 0.0,
        num_classes: int = 10,
        max_frames: int = 4,
    ) -> None:
        if not 0.0 <= video_fraction <= 1.0:
            raise ValueError(f"video_fraction must lie in [0, 1]; got {video_fraction}")
        if video_fraction > 0 and max_frames < 2:
            raise ValueError(f"max_frames must be >= 2 when there are videos; got {max_frames}")
        sides = grid_sides(min_side, max_side, multiple)
        rng = random.Random(seed)
        self.seed = seed
        self.shapes: list[tuple[int, ...]] = []
        self.targets: list[int] = []
        for _ in range(num_items):
            height, width = rng.choices(sides, k=2)
            is_video = rng.random() < video_fraction
            frames = (rng.randint(2, max_frames),) if is_video else ()
            self.shapes.append((*frames, 3, height, width))
            self.targets.append(rng.randrange(num_classes))

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        generator = torch.Generator().manual_seed(self.seed * _SEED_STRIDE + index)
        return torch.randn(self.shapes[index], generator=generator), self.targets[index]


class SyntheticDataModule(SplitsDataModule):
    """Random variable-resolution images (and videos) as packed batches.

    Batches are ``{"pixel_patches", "grid_thw", "targets"}`` for
    ``tower(pixel_patches, grid_thw)``. Every split serves the same items
    (training shuffles).

    Args:
        num_items: items per split.
        batch_size: items per batch.
        seed: the same seed gives the same items.
        min_side: smallest side in pixels.
        max_side: largest side in pixels.
        patch_size: the tower's patch size.
        merge_size: the tower's spatial merge size; sides are multiples of
            ``patch_size * merge_size``.
        temporal_patch_size: the tower's frames per patch (2 for the Qwen towers).
        video_fraction: probability that an item is a video.
        num_classes: targets are drawn from ``range(num_classes)``.
        max_frames: videos have 2 to ``max_frames`` frames.
        num_workers: DataLoader workers.

    Example:
        >>> datamodule = SyntheticDataModule(num_items=8, batch_size=4, max_side=128)
        >>> datamodule.setup("predict")
        >>> sorted(next(iter(datamodule.predict_dataloader())))
        ['grid_thw', 'pixel_patches', 'targets']
    """

    @staticmethod
    def check_model_input(data: Mapping[str, Any], model_input: Mapping[str, Any]) -> None:
        """Refuse a tower these packed batches cannot feed (see :mod:`examples.data.fits`)."""
        check_packed(data, model_input, "; use data=fake or data=photos")

    def __init__(
        self,
        num_items: int = 64,
        batch_size: int = 8,
        seed: int = 0,
        min_side: int = 64,
        max_side: int = 448,
        patch_size: int = 16,
        merge_size: int = 2,
        video_fraction: float = 0.0,
        num_classes: int = 10,
        max_frames: int = 4,
        num_workers: int = 0,
        temporal_patch_size: int = 1,
    ) -> None:
        super().__init__()
        check_counts(num_items=num_items, batch_size=batch_size)
        self.dataset = SyntheticItems(
            num_items,
            seed,
            patch_size * merge_size,
            min_side,
            max_side,
            video_fraction,
            num_classes,
            max_frames,
        )
        collate = partial(
            collate_packed,
            patch_size=patch_size,
            merge_size=merge_size,
            temporal_patch_size=temporal_patch_size,
        )
        self._loader = partial(
            DataLoader,
            self.dataset,
            batch_size=batch_size,
            num_workers=num_workers,
            collate_fn=collate,
        )


class FakeDataModule(SplitsDataModule):
    """torchvision FakeData as ``{"images": [B, 3, S, S], "targets": [B]}`` batches.

    For batch-first towers (``vit_b_16``, ``resnet50``); images are normalized
    with the ImageNet mean and std, and image ``i`` depends only on ``seed + i``.

    Args:
        num_items: images per split.
        batch_size: images per batch.
        image_size: side of the square images.
        num_classes: targets are drawn from ``range(num_classes)``.
        seed: offset of FakeData's per-image seeds.
        num_workers: DataLoader workers.
    """

    @staticmethod
    def check_model_input(data: Mapping[str, Any], model_input: Mapping[str, Any]) -> None:
        """Refuse a tower these fixed-size images cannot feed (see :mod:`examples.data.fits`)."""
        check_batch_first(data, model_input, "image_size", "; use data=photos or data=synthetic")

    def __init__(
        self,
        num_items: int = 64,
        batch_size: int = 8,
        image_size: int = 224,
        num_classes: int = 10,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        check_counts(num_items=num_items, batch_size=batch_size)
        self.dataset = FakeData(
            size=num_items,
            image_size=(3, image_size, image_size),
            num_classes=num_classes,
            transform=Compose([ToTensor(), Normalize(IMAGENET_MEAN, IMAGENET_STD)]),
            random_offset=seed,
        )
        self._loader = partial(
            DataLoader,
            self.dataset,
            batch_size=batch_size,
            num_workers=num_workers,
            collate_fn=collate_batched,
        )
