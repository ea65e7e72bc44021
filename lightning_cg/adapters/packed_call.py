"""A packed call's arguments: checked before any work, and the tower's device.

Shared by the packed and Qwen2-VL adapters; every error names the argument, its value and
what it must be.
"""

from __future__ import annotations

import torch
from torch import nn

#: Items as host ``(t, h, w)`` triples: frames, patch rows, patch columns.
Grid = list[tuple[int, int, int]]


def read_packed_call(
    patches: object,
    grid_thw: object,
    patch_dim: int,
    merge: int,
    device: torch.device | None,
    patches_name: str = "pixel_patches",
) -> Grid:
    """Check a packed call's arguments (else ValueError naming the bad one); read its grid.

    ``merge`` must divide patch rows and columns; ``device`` is None for a tower without
    parameters."""
    if not isinstance(grid_thw, torch.Tensor) or grid_thw.is_floating_point():
        raise ValueError(f"grid_thw must be an integer tensor, got {describe(grid_thw)}")
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        raise ValueError(f"grid_thw must have shape [N, 3], got {list(grid_thw.shape)}")
    if grid_thw.is_meta:
        raise ValueError(
            "grid_thw is on the meta device, which holds no values: packing reads each "
            "item's (t, h, w); pass grid_thw on the CPU or on the tower's device"
        )
    if not isinstance(patches, torch.Tensor) or not patches.is_floating_point():
        raise ValueError(f"{patches_name} must be a floating-point tensor, got {describe(patches)}")
    if device is not None and patches.device != device:
        raise ValueError(
            f"{patches_name} is on {patches.device}, the tower on {device}: "
            "move the batch to the tower's device"
        )
    grid = [(t, h, w) for t, h, w in grid_thw.tolist()]
    for index, (t, h, w) in enumerate(grid):
        if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
            raise ValueError(
                f"grid_thw[{index}] is {[t, h, w]}; frames must be >= 1 and patch rows "
                f"and columns positive multiples of spatial_merge_size ({merge})"
            )
    rows = sum(t * h * w for t, h, w in grid)
    if patches.dim() != 2 or patches.shape[1] != patch_dim:
        raise ValueError(
            f"{patches_name} must have shape [{rows}, {patch_dim}] (sum of t*h*w "
            f"over grid_thw, patch width), got {list(patches.shape)}"
        )
    if patches.shape[0] != rows:
        raise ValueError(
            f"grid_thw disagrees with {patches_name}: its {len(grid)} items have {rows} "
            f"patches (sum of t*h*w), {patches_name} has {patches.shape[0]} rows; "
            "pass the grid_thw these patches were cut with"
        )
    return grid


def tower_device(tower: object) -> torch.device | None:
    """The device of the tower's first parameter, None when it has none (read at every call).

    A stock nn.Module's is read off the module dicts: less host time than its parameters()."""
    cls = type(tower)
    stock = (
        isinstance(tower, nn.Module)
        and cls.parameters is nn.Module.parameters
        and cls.named_parameters is nn.Module.named_parameters
        and cls.named_modules is nn.Module.named_modules
    )
    parameter = _first_parameter(tower) if stock else next(tower.parameters(), None)
    return None if parameter is None else parameter.device


def _first_parameter(module: nn.Module) -> nn.Parameter | None:
    for parameter in module._parameters.values():
        if parameter is not None:
            return parameter
    for child in module._modules.values():
        if child is not None and (parameter := _first_parameter(child)) is not None:
            return parameter
    return None


def describe(value: object) -> str:
    """A short description of an argument's type for error messages."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor"
    return type(value).__name__
