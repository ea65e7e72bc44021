"""Small packed and batch-first towers and random packed calls, shared by tests."""

import random

import torch
from torchvision.models import VisionTransformer

from examples.models.packed_vit import PackedViT, PackedViTConfig, patchify

PATCH = 4
SIDES = (8, 16, 24)  # multiples of patch * merge


def packed_tower(depth: int = 2, global_view: bool = False, device: str = "cpu") -> PackedViT:
    """A packed_vit_small-shaped tower, shrunk."""
    torch.manual_seed(0)
    config = PackedViTConfig(
        hidden_size=64,
        depth=depth,
        num_heads=4,
        patch_size=PATCH,
        out_hidden_size=32,
        global_view=global_view,
        global_grid=4,
    )
    return PackedViT(config).to(device).eval()


def tiny_vit(device: str = "cpu") -> VisionTransformer:
    torch.manual_seed(0)
    vit = VisionTransformer(
        image_size=32, patch_size=4, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128
    )
    # torchvision zeroes the head: every output would be 0, whatever the graph did.
    torch.nn.init.normal_(vit.heads.head.weight)
    return vit.to(device).eval()


def random_items(rng: random.Random, count: int, max_frames: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    items = []
    for _ in range(count):
        frames = rng.randint(1, max_frames)
        item = torch.randn(frames, 3, rng.choice(SIDES), rng.choice(SIDES), generator=generator)
        items.append(item[0] if frames == 1 else item)
    return items


def packed_call(rng: random.Random, count: int, dtype=torch.float32, device="cpu", **kwargs):
    count = max(count, 1)  # patchify needs an item
    patches, grid_thw = patchify(random_items(rng, count, **kwargs), PATCH)
    return patches.to(device, dtype), grid_thw.to(device)
