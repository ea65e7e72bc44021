"""The packed patch layout of :class:`~examples.models.packed_vit.PackedViT`.

Items (images ``[C, H, W]`` and videos ``[T, C, H, W]``) are cut into patches at
their native size and packed into one ``(patches, C*p*p)`` tensor, every
``merge x merge`` window of patches in consecutive rows; ``grid_thw`` holds each
item's ``(frames, rows, cols)`` of patches. Here: the cut, its inverse for one
frame, and the row and token counts a ``grid_thw`` implies.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from examples.models.packed_vit_config import PackedViTConfig

#: ``grid_thw`` as a ``(N, 3)`` integer tensor or as host ``(t, h, w)`` triples.
GridTHW = torch.Tensor | Sequence[Sequence[int]]


def patchify(
    items: Sequence[torch.Tensor],
    patch_size: int,
    spatial_merge_size: int = 2,
    temporal_patch_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut images and videos into packed patches.

    Rows go item after item, frame after frame, and within a frame window after
    window (row-major) so that every ``merge x merge`` window is consecutive rows,
    themselves row-major. A row is one patch flattened as ``(C, p, p)``, or with
    a temporal patch (the Qwen vision towers' ``temporal_patch_size``) as
    ``(C, tp, p, p)`` over ``tp`` consecutive frames: an item's frames are
    padded to a multiple of ``tp`` by repeating its last frame, as the Qwen
    processors do.

    Args:
        items: images ``[C, H, W]`` and videos ``[T, C, H, W]``; ``H`` and ``W``
            multiples of ``patch_size * spatial_merge_size``.
        patch_size: side of a patch in pixels.
        spatial_merge_size: side of a merge window in patches.
        temporal_patch_size: frames in one patch.

    Returns:
        ``pixel_patches`` ``(sum(t*h*w), C*tp*p*p)`` and ``grid_thw``, a CPU
        ``LongTensor`` ``(N, 3)`` of frames (``ceil(T / tp)``) and patch rows and
        columns per item.
    """
    if temporal_patch_size < 1:
        raise ValueError(f"temporal_patch_size must be >= 1, got {temporal_patch_size}")
    side = patch_size * spatial_merge_size
    patches, grid = [], []
    for index, item in enumerate(items):
        frames = item[None] if item.dim() == 3 else item  # (T, C, H, W)
        if frames.dim() != 4 or frames.shape[-2] % side or frames.shape[-1] % side:
            raise ValueError(
                f"items[{index}] has shape {tuple(item.shape)}; expected [C, H, W] or "
                f"[T, C, H, W] with H and W multiples of {side}"
            )
        missing = -frames.shape[0] % temporal_patch_size
        frames = torch.cat([frames, frames[-1:].expand(missing, -1, -1, -1)])
        patches.append(patchify_frames(frames, patch_size, spatial_merge_size, temporal_patch_size))
        t, _, height, width = frames.shape
        grid.append((t // temporal_patch_size, height // patch_size, width // patch_size))
    return torch.cat(patches), torch.tensor(grid, dtype=torch.long).reshape(-1, 3)


def tokens_per_item(grid_thw: GridTHW, config: PackedViTConfig) -> list[int]:
    """Output rows of each item of :meth:`~examples.models.packed_vit.PackedViT.forward`,
    global view included."""
    extra = config.global_tokens if config.global_view else 0
    return [tokens + extra for tokens in local_tokens(as_grid(grid_thw), config)]


def as_grid(grid_thw: GridTHW) -> list[tuple[int, int, int]]:
    """``grid_thw`` as host ``(t, h, w)`` triples of ints."""
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
    return [(int(t), int(h), int(w)) for t, h, w in rows]


def local_tokens(grid: list[tuple[int, int, int]], config: PackedViTConfig) -> list[int]:
    """Output tokens of each item's native-resolution path (one per merge window)."""
    return [t * h * w // config.spatial_merge_size**2 for t, h, w in grid]


def patch_offsets(grid: list[tuple[int, int, int]]) -> list[int]:
    """Each item's first row in the packed patches, then the total."""
    return [0, *itertools.accumulate(t * h * w for t, h, w in grid)]


def patchify_frames(
    frames: torch.Tensor, patch: int, merge: int, temporal: int = 1
) -> torch.Tensor:
    """``(T, C, H, W) -> (T/tp*h*w, C*tp*p*p)`` in merge-window order; ``T`` a multiple of tp."""
    frame_count, c, height, width = frames.shape
    t, h, w = frame_count // temporal, height // patch, width // patch
    x = frames.reshape(t, temporal, c, h // merge, merge, patch, w // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (t, h/m, w/m, m, m, c, tp, p, p)
    return x.reshape(t * h * w, c * temporal * patch * patch)


def unpatchify_frame(
    patches: torch.Tensor, h: int, w: int, config: PackedViTConfig
) -> torch.Tensor:
    """The inverse of :func:`patchify_frames` for one frame: ``(h*w, C*p*p) -> (C, H, W)``."""
    c, p, m = config.in_channels, config.patch_size, config.spatial_merge_size
    x = patches.reshape(h // m, w // m, m, m, c, p, p)
    x = x.permute(4, 0, 2, 5, 1, 3, 6)  # (c, h/m, m, p, w/m, m, p)
    return x.reshape(c, h * p, w * p)
