"""Whether a data module's config can feed a tower described by ``model.input`` (conf/model).

Each example data module offers this to the Hydra apps as ``check_model_input(data,
model_input)``, which they call on the composed config before any work; a ValueError says
what disagrees and what to set.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Sizes packed data shares with the tower: data key -> (model.input key, its default).
PACKED_SIZES = {
    "patch_size": ("patch_size", None),
    "merge_size": ("merge_size", None),
    "temporal_patch_size": ("temporal_patch_size", 1),
}


def check_packed(data: Mapping[str, Any], model_input: Mapping[str, Any], hint: str = "") -> None:
    """Refuse a batch-first tower, or packed sizes that differ from the tower's."""
    side = model_input.get("image_size")
    if side is not None:
        raise ValueError(
            "the data serves packed batches (pixel_patches, grid_thw), and the tower takes "
            f"batch-first images of side model.input.image_size={side}{hint}"
        )
    for key, (input_key, default) in PACKED_SIZES.items():
        _check_same(data, key, model_input.get(input_key, default), f"model.input.{input_key}")


def check_batch_first(
    data: Mapping[str, Any], model_input: Mapping[str, Any], side_key: str, hint: str = ""
) -> None:
    """Refuse a packed tower, or an image side (``data.<side_key>``) other than the tower's."""
    side = model_input.get("image_size")
    if side is None:
        raise ValueError(
            "the data serves batch-first images, and the tower takes packed batches "
            f"(pixel_patches, grid_thw; model.input.image_size is null){hint}"
        )
    _check_same(data, side_key, side, "model.input.image_size")


def _check_same(data: Mapping[str, Any], key: str, expected: Any, source: str) -> None:
    if key in data and expected is not None and data[key] != expected:
        raise ValueError(
            f"data.{key}={data[key]} disagrees with {source}={expected}; set "
            f"data.{key}={expected} (its default follows the model)"
        )
