"""Packed attention for transformers towers, registered with ``transformers.AttentionInterface``.

The Qwen towers pass ``cu_seqlens`` to attention only for an implementation named "flash";
others split sequences on the host, a sync no graph can hold. :data:`ATTENTION_NAME` is
such a name, backed by :func:`lightning_cg.engine.attention.sequence_attention`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from lightning_cg.engine.attention import sequence_attention, varlen_supported

#: The implementation's name; "flash" in it selects the towers' cu_seqlens path.
ATTENTION_NAME = "lightning_cg_flash_varlen"


def packed_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Attention within each sequence of ``cu_seq_lens_q`` (keys share them), for transformers.

    ``query``, ``key``, ``value``: ``(1, heads, rows, head_dim)``; returns
    ``(1, rows, heads, head_dim)`` and no weights. ``max_length_q`` bounds the longest sequence.
    """
    if cu_seq_lens_q is None or max_length_q is None:
        raise ValueError(
            f"attention implementation {ATTENTION_NAME!r} needs cu_seq_lens_q and max_length_q "
            f"from the tower; {type(module).__name__} passed none: it does not pack sequences"
        )
    q, k, v = (tensor[0].transpose(0, 1) for tensor in (query, key, value))  # (T, H, hd)
    head_dim = q.shape[-1]
    scale = None if scaling is None or scaling == head_dim**-0.5 else scaling
    use_varlen = varlen_supported(q.dtype, q.device, head_dim)
    attend = sequence_attention(cu_seq_lens_q, q.shape[0], max_length_q, use_varlen, scale)
    return attend(q, k, v).unsqueeze(0), None


def register_packed_attention() -> None:
    """Register :data:`ATTENTION_NAME` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, packed_attention_forward)


def attention_configs(tower: nn.Module) -> list[object]:
    """The distinct configs the modules of ``tower`` read their attention implementation from."""
    configs = {}
    for module in tower.modules():
        config = getattr(module, "config", None)
        if hasattr(config, "_attn_implementation"):
            configs[id(config)] = config
    return list(configs.values())


@contextmanager
def packed_attention(configs: list[object]) -> Iterator[None]:
    """Run attention through :data:`ATTENTION_NAME` inside the block, then restore ``configs``.

    Set directly: ``set_attn_implementation`` would look the unknown name up on the Hub.
    """
    previous = [(config, config._attn_implementation) for config in configs]
    try:
        for config, _ in previous:
            config._attn_implementation = ATTENTION_NAME
        yield
    finally:
        for config, implementation in previous:
            config._attn_implementation = implementation
