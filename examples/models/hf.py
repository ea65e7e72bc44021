"""Hugging Face transformers vision towers with random weights, and a LightningModule for them.

Towers are built from transformers configs, so nothing is downloaded; transformers
is optional (``pip install 'lightning-cg[hf]'``) and imported only when a tower is
built. The callback graphs them through :mod:`lightning_cg.adapters.hf`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from examples.models.lit import Batch, VisionClassifier
from lightning_cg.adapters.hf import require_transformers

#: CLIP ViT-B/16's vision tower (openai/clip-vit-base-patch16).
CLIP_VIT_B_16 = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "image_size": 224,
    "patch_size": 16,
    "projection_dim": 512,
}


def clip_vision_tower(**overrides: Any) -> nn.Module:
    """A randomly initialised ``CLIPVisionModel``, CLIP ViT-B/16 unless overridden.

    Args:
        **overrides: ``CLIPVisionConfig`` fields replacing the ViT-B/16 values,
            e.g. ``image_size=32, num_hidden_layers=1`` for a tiny test tower.

    Raises:
        ImportError: transformers is not installed; the message names the extra.

    Example:
        >>> tower = clip_vision_tower(hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8)
        >>> tower(pixel_values=torch.randn(2, 3, 32, 32)).pooler_output.shape
        torch.Size([2, 32])
    """
    transformers = require_transformers("clip_vision_tower")
    config = transformers.CLIPVisionConfig(**{**CLIP_VIT_B_16, **overrides})
    return transformers.CLIPVisionModel(config)


class HFVisionClassifier(VisionClassifier):
    """:class:`~examples.models.lit.VisionClassifier` around a transformers tower.

    The tower is called as its users call it, ``vision_tower(pixel_values=images)``,
    and one field of its ``ModelOutput`` is the embedding of each image.

    Args:
        vision_tower: a transformers vision model taking ``pixel_values``.
        output_field: the output field holding one ``[B, D]`` embedding per image.
        embed_dim: width of that field; None reads ``config.hidden_size``.
        num_classes: classes of the head.
        lr: AdamW learning rate.
    """

    def __init__(
        self,
        vision_tower: nn.Module,
        output_field: str = "pooler_output",
        embed_dim: int | None = None,
        num_classes: int = 10,
        lr: float = 1e-3,
    ) -> None:
        if embed_dim is None:
            embed_dim = vision_tower.config.hidden_size
        super().__init__(vision_tower, embed_dim=embed_dim, num_classes=num_classes, lr=lr)
        self.output_field = output_field

    def embed(self, batch: Batch) -> torch.Tensor:
        """``output_field`` of the tower's output, one row per image."""
        if "images" not in batch:
            raise ValueError(
                f"batch has keys {sorted(batch)}; a transformers tower takes batch-first "
                "'images' (use data=fake, or data=photos with a fixed image size)"
            )
        return self.vision_tower(pixel_values=batch["images"])[self.output_field]
