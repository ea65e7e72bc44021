"""One call of a transformers vision tower, sorted by kind of argument, and its signature."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

#: Tensor arguments that hold one row per item: padded and split with the pixels.
PER_ITEM_INPUTS = ("bool_masked_pos", "attention_mask", "pixel_attention_mask", "pixel_mask")
#: Tensor arguments that apply to the whole batch: copied whole into every replay.
SHARED_INPUTS = ("head_mask",)
#: Config fields transformers reads when the call leaves them out; part of the signature.
CONFIG_FLAGS = ("return_dict", "output_hidden_states", "output_attentions", "_attn_implementation")


@dataclass(frozen=True)
class TensorSpec:
    """Shape (per item for batched tensors), dtype and device of a tensor argument."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class HFCallSignature:
    """What one set of graphs is captured for: tensor specs, other arguments, config flags."""

    pixels: TensorSpec
    per_item: tuple[tuple[str, TensorSpec], ...]
    shared: tuple[tuple[str, TensorSpec], ...]
    options: tuple[tuple[str, Hashable], ...]
    config: tuple[tuple[str, Hashable], ...]


@dataclass(frozen=True)
class HFInputs:
    """One call of the tower: pixels, per-item and shared tensors, and its signature."""

    pixels: torch.Tensor
    per_item: Mapping[str, torch.Tensor]
    shared: Mapping[str, torch.Tensor]
    signature: HFCallSignature


def batched_spec(tensor: torch.Tensor) -> TensorSpec:
    """The spec of one item's row of a batched tensor."""
    return TensorSpec(tuple(tensor.shape[1:]), tensor.dtype, tensor.device)


def whole_spec(tensor: torch.Tensor) -> TensorSpec:
    """The spec of a tensor of the whole batch."""
    return TensorSpec(tuple(tensor.shape), tensor.dtype, tensor.device)


def hashable_option(name: str, value: Any) -> Hashable:
    """``value``, checked to be hashable: graphs are captured per value of an option."""
    try:
        hash(value)
    except TypeError:
        raise ValueError(
            f"argument {name}={value!r} is neither a tensor nor hashable; graphs are "
            "captured per value of every non-tensor argument, so it must be hashable "
            "(a bool, a number, a string, None, a tuple)"
        ) from None
    return value
