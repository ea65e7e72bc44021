"""A variable-resolution ViT in the Qwen2-VL convention.

Items (images ``[C, H, W]`` and videos ``[T, C, H, W]``) are cut into patches at
their native size and packed into one ``(patches, C*p*p)`` tensor; ``grid_thw``
holds each item's ``(frames, rows, cols)`` of patches. Every frame attends only
to itself, positions come from 2D rotary embeddings, and a merger maps each
``merge x merge`` window of patches to one output token.

The forward is split so that a CUDA graph can be captured:
:meth:`PackedViT.host_metadata` turns ``grid_thw`` into small integer tensors on
the host (frame offsets and patch positions), and :meth:`PackedViT.forward_packed`
is the graphable body (no host syncs, no data-dependent shapes); it computes the
rotary tables from the positions on the device. The sizes are
:mod:`~examples.models.packed_vit_config`'s, the patch layout
:mod:`~examples.models.packed_patches`'.

Example:
    >>> config = PackedViTConfig(hidden_size=64, depth=2, num_heads=4, patch_size=4,
    ...                          out_hidden_size=32)
    >>> patches, grid_thw = patchify([torch.randn(3, 16, 24)], config.patch_size)
    >>> PackedViT(config)(patches, grid_thw).shape
    torch.Size([6, 32])
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from examples.models.packed_patches import (
    GridTHW,
    as_grid,
    local_tokens,
    patch_offsets,
    patchify,
    patchify_frames,
    tokens_per_item,
    unpatchify_frame,
)
from examples.models.packed_vit_config import (
    PackedViTConfig,
    packed_vit_config,
    packed_vit_small_config,
)
from examples.models.patch_positions import frame_positions, packed_positions
from lightning_cg.engine.attention import (
    Attend,
    block_diagonal_mask,
    sequence_attention,
    varlen_supported,
)

# The family's config, presets and patch layout are re-exported: they import from here too.
__all__ = [
    "GridTHW",
    "PackedViT",
    "PackedViTConfig",
    "block_diagonal_mask",
    "packed_vit_config",
    "packed_vit_small_config",
    "patchify",
    "tokens_per_item",
]

_ROPE_THETA = 10000.0
_LAYER_NORM_EPS = 1e-6  # torchvision's, so its weights load unchanged
#: The positions of no frame: the one piece of a grid without frames.
_NO_POSITIONS = np.empty((0, 2), dtype=np.int32)
_NO_POSITIONS.flags.writeable = False


class PackedViT(nn.Module):
    """Variable-resolution ViT over packed patches, with an optional global view.

    Args:
        config: the tower's sizes.
    """

    def __init__(self, config: PackedViTConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = nn.Linear(config.patch_dim, config.hidden_size)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.depth))
        self.merger = _PatchMerger(config)
        self.apply(_init_weights)

    def forward(self, pixel_patches: torch.Tensor, grid_thw: GridTHW) -> torch.Tensor:
        """Encode packed items.

        Args:
            pixel_patches: ``(sum(t*h*w), C*p*p)`` from :func:`patchify`.
            grid_thw: ``(N, 3)`` frames, patch rows and patch columns per item.

        Returns:
            ``(sum(tokens_per_item), out_hidden_size)``: per item, in item order, its
            local tokens followed by its global tokens (when ``config.global_view``).
        """
        grid = as_grid(grid_thw)
        local = self.encode_local(pixel_patches, grid)
        if not self.config.global_view or not grid:
            return local
        local_rows = local.split(local_tokens(grid, self.config))
        global_rows = self.encode_global(pixel_patches, grid).split(self.config.global_tokens)
        return torch.cat([local[:0], *itertools.chain(*zip(local_rows, global_rows, strict=True))])

    def encode_local(self, pixel_patches: torch.Tensor, grid_thw: GridTHW) -> torch.Tensor:
        """The native-resolution path: ``(sum(t*h*w) / merge**2, out_hidden_size)``."""
        return self._encode(pixel_patches, as_grid(grid_thw))

    def encode_global(self, pixel_patches: torch.Tensor, grid_thw: GridTHW) -> torch.Tensor:
        """The global-view path: ``(N * config.global_tokens, out_hidden_size)``."""
        patches, grid = self.global_view_patches(pixel_patches, grid_thw)
        return self._encode(patches, as_grid(grid))

    def global_view_patches(
        self, pixel_patches: torch.Tensor, grid_thw: GridTHW
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each item's first frame resized to ``global_grid x global_grid`` patches.

        The frame is rebuilt from its patches, resized bilinearly (no antialias)
        and cut again.

        Returns:
            ``patches`` ``(N * global_grid**2, C*p*p)`` and their ``grid_thw``, a
            CPU ``LongTensor`` of ``(1, global_grid, global_grid)`` rows.
        """
        cfg = self.config
        grid = as_grid(grid_thw)
        side = cfg.global_grid * cfg.patch_size
        views = []
        for start, (_, h, w) in zip(patch_offsets(grid)[:-1], grid, strict=True):
            frame = unpatchify_frame(pixel_patches[start : start + h * w], h, w, cfg)  # (C, H, W)
            resized = F.interpolate(
                frame[None].float(), size=(side, side), mode="bilinear", antialias=False
            )
            views.append(
                patchify_frames(
                    resized.to(pixel_patches.dtype), cfg.patch_size, cfg.spatial_merge_size
                )
            )
        view_grid = torch.tensor([[1, cfg.global_grid, cfg.global_grid]] * len(grid))
        return torch.cat([pixel_patches[:0], *views]), view_grid.reshape(-1, 3)

    # Host work on numpy: torch.compile of the tower runs it eagerly (dynamo's guards
    # on torch.from_numpy fail, under no_grad and inference mode; torch 2.11 and 2.14).
    @torch.compiler.disable
    def host_metadata(self, grid_thw: GridTHW) -> dict[str, torch.Tensor]:
        """The attention and position tensors :meth:`forward_packed` reads, on the host.

        Built outside any graph (it reads the grid on the host); a graph's static
        buffers take them in one copy each.

        Returns:
            ``cu_seqlens`` int32 ``(frames + 1,)``: one sequence per frame;
            ``positions`` int32 ``(patches, 2)``: each patch's row and column.
        """
        frames, offsets = _frames_and_offsets(grid_thw)
        positions = packed_positions(frames, self.config.spatial_merge_size)
        return {"cu_seqlens": torch.from_numpy(offsets), "positions": torch.from_numpy(positions)}

    def host_metadata_pieces(self, grid_thw: GridTHW) -> dict[str, list[np.ndarray]]:
        """:meth:`host_metadata` as numpy pieces, each tensor its pieces one after
        another: ``cu_seqlens`` whole, ``positions`` frame by frame, read-only views
        of cached tables (see :mod:`~examples.models.patch_positions`).

        The graph manager writes the pieces straight into a graph's buffers
        (:class:`~lightning_cg.engine.static_inputs.PieceRows`), without first stacking
        the positions into a new array, most of ``host_metadata``'s host time.
        """
        frames, offsets = _frames_and_offsets(grid_thw)
        merge = self.config.spatial_merge_size
        positions = [frame_positions(h, w, merge) for h, w in frames]
        return {"cu_seqlens": [offsets], "positions": positions or [_NO_POSITIONS]}

    def build_metadata(self, grid_thw: GridTHW, device: torch.device) -> dict[str, torch.Tensor]:
        """:meth:`host_metadata` on ``device``, copied without waiting for the GPU."""
        return {
            name: _to_device(tensor, device)
            for name, tensor in self.host_metadata(grid_thw).items()
        }

    def forward_packed(
        self,
        pixel_patches: torch.Tensor,
        cu_seqlens: torch.Tensor,
        positions: torch.Tensor,
        max_seqlen: int,
    ) -> torch.Tensor:
        """The graphable body: packed patches and metadata to output tokens.

        Rows past ``cu_seqlens[-1]`` are padding: they attend only each other and
        their output rows are to be dropped. With variable-length flash attention
        they cost no attention work.

        Args:
            pixel_patches: ``(T, C*p*p)``; ``T`` a multiple of ``merge**2``.
            cu_seqlens: int32 ``(frames + 1,)`` frame offsets into the rows.
            positions: integer ``(T, 2)`` patch row and column (zeros for padding).
            max_seqlen: an upper bound on the longest frame, as a Python int.

        Returns:
            ``(T / merge**2, out_hidden_size)``.
        """
        x = self.patch_embed(pixel_patches.to(self.patch_embed.weight.dtype))  # (T, D)
        attend = sequence_attention(cu_seqlens, x.shape[0], max_seqlen, self._uses_varlen(x.device))
        rotary_cos, rotary_sin = self._rotary_tables(positions)
        for block in self.blocks:
            x = block(x, rotary_cos, rotary_sin, attend)
        return self.merger(x)

    def _rotary_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin ``(T, head_dim // 2)``: half by patch row, half by column."""
        rotary_dim = self.config.head_dim // 2  # per axis
        exponents = (
            torch.arange(0, rotary_dim, 2, device=positions.device, dtype=torch.float32)
            / rotary_dim
        )
        inv_freq = _ROPE_THETA**-exponents  # (head_dim // 4,)
        angles = (positions.float()[..., None] * inv_freq).flatten(1)  # (T, head_dim // 2)
        return angles.cos(), angles.sin()

    def load_torchvision_vit(self, vit: nn.Module) -> None:
        """Copy the patch embedding and blocks of a torchvision ``VisionTransformer``.

        ``conv_proj`` becomes the patch embedding, each encoder layer a block and
        ``encoder.ln`` the merger's norm; the class token, position embedding, head
        and merger MLP are not used (positions here are rotary).

        Raises:
            ValueError: the ViT's sizes differ from this tower's config.
        """
        cfg = self.config
        layers = list(vit.encoder.layers)
        sizes = {
            "hidden_dim": (vit.hidden_dim, cfg.hidden_size),
            "num_layers": (len(layers), cfg.depth),
            "num_heads": (layers[0].num_heads if layers else cfg.num_heads, cfg.num_heads),
            "mlp_dim": (vit.mlp_dim, cfg.mlp_hidden_size),
            "patch_size": (vit.patch_size, cfg.patch_size),
            "in_channels": (vit.conv_proj.in_channels, cfg.in_channels),
        }
        mismatched = [
            f"{name}={theirs} (needs {ours})"
            for name, (theirs, ours) in sizes.items()
            if theirs != ours
        ]
        if mismatched:
            raise ValueError(
                "torchvision VisionTransformer does not match PackedViTConfig: "
                + ", ".join(mismatched)
            )
        conv = vit.conv_proj
        self.patch_embed.load_state_dict({"weight": conv.weight.flatten(1), "bias": conv.bias})
        for block, layer in zip(self.blocks, layers, strict=True):
            attention = layer.self_attention
            block.norm1.load_state_dict(layer.ln_1.state_dict())
            block.attn.qkv.load_state_dict(
                {"weight": attention.in_proj_weight, "bias": attention.in_proj_bias}
            )
            block.attn.proj.load_state_dict(attention.out_proj.state_dict())
            block.norm2.load_state_dict(layer.ln_2.state_dict())
            block.mlp[0].load_state_dict(layer.mlp[0].state_dict())
            block.mlp[2].load_state_dict(layer.mlp[3].state_dict())
        self.merger.norm.load_state_dict(vit.encoder.ln.state_dict())

    def _encode(self, patches: torch.Tensor, grid: list[tuple[int, int, int]]) -> torch.Tensor:
        metadata = self.build_metadata(grid, patches.device)
        max_seqlen = max((h * w for _, h, w in grid), default=0)
        return self.forward_packed(patches, **metadata, max_seqlen=max_seqlen)

    def _uses_varlen(self, device: torch.device) -> bool:
        dtype = self.patch_embed.weight.dtype
        if torch.is_autocast_enabled(device.type):
            dtype = torch.get_autocast_dtype(device.type)
        return varlen_supported(dtype, device, self.config.head_dim)


class _Attention(nn.Module):
    def __init__(self, config: PackedViTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        rows = x.shape[0]
        q, k, v = self.qkv(x).view(rows, 3, self.num_heads, self.head_dim).unbind(1)  # (T, H, hd)
        out = attend(_rotate(q, cos, sin), _rotate(k, cos, sin), v)
        return self.proj(out.reshape(rows, self.num_heads * self.head_dim))


class _Block(nn.Module):
    def __init__(self, config: PackedViTConfig) -> None:
        super().__init__()
        width = config.hidden_size
        self.norm1 = nn.LayerNorm(width, eps=_LAYER_NORM_EPS)
        self.attn = _Attention(config)
        self.norm2 = nn.LayerNorm(width, eps=_LAYER_NORM_EPS)
        self.mlp = nn.Sequential(
            nn.Linear(width, config.mlp_hidden_size),
            nn.GELU(),
            nn.Linear(config.mlp_hidden_size, width),
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, attend)
        return x + self.mlp(self.norm2(x))


class _PatchMerger(nn.Module):
    """Norm, then each window's ``merge**2`` consecutive rows concatenated -> MLP."""

    def __init__(self, config: PackedViTConfig) -> None:
        super().__init__()
        self.window_width = config.hidden_size * config.spatial_merge_size**2
        self.norm = nn.LayerNorm(config.hidden_size, eps=_LAYER_NORM_EPS)
        self.mlp = nn.Sequential(
            nn.Linear(self.window_width, self.window_width),
            nn.GELU(),
            nn.Linear(self.window_width, config.out_hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm(x).reshape(-1, self.window_width))  # (T / merge**2, out)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in float32: x ``(T, H, hd)``, cos and sin ``(T, hd // 2)``."""
    first, second = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return rotated.to(x.dtype)


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        nn.init.zeros_(module.bias)


def _frames_and_offsets(grid_thw: GridTHW) -> tuple[list[tuple[int, int]], np.ndarray]:
    """Each frame's ``(h, w)`` patches, and int32 frame offsets into the patches
    (``cu_seqlens``: one attention sequence per frame)."""
    frames = [(h, w) for t, h, w in as_grid(grid_thw) for _ in range(t)]
    # numpy, then one wrap: torch.tensor of a list costs several times more host time.
    offsets = np.array([0, *itertools.accumulate(h * w for h, w in frames)], np.int32)
    return frames, offsets


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy host metadata to ``device`` without waiting for the GPU.

    A copy from pageable memory synchronizes the stream, so the host could not
    prepare the next batch while the previous one runs; pinned memory copies
    asynchronously (the caching host allocator keeps the block until it is done).
    """
    # torch.compile traces with fake tensors, which cannot be pinned.
    if torch.device(device).type != "cuda" or torch.compiler.is_compiling():
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
