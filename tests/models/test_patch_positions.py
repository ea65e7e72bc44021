"""Patch positions from per-width tables equal the positions patchify packs patches in."""

import random

import numpy as np
import pytest
import torch

from examples.models.packed_vit import PackedViT, PackedViTConfig, patchify
from examples.models.patch_positions import frame_positions, packed_positions


def patchified_positions(h: int, w: int, merge: int) -> np.ndarray:
    """Each patch's (row, column) as patchify packs it: a 1-pixel-patch frame whose
    two channels hold the row and the column."""
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    frame = torch.stack([rows, cols]).float()  # (2, h, w)
    patches, _ = patchify([frame], patch_size=1, spatial_merge_size=merge)
    return patches.to(torch.int32).numpy()


@pytest.mark.parametrize("merge", [1, 2, 3])
def test_frame_positions_are_where_patchify_puts_each_patch(merge):
    rng = random.Random(merge)
    sizes = [(merge * rng.randint(1, 40), merge * rng.randint(1, 40)) for _ in range(60)]
    # Heights of one width, taller then shorter, share a table.
    sizes += [(merge * 37, merge * 5), (merge * 2, merge * 5), (merge * 20, merge * 5)]
    for h, w in sizes:
        np.testing.assert_array_equal(
            frame_positions(h, w, merge), patchified_positions(h, w, merge)
        )


@pytest.mark.parametrize("frames", [[(4, 6), (8, 2), (4, 6)], [(8, 2)]])
def test_packed_positions_put_frames_one_after_another_in_a_new_array(frames):
    positions = packed_positions(frames, 2)
    expected = np.concatenate([patchified_positions(h, w, 2) for h, w in frames])
    np.testing.assert_array_equal(positions, expected)
    positions[:] = -1  # a copy: the cached tables are untouched
    np.testing.assert_array_equal(packed_positions(frames, 2), expected)
    assert packed_positions([], 2).shape == (0, 2)


def test_host_metadata_of_random_grids_matches_patchify():
    config = PackedViTConfig(hidden_size=16, depth=1, num_heads=1, patch_size=1, out_hidden_size=8)
    tower = PackedViT(config)
    rng = random.Random(0)
    for _ in range(20):
        grid = [
            (rng.randint(1, 3), 2 * rng.randint(1, 32), 2 * rng.randint(1, 32)) for _ in range(8)
        ]
        metadata = tower.host_metadata(grid)
        frames = [(h, w) for t, h, w in grid for _ in range(t)]
        expected = np.concatenate([patchified_positions(h, w, 2) for h, w in frames])
        np.testing.assert_array_equal(metadata["positions"].numpy(), expected)
        sizes = [h * w for h, w in frames]
        assert metadata["cu_seqlens"].tolist() == [0, *np.cumsum(sizes).tolist()]
