"""GraphableEncoder adapters, the choice of one for a tower, and the row helpers they share.

May import: ``lightning_cg.engine``, ``lightning_cg.core``, torch and (lazily) transformers;
never Lightning, Hydra, serve, the callback or the app.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any, Literal, get_args

import torch
from torch import nn

from lightning_cg.engine.config import GraphConfig, check_rungs
from lightning_cg.engine.encoder import GraphableEncoder
from lightning_cg.engine.plan import path_budget_choices, resolve_path

#: The adapters chosen by name.
AdapterName = Literal["packed", "batched", "hf"]
ADAPTERS: tuple[str, ...] = get_args(AdapterName)
#: Builds the adapter of a tower (an adapter class is one).
AdapterFactory = Callable[[nn.Module], GraphableEncoder]
#: Module prefixes of libraries whose towers are called as tower(x [B, ...]).
BATCH_FIRST_LIBRARIES = ("torchvision.models", "timm.")


def adapter_for(tower: nn.Module, name: Any = None) -> GraphableEncoder:
    """The adapter that makes ``tower`` graphable.

    ``name``: ``packed`` (``tower(pixel_patches, grid_thw)``), ``batched`` (``tower(x)``, one
    tensor out), ``hf`` (``tower(pixel_values=x, **options)``, structured out; needs
    ``lightning-cg[hf]``), a GraphableEncoder, a callable that builds one (an adapter class),
    or None to choose by type. Raises ValueError for a ``name`` that is none of these (see
    :func:`check_adapter_argument`) or a tower no adapter fits, TypeError when the named
    adapter cannot serve it or a callable built no adapter.
    """
    check_adapter_argument(name)
    if is_built_adapter(name):
        return name
    if callable(name):
        adapter = name(tower)
        if not isinstance(adapter, GraphableEncoder):
            raise TypeError(
                f"adapter={name!r} built a {type(adapter).__name__}, which does not "
                "implement GraphableEncoder (see lightning_cg.engine.encoder)"
            )
        return adapter
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


def is_built_adapter(adapter: Any) -> bool:
    """Whether ``adapter`` is an adapter object (an adapter class is a factory, though the
    protocol check alone would take it for one)."""
    return isinstance(adapter, GraphableEncoder) and not isinstance(adapter, type)


def check_adapter_argument(adapter: Any) -> None:
    """Refuse (ValueError) an ``adapter`` that is no adapter name, GraphableEncoder, callable
    that builds one from the tower (an adapter class), or None."""
    if adapter is None or is_built_adapter(adapter) or isinstance(adapter, type):
        return
    if isinstance(adapter, str) and adapter in ADAPTERS:
        return
    allowed = (
        f"adapter must be one of {', '.join(ADAPTERS)}, a GraphableEncoder, a callable that "
        "builds one from the tower (an adapter class), or None"
    )
    if isinstance(adapter, nn.Module):
        # A module is callable, but calling it with the tower would run its forward.
        raise ValueError(
            f"{allowed} (a module that does not implement GraphableEncoder is a tower, not "
            f"its adapter); got adapter=a {type(adapter).__name__} module"
        )
    if not callable(adapter):
        raise ValueError(f"{allowed}; got adapter={adapter!r}")


def check_adapter_serves(adapter: Any, tower: nn.Module, where: str) -> None:
    """Refuse (ValueError) an adapter object built on another module than ``tower``, the
    tower ``where`` describes: it would serve that module's output for every call."""
    if not is_built_adapter(adapter):
        return
    wrapped = getattr(adapter, "tower", tower)
    if wrapped is not tower:
        raise ValueError(
            f"adapter={type(adapter).__name__} wraps a {type(wrapped).__name__} that is not "
            f"{where} ({type(tower).__name__}): build the adapter on that tower, or pass its "
            "class or a factory, which is called with the tower"
        )


def check_config_applies(adapter: GraphableEncoder, config: GraphConfig) -> None:
    """Refuse (ValueError) options that would fail ``adapter``'s tower without a word: a
    geometric ladder its ratio or align leaves only the two ends of the tower's range
    (:func:`~lightning_cg.engine.config.check_rungs`), and ``max_frames_per_batch`` on a
    batch-first tower, whose items are its rows (it would only turn calls eager)."""
    from lightning_cg.adapters.batched import BatchedEncoderAdapter

    for path, choice in path_budget_choices(adapter.graph_config(), config).items():
        budgets, _ = resolve_path(adapter, path, choice, config.max_items_per_batch)
        where = f"paths.{path}" if path in config.paths else "budgets"
        check_rungs(where, choice, budgets[0], budgets[-1])

    frames = config.max_frames_per_batch
    if frames is not None and isinstance(adapter, BatchedEncoderAdapter):
        raise ValueError(
            f"max_frames_per_batch={frames} counts the attention sequences (frames) of a packed "
            f"tower's sub-batch; {type(adapter).__name__} serves a batch-first tower, whose "
            f"items are its rows, so it would only run every call of more than {frames} rows "
            f"eagerly: pass max_items_per_batch={frames} to split calls into sub-batches of at "
            f"most {frames} rows, or drop max_frames_per_batch"
        )


#: Set on the forwards lightning-cg installs on a tower, to tell them from other wrappers.
GRAPHED_FORWARD = "_lightning_cg_graphed"


def graphed_forward_for(
    tower: nn.Module, encoder: GraphableEncoder, run: Callable[[Any], Any]
) -> Callable[..., Any]:
    """The forward to set on ``tower``'s instance: its calls go to ``run(inputs)``.

    A method bound to the tower, so that a deep copy of the tower (a user's, an averaging
    callback's) is bound to the copy, whose own weights no graph reads: a copy runs its
    class's forward.
    """

    def graphed_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if module is not tower:
            return type(module).forward(module, *args, **kwargs)
        return run(encoder.inputs_from_call(args, kwargs))

    setattr(graphed_forward, GRAPHED_FORWARD, True)
    return types.MethodType(graphed_forward, tower)


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
