"""A LightningModule around a vision tower, and the tower factories the Hydra configs use.

:class:`VisionClassifier` keeps its tower at ``.vision_tower`` and always calls
it through the module (``self.vision_tower(...)``), so the CUDA graph callback can
swap the tower's forward without the model noticing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models import resnet18, resnet50
from torchvision.models.vision_transformer import VisionTransformer

# torchvision's vit_b_16 shape, spelled out so tiny test towers can override any field.
_VIT_B_16 = {
    "image_size": 224,
    "patch_size": 16,
    "num_layers": 12,
    "num_heads": 12,
    "hidden_dim": 768,
    "mlp_dim": 3072,
}

Batch = dict[str, torch.Tensor]


class VisionClassifier(pl.LightningModule):
    """A vision tower, mean-pooled per image, under a LayerNorm + Linear head.

    Takes both batch kinds of :mod:`examples.data`: packed batches
    ``{"pixel_patches", "grid_thw", "targets"}`` for towers with a ``config`` such
    as :class:`~examples.models.packed_vit.PackedViT` or the Qwen vision
    towers of transformers (each image's output tokens, for a transformers
    tower its ``pooler_output``, are averaged), and batch-first batches
    ``{"images", "targets"}`` (the tower's ``[B, ...]`` output is flattened per image).

    Args:
        vision_tower: the tower; its forward is what the callback graphs.
        embed_dim: width of one pooled embedding; None asks :func:`embed_dim_of`.
        num_classes: classes of the head.
        lr: AdamW learning rate.

    Example:
        >>> model = VisionClassifier(build_tower("resnet18", num_classes=32), embed_dim=32)
        >>> model.predict_step({"images": torch.randn(2, 3, 64, 64)}, 0).shape
        torch.Size([2, 32])
    """

    def __init__(
        self,
        vision_tower: nn.Module,
        embed_dim: int | None = None,
        num_classes: int = 10,
        lr: float = 1e-3,
    ) -> None:
        super().__init__()
        if embed_dim is None:
            embed_dim = embed_dim_of(vision_tower)
        # Resolved before saving, so checkpoints record the real width.
        self.save_hyperparameters(ignore=["vision_tower"])
        self.vision_tower = vision_tower
        self.head = nn.Sequential(nn.LayerNorm(embed_dim), nn.Linear(embed_dim, num_classes))

    def embed(self, batch: Batch) -> torch.Tensor:
        """One pooled embedding per image, ``[N, embed_dim]``."""
        if "pixel_patches" in batch:
            output = self.vision_tower(batch["pixel_patches"], batch["grid_thw"])
            # A transformers tower returns a ModelOutput; its merged tokens are the pooler output.
            tokens = getattr(output, "pooler_output", output)  # (T, D)
            return pool_items(tokens, self._tokens_per_item(batch["grid_thw"]))
        if "images" in batch:
            return self.vision_tower(batch["images"]).flatten(1)
        raise ValueError(
            f"batch has keys {sorted(batch)}; expected 'pixel_patches' and 'grid_thw' "
            "(packed) or 'images' (batch-first)"
        )

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, batch_size=len(batch["targets"]))
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, batch_size=len(batch["targets"]))
        return loss

    def test_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("test_loss", loss, batch_size=len(batch["targets"]))
        return loss

    def predict_step(self, batch: Batch, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        """Pooled embeddings before the head, one row per image."""
        return self.embed(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def _loss(self, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(self.head(self.embed(batch)), batch["targets"])

    def _tokens_per_item(self, grid_thw: torch.Tensor) -> list[int]:
        from examples.models.packed_patches import tokens_per_item

        config = getattr(self.vision_tower, "config", None)
        if not hasattr(config, "spatial_merge_size"):
            raise ValueError(
                "packed batches need a tower with a config holding spatial_merge_size "
                f"(a PackedViTConfig or a Qwen vision config); {type(self.vision_tower).__name__} "
                "has none"
            )
        if hasattr(config, "global_view"):
            return tokens_per_item(grid_thw, config)
        return [t * h * w // config.spatial_merge_size**2 for t, h, w in grid_thw.tolist()]


def pool_items(tokens: torch.Tensor, tokens_per_item: list[int]) -> torch.Tensor:
    """Mean of each item's rows of a packed ``tokens [T, D]``; returns ``[N, D]``."""
    if sum(tokens_per_item) != tokens.shape[0]:
        raise ValueError(
            f"the tower returned {tokens.shape[0]} rows for items of "
            f"{sum(tokens_per_item)} tokens in all ({tokens_per_item})"
        )
    return torch.stack([rows.mean(0) for rows in tokens.split(tokens_per_item)])


def _packed_vit(preset: str) -> Callable[..., nn.Module]:
    def build(**overrides: Any) -> nn.Module:
        from examples.models import packed_vit

        config = getattr(packed_vit, preset)()
        return packed_vit.PackedViT(replace(config, **overrides))

    return build


def _vit_b_16(**overrides: Any) -> nn.Module:
    tower = VisionTransformer(**{**_VIT_B_16, **overrides})
    # torchvision zero-initialises the classifier for fine-tuning; a random tower
    # used for embeddings would then return only zeros and hide every difference.
    for layer in tower.heads.modules():
        if isinstance(layer, nn.Linear):
            nn.init.trunc_normal_(layer.weight, std=0.02)
    return tower


_TOWERS: dict[str, Callable[..., nn.Module]] = {
    "packed_vit": _packed_vit("packed_vit_config"),
    "packed_vit_small": _packed_vit("packed_vit_small_config"),
    "vit_b_16": _vit_b_16,
    "resnet18": resnet18,
    "resnet50": resnet50,
}


def tower_names() -> list[str]:
    """Names :func:`build_tower` accepts."""
    return list(_TOWERS)


def build_tower(name: str, **overrides: Any) -> nn.Module:
    """A randomly initialised vision tower by name; no weights are ever downloaded.

    Args:
        name: one of :func:`tower_names`: ``packed_vit`` and ``packed_vit_small``
            (the reference packed tower's presets; overrides replace
            :class:`~examples.models.packed_vit.PackedViTConfig` fields),
            ``vit_b_16`` (torchvision; overrides replace ``VisionTransformer``
            arguments such as ``image_size`` or ``num_layers``), ``resnet18`` and
            ``resnet50`` (torchvision; overrides such as ``num_classes``).
        **overrides: configuration fields replacing the preset's.

    Example:
        >>> tower = build_tower(
        ...     "vit_b_16", image_size=64, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128
        ... )
    """
    if name not in _TOWERS:
        raise ValueError(f"unknown tower {name!r}; allowed: {', '.join(_TOWERS)}")
    if name.startswith("resnet"):
        # Random weights only: a forced weights=None keeps every run offline.
        overrides = {**overrides, "weights": None}
    return _TOWERS[name](**overrides)


def embed_dim_of(tower: nn.Module) -> int:
    """Width of one pooled embedding of ``tower``.

    Packed towers report ``config.out_hidden_size`` (the Qwen2-VL vision tower
    of transformers ``config.hidden_size``); torchvision ResNets their
    ``fc`` outputs; torchvision ViTs and timm models ``num_classes`` (or
    ``num_features`` when their head was removed with ``num_classes=0``).

    Raises:
        ValueError: the width cannot be read off the tower; pass ``embed_dim``.
    """
    config = getattr(tower, "config", None)
    if hasattr(config, "out_hidden_size"):
        return config.out_hidden_size
    if getattr(config, "model_type", None) == "qwen2_vl_vision":
        return config.hidden_size  # the merger's output; embed_dim is the blocks' width
    fc = getattr(tower, "fc", None)
    if isinstance(fc, nn.Linear):
        return fc.out_features
    for attribute in ("num_classes", "num_features"):
        width = getattr(tower, attribute, None)
        if isinstance(width, int) and width > 0:
            return width
    raise ValueError(
        f"cannot tell the embedding width of {type(tower).__name__}; pass embed_dim explicitly"
    )
