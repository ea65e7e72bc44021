"""GraphableEncoder adapters, the choice of one for a tower, and the row helpers they share.

May import: ``lightning_cg.engine``, ``lightning_cg.core``, torch and (lazily) transformers;
never Lightning, Hydra, serve, the callback or the app.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_cg.engine.encoder import GraphableEncoder

ADAPTERS = ("packed", "batched", "hf")
#: Module prefixes of libraries whose towers are called as tower(x [B, ...]).
BATCH_FIRST_LIBRARIES = ("torchvision.models", "timm.")


def adapter_for(tower: nn.Module, name: Any = None) -> GraphableEncoder:
    """The adapter that makes ``tower`` graphable.

    ``name``: ``packed`` (``tower(pixel_patches, grid_thw)``), ``batched`` (``tower(x)``, one
    tensor out), ``hf`` (``tower(pixel_values=x, **options)``, structured out; needs
    ``lightning-cg[hf]``), a GraphableEncoder, a callable that builds one (an adapter class),
    or None to choose by type. Raises ValueError for an unknown name or a tower no adapter
    fits, TypeError when the named adapter cannot serve it or a callable built no adapter.
    """
    # An adapter class is a factory; the protocol check alone would take it for an adapter.
    if isinstance(name, GraphableEncoder) and not isinstance(name, type):
        return name
    if callable(name):
        adapter = name(tower)
        if not isinstance(adapter, GraphableEncoder):
            raise TypeError(
                f"adapter={name!r} built a {type(adapter).__name__}, which does not "
                "implement GraphableEncoder (see lightning_cg.engine.encoder)"
            )
        return adapter
    if name is not None and name not in ADAPTERS:
        raise ValueError(f"adapter must be one of {', '.join(ADAPTERS)} or None; got {name!r}")
    if name is None:
        if isinstance(tower, GraphableEncoder):
            return tower
        name = adapter_name_by_type(tower)
        if name is None:
            raise ValueError(
                f"no adapter fits a tower of type {type(tower).__qualname__} (forward"
                f"{inspect.signature(tower.forward)}): its forward does not take "
                "(pixel_patches, grid_thw), and it is not a torchvision or timm model, nor a "
                "transformers model whose forward takes pixel_values. Pass "
                "adapter='batched' for a tower called as tower(x) with items as batch rows that "
                "returns one tensor, adapter='hf' for tower(pixel_values=x, **options) returning "
                "a ModelOutput, tuple or dict of batch-first tensors, adapter='packed' for "
                "tower(pixel_patches, grid_thw), or implement "
                "lightning_cg.engine.encoder.GraphableEncoder on the tower (graph_config, "
                "item_specs, capture_inputs, graph_forward, ...; see README)"
            )
    elif name != "packed" and takes_packed_patches(tower):
        raise TypeError(
            f"adapter={name!r} serves towers whose items are the batch rows; "
            f"{type(tower).__qualname__} is called as tower(pixel_patches, grid_thw), its "
            "items packed along the rows: use adapter='packed', or adapter=None to choose by type"
        )
    if name == "packed":
        by_type = adapter_name_by_type(tower)
        if by_type not in (None, "packed"):
            raise TypeError(
                f"adapter='packed' serves towers called as tower(pixel_patches, grid_thw); "
                f"{type(tower).__qualname__} takes its items as batch rows: use "
                f"adapter={by_type!r}, or adapter=None to choose by type"
            )
        from lightning_cg.adapters.qwen import QwenVisionAdapter, qwen_tower_kind

        if qwen_tower_kind(tower) is not None:
            return QwenVisionAdapter(tower)
        from lightning_cg.adapters.packed import PackedEncoderAdapter

        return PackedEncoderAdapter(tower)
    if name == "hf":
        from lightning_cg.adapters.hf import HFEncoderAdapter

        return HFEncoderAdapter(tower)
    from lightning_cg.adapters.batched import BatchedEncoderAdapter

    return BatchedEncoderAdapter(tower)


#: Set on the forwards lightning-cg installs on a tower, to tell them from other wrappers.
GRAPHED_FORWARD = "_lightning_cg_graphed"


def foreign_forward(tower: nn.Module) -> Any:
    """A forward another library set on ``tower``'s instance (accelerate's hooks, a user's
    wrapper), or None. Adapters run the class's forward, which would bypass it."""
    forward = tower.__dict__.get("forward")
    return None if forward is None or getattr(forward, GRAPHED_FORWARD, False) else forward


def foreign_forward_message(tower: nn.Module, where: str) -> str:
    """Why a tower with a :func:`foreign_forward` is not served through graphs."""
    return (
        f"{where}: {type(tower).__name__}'s forward is set on the instance (a wrapper such "
        "as accelerate's hooks); graphs replay the class's forward and would bypass it, "
        "changing what the tower returns. Remove the wrapper (or serve the module it "
        "wraps) to run the tower through graphs"
    )


def adapter_name_by_type(tower: nn.Module) -> str | None:
    """The adapter name ``adapter_for(tower)`` picks by type; None when none fits."""
    from lightning_cg.adapters.qwen import qwen_tower_kind

    if takes_packed_patches(tower) or qwen_tower_kind(tower) is not None:
        return "packed"
    if type(tower).__module__.startswith(BATCH_FIRST_LIBRARIES):
        return "batched"
    if is_transformers_tower(tower):
        return "hf"
    return None


def is_transformers_tower(tower: nn.Module) -> bool:
    """Whether ``tower`` is a transformers ``PreTrainedModel`` taking ``pixel_values``."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(tower, transformers.PreTrainedModel):
        return False
    return "pixel_values" in forward_parameters(tower)


def forward_parameters(tower: nn.Module) -> list[str]:
    """Parameter names of the class ``forward`` (no instance wrapper); [] where unreadable."""
    try:
        return list(inspect.signature(type(tower).forward).parameters)
    except (TypeError, ValueError):
        return []


def takes_packed_patches(tower: nn.Module) -> bool:
    """Whether the class ``forward`` starts ``pixel_patches, grid_thw`` (after ``self``)."""
    return forward_parameters(tower)[1:3] == ["pixel_patches", "grid_thw"]


def as_slice(indices: Sequence[int]) -> slice | None:
    """``indices`` as a slice when consecutive and ascending (so selecting is a view)."""
    if indices and list(indices) == list(range(indices[0], indices[0] + len(indices))):
        return slice(indices[0], indices[0] + len(indices))
    return None


def select_rows(batch: torch.Tensor, indices: Sequence[int]) -> torch.Tensor:
    """The rows of ``batch`` at ``indices``, in that order (a view when consecutive)."""
    consecutive = as_slice(indices)
    if consecutive is not None:
        return batch[consecutive]
    # From pinned memory: a pageable host-to-device copy would wait for the GPU.
    index = torch.as_tensor(indices, dtype=torch.long)
    if batch.is_cuda:
        index = index.pin_memory().to(batch.device, non_blocking=True)
    return batch[index]


def join_rows(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(rows)``, or a view without the copy when ``rows`` split one tensor whole."""
    first = rows[0]
    # Rows of different bases are joined by a copy without the per-row checks below.
    if len(rows) > 1 and (first._base is None or any(row._base is not first._base for row in rows)):
        return torch.cat(rows)
    storage = first.untyped_storage()
    position = storage.data_ptr()
    for row in rows:
        if not (
            row.is_contiguous()
            and row.shape[1:] == first.shape[1:]
            and (row.dtype, row.device) == (first.dtype, first.device)
            and row.numel() > 0
            and row.data_ptr() == position
        ):
            return torch.cat(rows)
        position += row.nbytes
    if position != storage.data_ptr() + storage.nbytes():
        return torch.cat(rows)
    count = sum(row.shape[0] for row in rows)
    return first.as_strided((count, *first.shape[1:]), first.stride(), first.storage_offset())
