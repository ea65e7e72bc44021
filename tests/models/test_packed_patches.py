import pytest
import torch

from examples.models.packed_patches import patchify


def test_patchify_puts_each_merge_window_on_consecutive_rows():
    image = torch.arange(8 * 12.0).view(1, 8, 12)  # pixel value = its row-major index
    patches, grid_thw = patchify([image], patch_size=1)
    assert grid_thw.tolist() == [[1, 8, 12]]
    assert patches[:8, 0].tolist() == [0, 1, 12, 13, 2, 3, 14, 15]
    assert patches[24:28, 0].tolist() == [24, 25, 36, 37]  # first window of window-row 2


def test_patchify_orders_items_then_frames_and_flattens_channels_first():
    image = torch.randn(2, 8, 8)
    video = torch.randn(3, 2, 8, 16)
    patches, grid_thw = patchify([image, video], patch_size=2)
    assert grid_thw.tolist() == [[1, 4, 4], [3, 4, 8]]
    assert patches.shape == (16 + 3 * 32, 2 * 2 * 2)
    torch.testing.assert_close(patches[0], image[:, :2, :2].flatten())
    torch.testing.assert_close(patches[16 + 32], video[1, :, :2, :2].flatten())  # frame 1


def test_patchify_with_a_temporal_patch_flattens_frame_pairs_as_qwen_does():
    """Rows are (C, tp, p, p) over tp consecutive frames; an odd last frame is repeated."""
    video = torch.randn(3, 2, 8, 16)  # T=3: frames (0, 1) and (2, 2)
    image = torch.randn(2, 8, 8)
    patches, grid_thw = patchify([video, image], patch_size=2, temporal_patch_size=2)
    assert grid_thw.tolist() == [[2, 4, 8], [1, 4, 4]]
    assert patches.shape == (2 * 32 + 16, 2 * 2 * 2 * 2)
    first_window_row = video[0:2, :, :2, 2:4].transpose(0, 1).flatten()  # window 0, patch 1
    torch.testing.assert_close(patches[1], first_window_row)
    repeated = torch.stack([video[2], video[2]])[:, :, :2, :2].transpose(0, 1).flatten()
    torch.testing.assert_close(patches[32], repeated)
    image_pair = torch.stack([image, image])[:, :, 2:4, 2:4].transpose(0, 1).flatten()
    torch.testing.assert_close(patches[64 + 3], image_pair)  # window 0, patch (1, 1)


def test_patchify_rejects_sizes_off_the_merge_grid():
    with pytest.raises(ValueError, match=r"items\[1\].*multiples of 8"):
        patchify([torch.zeros(3, 8, 8), torch.zeros(3, 8, 12)], patch_size=4)
