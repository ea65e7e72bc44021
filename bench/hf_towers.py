"""The transformers vision towers of both benchmarks, built from configs with random weights.

Nothing is downloaded: each tower comes from its transformers config, sized as
the released model's, with seeded random weights. Attention is ``sdpa``, what a
user loading the model gets. transformers is optional; these functions import it.

- ``clip_vit_b16``: ``CLIPVisionModel`` of CLIP ViT-B/16, batch-first, called
  as ``tower(pixel_values=x)``.
- ``qwen2_vl_vision``: ``Qwen2VisionTransformerPretrainedModel`` sized as
  Qwen2-VL-7B's vision tower, packed, called as ``visual(hidden_states, grid_thw=grid)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from examples.models.hf import clip_vision_tower
from lightning_cg.adapters.hf import require_transformers

CLIP_TOWER = "clip_vit_b16"
QWEN_TOWER = "qwen2_vl_vision"
#: What the eager rows run: transformers' own SDPA attention.
EAGER_ATTENTION = "sdpa"
#: The vision_config of Qwen/Qwen2-VL-7B-Instruct.
QWEN2_VL_7B_VISION = {
    "depth": 32,
    "embed_dim": 1280,
    "num_heads": 16,
    "mlp_ratio": 4,
    "hidden_size": 3584,
    "in_channels": 3,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
}
#: How each tower takes its inputs: the names of the arguments passed by keyword,
#: after the positional ones (CLIP: ``tower(pixel_values=x)``; Qwen:
#: ``visual(hidden_states, grid_thw=grid)``).
CALL_KEYWORDS = {CLIP_TOWER: ("pixel_values",), QWEN_TOWER: ("grid_thw",)}


def clip_tower(**overrides: Any) -> nn.Module:
    """``CLIPVisionModel`` of CLIP ViT-B/16 with sdpa attention; ``overrides`` replace
    ``CLIPVisionConfig`` fields (e.g. ``image_size``, ``num_hidden_layers``)."""
    return clip_vision_tower(**overrides, attn_implementation=EAGER_ATTENTION)


def qwen2_vl_tower(**overrides: Any) -> nn.Module:
    """``Qwen2VisionTransformerPretrainedModel`` sized as Qwen2-VL-7B's, with sdpa attention;
    ``overrides`` replace ``Qwen2VLVisionConfig`` fields (e.g. ``depth``, ``embed_dim``)."""
    require_transformers(QWEN_TOWER)
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
    )

    config = Qwen2VLVisionConfig(
        **{**QWEN2_VL_7B_VISION, **overrides}, attn_implementation=EAGER_ATTENTION
    )
    return Qwen2VisionTransformerPretrainedModel(config)


#: Builders by tower name.
HF_TOWERS: dict[str, Callable[..., nn.Module]] = {
    CLIP_TOWER: clip_tower,
    QWEN_TOWER: qwen2_vl_tower,
}


def is_hf_tower(tower: nn.Module) -> bool:
    """Whether ``tower`` (or the module under ``torch.compile``) comes from transformers."""
    tower = getattr(tower, "_orig_mod", tower)
    return type(tower).__module__.startswith("transformers.")


def patch_dim(config: Any) -> int:
    """Width of one packed patch row: ``patch_dim`` of a PackedViTConfig, else
    ``C * temporal_patch * p * p`` of a Qwen vision config."""
    width = getattr(config, "patch_dim", None)
    if width is not None:
        return width
    return config.in_channels * config.temporal_patch_size * config.patch_size**2


def merged_tokens(grid_thw: torch.Tensor, spatial_merge_size: int) -> list[int]:
    """Output tokens of each item of a Qwen vision tower: ``t * h * w / merge**2``."""
    return (grid_thw.prod(dim=-1) // spatial_merge_size**2).tolist()
