"""The benchmark's workloads: towers with seeded random weights and the batches they run."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from bench.hf_towers import CALL_KEYWORDS, CLIP_TOWER, HF_TOWERS, QWEN_TOWER
from examples.models.packed_vit import (
    PackedViT,
    packed_vit_config,
    packed_vit_small_config,
    patchify,
)
from lightning_cg.adapters.qwen import qwen_tower_kind

if TYPE_CHECKING:  # bench.settings imports this module to check workload names
    from bench.settings import BenchSettings

BATCHED_TOWERS = ("vit_b_16", "resnet50", CLIP_TOWER)
PACKED_TOWERS = ("packed_vit_small", "packed_vit", QWEN_TOWER)
STREAM = "stream"
WORKLOADS = (*BATCHED_TOWERS, *PACKED_TOWERS, STREAM)
#: Packed-tower scenarios: images per batch and the side range (a key of ``sizes``).
SCENARIOS = {
    "single_mixed": (1, "mixed_sides"),
    "single_small": (1, "small_sides"),
    "mixed_4": (4, "mixed_sides"),
    "mixed_8": (8, "wide_sides"),
    "small_16": (16, "small_sides"),
    "photos": (None, None),
}

Batch = tuple[torch.Tensor, ...]


def build_tower(name: str, overrides: Mapping[str, Any], settings: BenchSettings) -> nn.Module:
    """A tower with seeded random weights, cast to ``settings.dtype``, in eval mode.

    Args:
        name: ``vit_b_16``, ``resnet50`` (torchvision), ``packed_vit_small`` or
            ``packed_vit`` (:mod:`examples.models.packed_vit` presets),
            ``clip_vit_b16`` or ``qwen2_vl_vision`` (transformers, see
            :mod:`bench.hf_towers`).
        overrides: constructor fields replaced, e.g. ``num_layers`` of the ViT,
            ``layers`` of the ResNet, any ``PackedViTConfig``, ``CLIPVisionConfig``
            or ``Qwen2VLVisionConfig`` field; ``image_size`` is the input side of
            batch-first towers.
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
        elif name in HF_TOWERS:
            tower = HF_TOWERS[name](**overrides)
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
        keywords: names of a batch's last arguments, passed by keyword as the
            tower's users pass them (``pixel_values``; ``grid_thw``).
    """

    name: str
    batches: list[Batch]
    images: int
    stream: bool = False
    keywords: tuple[str, ...] = ()

    def call(self, index: int) -> tuple[Batch, dict[str, torch.Tensor]]:
        """Positional and keyword arguments of batch ``index``, as its tower is called."""
        batch = self.batches[index]
        positional = len(batch) - len(self.keywords)
        return batch[:positional], dict(zip(self.keywords, batch[positional:], strict=True))


def tower_workloads(tower_name: str, tower: nn.Module, settings: BenchSettings) -> list[Workload]:
    """The workloads of one tower: its batch sizes, or the packed scenarios."""
    if tower_name in BATCHED_TOWERS:
        side = settings.sizes["towers"][tower_name]["image_size"]
        return [
            Workload(
                f"{tower_name}/batch_{size}",
                [_batched(size, side, settings)],
                size,
                keywords=CALL_KEYWORDS.get(tower_name, ()),
            )
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
        workloads.append(
            Workload(
                f"{tower_name}/{scenario}",
                batches,
                _count_images(batches),
                keywords=CALL_KEYWORDS.get(tower_name, ()),
            )
        )
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
    keywords = CALL_KEYWORDS.get(tower_name, ())
    if tower_name in BATCHED_TOWERS:
        side = settings.sizes["towers"][tower_name]["image_size"]
        sizes = random_state.rng.sample(range(1, shapes + 1), shapes)
        batches = [_batched(size, side, settings, random_state.generator) for size in sizes]
        return Workload(name, batches, sum(sizes), stream=True, keywords=keywords)
    batches, seen = [], set()
    for _ in range(100 * shapes):
        count = random_state.rng.randint(1, settings.stream["max_images"])
        images = _images(tower, count, settings.sizes["stream_sides"], random_state)
        pixels = sum(image.shape[-2] * image.shape[-1] for image in images)
        if pixels not in seen:
            seen.add(pixels)
            batches.append(_packed(images, tower, settings))
        if len(batches) == shapes:
            return Workload(name, batches, _count_images(batches), stream=True, keywords=keywords)
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


def _grid_multiple(tower: nn.Module) -> int:
    return tower.config.patch_size * tower.config.spatial_merge_size


def _images(
    tower: nn.Module, count: int, sides: Sequence[int], random_state: _Random
) -> list[torch.Tensor]:
    """``count`` standard-normal images ``[3, H, W]``, sides multiples of the tower's grid
    within ``sides = [min, max]``."""
    multiple = _grid_multiple(tower)
    low, high = max(1, -(-sides[0] // multiple)), max(1, sides[1] // multiple)
    rng, generator = random_state.rng, random_state.generator
    grids = [(rng.randint(low, high), rng.randint(low, high)) for _ in range(count)]
    return [torch.randn(3, h * multiple, w * multiple, generator=generator) for h, w in grids]


def _packed(images: Sequence[torch.Tensor], tower: nn.Module, settings: BenchSettings) -> Batch:
    config = tower.config
    # A Qwen tower's patch spans temporal_patch_size frames: an image is repeated, as
    # its processor does.
    frames = getattr(config, "temporal_patch_size", 1)
    patches, grid_thw = patchify(images, config.patch_size, config.spatial_merge_size, frames)
    patches = patches.to(settings.device, settings.dtype)
    if qwen_tower_kind(tower) is not None:
        # A Qwen tower derives its positions from grid_thw on the patches' device,
        # where the Qwen-VL models keep it.
        return patches, grid_thw.to(settings.device)
    # PackedViT reads grid_thw on the host, and so does the adapter.
    return patches, grid_thw


def _count_images(batches: Sequence[Batch]) -> int:
    return sum(len(grid_thw) for _, grid_thw in batches)


def _photo_batches(tower: nn.Module, settings: BenchSettings) -> list[Batch]:
    photos = _load_photos(_grid_multiple(tower), settings.sizes["photos_max_side"])
    per_batch = settings.packed["photos_per_batch"]
    return [
        _packed(photos[start : start + per_batch], tower, settings)
        for start in range(0, len(photos), per_batch)
    ]


def _load_photos(multiple: int, max_side: int | None) -> list[torch.Tensor]:
    """The bundled real photos, sides rounded down to ``multiple``, longest side capped."""
    try:
        from examples.data.photos import load_photos
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
