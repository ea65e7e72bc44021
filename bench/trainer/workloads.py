"""The workloads of the Trainer benchmark: towers by name and seeded batches in memory.

A workload name is ``<tower>/batch_<n>`` (same-size images of a batch-first
tower), ``<tower>/mixed_batch_<n>`` (images of mixed sizes for a packed tower),
either prefixed with ``fit/`` (``trainer.fit`` with validation each epoch), or
``multiscale/<tower>/batch_<n>`` (``trainer.validate`` four times on batches of
same-size images whose side cycles through :attr:`Sizes.multiscale_sides`:
batch ``i`` has side ``sides[i % len(sides)]``; a tower of
:data:`MULTISCALE_TOWERS`, one that takes any image side).

Each workload carries its own run lengths (:attr:`Workload.default_batches`):
:data:`PREDICT_BATCHES` for predict workloads, :data:`MULTISCALE_BATCHES` for
multiscale ones; ``--batches`` replaces them for every workload it runs.

Batches are views into one block of seeded noise that lives on the run's device,
so data loading costs next to nothing and the tower dominates what is timed;
only a packed batch's small ``grid_thw`` goes through Lightning's host-to-device
transfer, as it would for a user.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchvision.models.resnet import Bottleneck, ResNet

from bench.hf_towers import CLIP_TOWER, HF_TOWERS, QWEN_TOWER, patch_dim
from examples.data.synthetic import random_image_sizes
from examples.models.lit import build_tower

BATCHED_TOWERS = ("vit_b_16", "resnet50", CLIP_TOWER)
PACKED_TOWERS = ("packed_vit_small", "packed_vit", QWEN_TOWER)
PREDICT_WORKLOADS = (
    "vit_b_16/batch_1",
    "vit_b_16/batch_8",
    "resnet50/batch_8",
    "packed_vit_small/mixed_batch_1",
    "packed_vit_small/mixed_batch_8",
    "packed_vit/mixed_batch_1",
    "packed_vit/mixed_batch_8",
)
FIT_WORKLOADS = ("fit/vit_b_16/batch_8", "fit/packed_vit_small/mixed_batch_8")
#: Towers of the multiscale workloads: batch-first ones that take any image side.
MULTISCALE_TOWERS = ("resnet50",)
#: Validation over images whose side changes batch by batch (not in the default run).
MULTISCALE_WORKLOADS = ("multiscale/resnet50/batch_16",)
#: Run lengths, in batches, of a predict workload unless ``--batches`` says otherwise.
PREDICT_BATCHES = (10, 100, 1000)
#: Batches of a multiscale run unless ``--batches`` says otherwise: 12 of each side.
MULTISCALE_BATCHES = (48,)
#: The transformers towers (needs the hf extra; not in the default run): CLIP ViT-B/16
#: and the Qwen2-VL-7B vision tower, built from configs with random weights.
HF_WORKLOADS = (
    f"{CLIP_TOWER}/batch_1",
    f"{CLIP_TOWER}/batch_8",
    f"{QWEN_TOWER}/mixed_batch_1",
    f"{QWEN_TOWER}/mixed_batch_8",
)
NUM_CLASSES = 10
_NAME = re.compile(
    r"(?:(?P<fit>fit/)|(?P<multiscale>multiscale/))?"
    r"(?P<tower>\w+)/(?P<mixed>mixed_)?batch_(?P<size>[1-9]\d*)"
)


@dataclass(frozen=True)
class Workload:
    """One tower fed one kind of batch.

    Attributes:
        name: as in the rows, e.g. ``vit_b_16/batch_8`` or ``fit/packed_vit/mixed_batch_8``.
        tower: a name of :func:`examples.models.lit.build_tower` or of
            :data:`bench.hf_towers.HF_TOWERS`.
        batch_size: images per batch.
        mixed: images of mixed sizes, packed (packed towers) instead of same-size.
        fit: ``trainer.fit`` with validation each epoch instead of ``trainer.predict``.
        multiscale: ``trainer.validate`` four times on same-size batches whose
            side cycles through :attr:`Sizes.multiscale_sides`, instead of ``trainer.predict``.
    """

    name: str
    tower: str
    batch_size: int
    mixed: bool
    fit: bool
    multiscale: bool = False

    @property
    def default_batches(self) -> tuple[int, ...]:
        """Run lengths in batches when ``--batches`` gives none (a fit takes its own)."""
        return MULTISCALE_BATCHES if self.multiscale else PREDICT_BATCHES

    @classmethod
    def parse(cls, name: str) -> Workload:
        """The workload a name stands for; packed towers take mixed batches, the others
        not, and multiscale ones a tower of :data:`MULTISCALE_TOWERS` with same-size batches.

        Raises:
            ValueError: the name has another form or pairs a tower with the wrong batches.
        """
        match = _NAME.fullmatch(name)
        tower = match and match["tower"]
        mixed = bool(match and match["mixed"])
        multiscale = bool(match and match["multiscale"])
        if multiscale:
            allowed = () if mixed else MULTISCALE_TOWERS
        else:
            allowed = PACKED_TOWERS if mixed else BATCHED_TOWERS
        if tower not in allowed:
            raise ValueError(
                f"workloads has {name!r}; allowed: [fit/]<tower>/batch_<n> with a tower of "
                f"{', '.join(BATCHED_TOWERS)}, [fit/]<tower>/mixed_batch_<n> with a tower "
                f"of {', '.join(PACKED_TOWERS)} (e.g. {', '.join(PREDICT_WORKLOADS[:2])}), "
                f"or multiscale/<tower>/batch_<n> with a tower of {', '.join(MULTISCALE_TOWERS)}"
            )
        return cls(name, tower, int(match["size"]), mixed, bool(match["fit"]), multiscale)


@dataclass(frozen=True)
class Sizes:
    """Image sides and tower shapes of a benchmark.

    Attributes:
        image_side: side of the same-size images of batch-first towers.
        mixed_sides: smallest and largest side of the mixed-size images, in pixels.
        multiscale_sides: the sides that the batches of a multiscale workload cycle through.
        towers: per tower, :func:`~examples.models.lit.build_tower` overrides.
    """

    image_side: int = 224
    mixed_sides: tuple[int, int] = (64, 1024)
    multiscale_sides: tuple[int, ...] = (224, 256, 288, 320)
    towers: dict[str, dict[str, Any]] = field(default_factory=dict)


#: The towers as users have them.
FULL_SIZES = Sizes()
#: Tiny towers and images for a CPU smoke run.
TINY_SIZES = Sizes(
    image_side=32,
    mixed_sides=(32, 96),
    multiscale_sides=(32, 40, 48, 56),
    towers={
        "vit_b_16": {
            "image_size": 32,
            "num_layers": 1,
            "num_heads": 2,
            "hidden_dim": 32,
            "mlp_dim": 64,
        },
        "resnet50": {"layers": [1, 1, 1, 1], "width_per_group": 16, "num_classes": 16},
        "packed_vit_small": {"hidden_size": 32, "depth": 1, "num_heads": 2, "out_hidden_size": 32},
        "packed_vit": {"hidden_size": 32, "depth": 1, "num_heads": 2, "out_hidden_size": 32},
        CLIP_TOWER: {
            "patch_size": 8,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
        },
        QWEN_TOWER: {
            "depth": 1,
            "embed_dim": 32,
            "num_heads": 2,
            "hidden_size": 32,
            "patch_size": 4,
        },
    },
)


def make_tower(workload: Workload, sizes: Sizes, seed: int) -> nn.Module:
    """The workload's tower with seeded random weights, in eval mode on the CPU."""
    torch.manual_seed(seed)
    overrides = dict(sizes.towers.get(workload.tower, {}))
    if workload.tower in ("vit_b_16", CLIP_TOWER):
        overrides.setdefault("image_size", sizes.image_side)
    if workload.tower in HF_TOWERS:
        return HF_TOWERS[workload.tower](**overrides).eval()
    if workload.tower == "resnet50" and "layers" in overrides:
        # resnet50() fixes its blocks per stage; fewer blocks need the class itself.
        return ResNet(Bottleneck, **overrides).eval()
    return build_tower(workload.tower, **overrides).eval()


class SyntheticBatches(Dataset):
    """``count`` seeded batches of a workload; item ``i`` is the whole batch ``i``.

    Batch-first batches are ``{"images": [B, 3, S, S], "targets"}``; packed ones
    ``{"pixel_patches", "grid_thw", "targets"}`` with ``B`` images whose sides
    are drawn from ``sizes.mixed_sides`` (multiples of ``patch * merge``);
    multiscale ones are batch-first with batch ``i`` of side
    ``sizes.multiscale_sides[i % len(sides)]``. Pixels are slices of one noise
    block (per side) at seeded offsets, so two batches of one shape still differ;
    the same seed gives the same batches, and the first ``k`` batches of a
    longer set are the ``k`` batches of a shorter one.

    Args:
        workload: the tower and batch size.
        tower: the workload's tower (packed towers give patch and merge size).
        count: number of batches.
        sizes: image sides.
        seed: seeds sizes, offsets, pixels and targets.
        device: where the noise, and so every batch's pixels, live.
    """

    def __init__(
        self,
        workload: Workload,
        tower: nn.Module,
        count: int,
        sizes: Sizes,
        seed: int,
        device: torch.device,
    ) -> None:
        # Every draw is sequential and the noise's size does not depend on
        # ``count``, so a shorter set is a prefix of a longer one.
        rng = random.Random(seed)
        size = workload.batch_size
        targets = torch.randint(NUM_CLASSES, (count, size), generator=_generator(seed))
        self.targets = targets.to(device)
        self.sides = None  # multiscale: each batch's side
        if workload.multiscale:
            self._multiscale(workload, count, sizes, seed, rng, device)
            return
        if workload.mixed:
            config = tower.config
            patch, merge = config.patch_size, config.spatial_merge_size
            low, high = sizes.mixed_sides
            sides = random_image_sizes(count * size, seed, low, high, patch * merge)
            self.grids = [
                torch.tensor([(1, h // patch, w // patch) for h, w in sides[i : i + size]])
                for i in range(0, count * size, size)
            ]
            rows = [int(grid.prod(dim=1).sum()) for grid in self.grids]
            largest_batch = size * (high // patch) ** 2
            noise_shape = (2 * largest_batch, patch_dim(config))
        else:
            self.grids = None
            rows = [size] * count
            noise_shape = (4 * size, 3, sizes.image_side, sizes.image_side)
        self.noise = torch.randn(noise_shape, generator=_generator(seed + 1)).to(device)
        self.slices = []
        for n in rows:
            start = rng.randrange(len(self.noise) - n + 1)
            self.slices.append((start, start + n))

    def _multiscale(
        self,
        workload: Workload,
        count: int,
        sizes: Sizes,
        seed: int,
        rng: random.Random,
        device: torch.device,
    ) -> None:
        # One block per side, sliced along the batch like a same-size block, so
        # that every batch is contiguous and as aligned as a user's would be.
        size, cycle = workload.batch_size, sizes.multiscale_sides
        self.grids = None
        self.sides = [cycle[index % len(cycle)] for index in range(count)]
        self.side_noise = {
            side: torch.randn((4 * size, 3, side, side), generator=_generator(seed + 1 + k)).to(
                device
            )
            for k, side in enumerate(cycle)
        }
        self.slices = []
        for _ in range(count):
            start = rng.randrange(3 * size + 1)
            self.slices.append((start, start + size))

    def __len__(self) -> int:
        return len(self.slices)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start, stop = self.slices[index]
        if self.sides is not None:
            images = self.side_noise[self.sides[index]][start:stop]
            return {"images": images, "targets": self.targets[index]}
        pixels = self.noise[start:stop]
        if self.grids is None:
            return {"images": pixels, "targets": self.targets[index]}
        grid_thw, targets = self.grids[index], self.targets[index]
        return {"pixel_patches": pixels, "grid_thw": grid_thw, "targets": targets}

    def loader(self) -> DataLoader:
        """A DataLoader that hands the batches over as they are, in order."""
        return DataLoader(self, batch_size=None, shuffle=False, num_workers=0)

    def images(self) -> int:
        """Images over all batches."""
        return self.targets.numel()

    def shape_examples(self) -> list[dict[str, torch.Tensor]]:
        """The first batch of each image side (multiscale), else the first batch."""
        if self.sides is None:
            return [self[0]]
        firsts = {side: index for index, side in reversed(list(enumerate(self.sides)))}
        return [self[index] for index in sorted(firsts.values())]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
