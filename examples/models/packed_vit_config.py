"""PackedViTConfig: the sizes of a :class:`~examples.models.packed_vit.PackedViT`,
checked at construction, and its two presets."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass
class PackedViTConfig:
    """Sizes of a :class:`~examples.models.packed_vit.PackedViT`.

    Attributes:
        hidden_size: width of the transformer blocks.
        depth: number of transformer blocks.
        num_heads: attention heads; ``hidden_size / num_heads`` must be a multiple
            of 4 (half of each head rotates by row, half by column).
        patch_size: side of a square patch in pixels.
        out_hidden_size: width of one output token (after the patch merger).
        in_channels: channels of an input frame.
        spatial_merge_size: side of the window of patches merged into one token.
        mlp_ratio: MLP hidden width over ``hidden_size``.
        global_view: also encode a fixed low-resolution view of each item's first
            frame and append its tokens to the item's output.
        global_grid: side, in patches, of the global view; a multiple of
            ``spatial_merge_size``.
    """

    hidden_size: int
    depth: int
    num_heads: int
    patch_size: int
    out_hidden_size: int
    in_channels: int = 3
    spatial_merge_size: int = 2
    mlp_ratio: float = 4.0
    global_view: bool = False
    global_grid: int = 16

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "depth",
            "num_heads",
            "patch_size",
            "out_hidden_size",
            "in_channels",
            "spatial_merge_size",
            "global_grid",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"PackedViTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % (4 * self.num_heads):
            raise ValueError(
                f"PackedViTConfig.hidden_size ({self.hidden_size}) must be a multiple of "
                f"4 * num_heads ({4 * self.num_heads}) for 2D rotary embeddings"
            )
        if self.global_grid % self.spatial_merge_size:
            raise ValueError(
                f"PackedViTConfig.global_grid ({self.global_grid}) must be a multiple of "
                f"spatial_merge_size ({self.spatial_merge_size})"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Width of one row of ``pixel_patches``: ``in_channels * patch_size**2``."""
        return self.in_channels * self.patch_size**2

    @property
    def mlp_hidden_size(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    @property
    def global_tokens(self) -> int:
        """Output tokens of one item's global view (whether or not it is on)."""
        return (self.global_grid // self.spatial_merge_size) ** 2


def packed_vit_config(**overrides) -> PackedViTConfig:
    """The Qwen2-VL-sized tower: 1280 wide, 32 blocks, patch 14, 1536-wide tokens."""
    base = PackedViTConfig(
        hidden_size=1280, depth=32, num_heads=16, patch_size=14, out_hidden_size=1536
    )
    return replace(base, **overrides)


def packed_vit_small_config(**overrides) -> PackedViTConfig:
    """A ViT-B/16-sized tower; ``PackedViT.load_torchvision_vit`` fills it from ``vit_b_16``
    (:meth:`~examples.models.packed_vit.PackedViT.load_torchvision_vit`)."""
    base = PackedViTConfig(
        hidden_size=768, depth=12, num_heads=12, patch_size=16, out_hidden_size=768
    )
    return replace(base, **overrides)
