"""What a Qwen vision tower derives from ``grid_thw``, built on the host outside its forward.

Built by transformers' own helpers (``transformers.vision_utils``), which the towers call
themselves, so a graph's metadata is exactly the eager forward's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_cg.adapters.packed_inputs import Grid


def host_metadata(tower: nn.Module, kind: str, grid: Grid) -> dict[str, torch.Tensor]:
    """The keyword metadata ``tower`` (of ``kind``) computes from ``grid``: ``cu_seqlens``,
    ``position_ids``, and Qwen2.5-VL's window or Qwen3-VL's interpolation tensors."""
    from transformers import vision_utils

    grid_thw = torch.tensor(grid, dtype=torch.long).reshape(-1, 3)
    merge = tower.config.spatial_merge_size
    metadata = {
        "cu_seqlens": vision_utils.get_vision_cu_seqlens(grid_thw),
        "position_ids": vision_utils.get_vision_position_ids(grid_thw, merge),
    }
    if kind == "qwen2_5_vl":
        window_index, cu_window_seqlens = vision_utils.get_vision_window_index(
            grid_thw, merge, tower.window_size, tower.patch_size
        )
        metadata["window_index"] = window_index
        metadata["cu_window_seqlens"] = cu_window_seqlens
    if kind == "qwen3_vl":
        indices, weights = vision_utils.get_vision_interpolation_indices_and_weights(
            grid_thw,
            num_grid_per_side=tower.num_grid_per_side,
            mode=tower.interpolation_mode,
            align_corners=tower.interpolation_align_corners,
            spatial_merge_size=merge,
        )
        metadata["interp_indices"] = indices
        metadata["interp_weights"] = weights
    return metadata


def window_side(tower: nn.Module) -> int:
    """Merged tokens along one side of a Qwen2.5-VL attention window (ValueError if < 1)."""
    merge = tower.config.spatial_merge_size
    side = tower.window_size // merge // tower.patch_size
    if side < 1:
        raise ValueError(
            f"window_size ({tower.window_size}) must be >= patch_size * spatial_merge_size "
            f"({tower.patch_size * merge})"
        )
    return side


def most_windows(token_budget: int, max_frames: int, side: int) -> int:
    """The most non-empty windows ``max_frames`` frames of ``token_budget`` tokens can have.

    A frame of ``h x w`` tokens has ``ceil(h/side) * ceil(w/side)`` windows, at
    most ``h*w / side + 1`` (as ``h + w <= h*w + 1``), and each holds a token.
    """
    return min(token_budget, -(-token_budget // side) + max_frames)


def window_metadata(
    buffers: Mapping[str, torch.Tensor], merge_area: int, side: int
) -> dict[str, Any]:
    """Qwen2.5-VL's window keywords from a graph's buffers, padding tokens mapped to themselves.

    The tower undoes the window order with ``argsort(window_index)``; zeros in the
    padding would tie with real tokens, so it gets the identity (on the device).
    """
    window_index = buffers["window_index"]
    positions = torch.arange(window_index.shape[0], device=window_index.device)
    real_tokens = buffers["cu_seqlens"][-1] // merge_area
    return {
        "window_index": torch.where(positions < real_tokens, window_index, positions),
        "cu_window_seqlens": buffers["cu_window_seqlens"],
        "max_window_seqlen": side**2 * merge_area,
    }
