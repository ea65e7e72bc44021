"""Attention within the sequences of packed rows, with no host syncs.

Packed towers hold many attention sequences (frames, windows) in one ``(T, H, hd)``
tensor, delimited by ``cu_seqlens``. Two implementations, both capturable in a
CUDA graph: torch's variable-length flash attention (CUDA, fp16/bf16), where
rows past ``cu_seqlens[-1]`` cost nothing, and elsewhere SDPA under a
block-diagonal mask built on the device.
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

    Built on the device without host syncs. Rows past ``cu_seqlens[-1]`` (padding)
    share one id of their own, so they attend only each other and never produce NaN;
    empty sequences (repeated offsets) own no rows.

    The ids are searched in the whole ``cu_seqlens`` (sequence ``i`` is id ``i + 1``,
    padding ``len(cu_seqlens)``), never in the view ``cu_seqlens[1:]``: inductor's
    Triton lowering of ``searchsorted`` (torch before pytorch/pytorch#184043, 2.11
    among them) drops a view's storage offset and searches ``cu_seqlens[:-1]``,
    which merges the last sequence with the padding rows whenever it fills the
    last offset slot. Compiled Qwen blocks (which build this mask inside the
    compiled region) gave wrong outputs on the GPU that way.
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

    Args:
        cu_seqlens: int32 ``(sequences + 1,)`` offsets into the rows; rows past the
            last offset are padding (their output rows are zeros with varlen
            attention, attention among themselves otherwise).
        rows: rows of the q, k and v the returned function takes.
        max_seqlen: an upper bound on the longest sequence, as a Python int.
        use_varlen: use variable-length flash attention (see :func:`varlen_supported`).
        scale: softmax scale; None is ``head_dim ** -0.5``.
    """
    if use_varlen and rows > 0:  # varlen attention refuses an empty batch
        # Flash attention never writes rows past the last sequence; zero them so
        # padding holds no stale memory.
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
