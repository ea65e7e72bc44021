"""Attention within the ``cu_seqlens`` sequences of packed rows, with no host syncs.

Variable-length flash attention (CUDA, fp16/bf16), else SDPA under a block-diagonal mask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch without variable-length flash attention
    varlen_attn = None

#: ``attend(q, k, v)`` on ``(T, H, hd)`` tensors, returning ``(T, H, hd)``.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def varlen_supported(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether :func:`sequence_attention` can use variable-length flash attention."""
    return (
        varlen_attn is not None
        and torch.device(device).type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and head_dim % 8 == 0
        and head_dim <= 256
    )


def block_diagonal_mask(cu_seqlens: torch.Tensor, rows: int) -> torch.Tensor:
    """``(rows, rows)`` boolean mask: row i may attend row j iff both lie in one sequence.

    Padding rows share an id of their own (they never produce NaN). The ids are searched
    in the whole ``cu_seqlens``, never the view ``cu_seqlens[1:]``: inductor's
    ``searchsorted`` drops a view's storage offset (pytorch/pytorch#184043).
    """
    positions = torch.arange(rows, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    sequence_ids = torch.searchsorted(cu_seqlens, positions, right=True)  # (rows,)
    return sequence_ids[:, None] == sequence_ids[None, :]


def sequence_attention(
    cu_seqlens: torch.Tensor,
    rows: int,
    max_seqlen: int,
    use_varlen: bool,
    scale: float | None = None,
) -> Attend:
    """Attention within each sequence of ``cu_seqlens``, for ``rows`` packed rows.

    ``cu_seqlens``: int32 offsets; rows past the last are padding. ``max_seqlen``: a
    Python int bound on the longest sequence. ``scale`` None is ``head_dim ** -0.5``.
    """
    if use_varlen and rows > 0:  # varlen attention refuses an empty batch
        # Flash attention never writes rows past the last sequence: zero them.
        inside = torch.arange(rows, device=cu_seqlens.device) < cu_seqlens[-1]
        # Older torch's varlen_attn takes no scale: pass it only when it is not the default.
        options = {} if scale is None else {"scale": scale}

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **options)
            return torch.where(inside[:, None, None], out, 0.0)

        return attend
    mask = block_diagonal_mask(cu_seqlens, rows)  # (T, T)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (tensor.transpose(0, 1) for tensor in (q, k, v))  # (H, T, hd)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return out.transpose(0, 1)

    return attend
