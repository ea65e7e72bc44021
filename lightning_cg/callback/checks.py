"""What the callback refuses (naming field, value and what is allowed); where it finds the tower."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args

import lightning.pytorch as pl
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from torch import nn
from torch.utils.data import DistributedSampler

from lightning_cg.adapters import (
    adapter_name_by_type,
    check_adapter_argument,
    forward_parameters,
    is_built_adapter,
)
from lightning_cg.engine.encoder import GraphableEncoder

#: The stages the callback serves.
StageName = Literal["validate", "test", "predict"]
STAGES: tuple[str, ...] = get_args(StageName)
#: Strategies that shard parameters: a graph would capture one shard's addresses.
REFUSED_STRATEGIES = (FSDPStrategy, DeepSpeedStrategy, ModelParallelStrategy)
#: Forward parameters of a model that takes text besides images (CLIPModel, a
#: vision-language model): not a tower itself, its vision tower is a submodule.
TEXT_INPUTS = ("input_ids", "decoder_input_ids")


def check_callback_args(module: Any, stages: Any, flags: Mapping[str, Any], adapter: Any) -> None:
    """Refuse (ValueError) a ``module`` that is no dotted path, bad ``stages``, a flag
    that is not a bool, or an ``adapter`` that is none (:func:`check_adapter_argument`)."""
    if module is not None and (
        not isinstance(module, str)
        # Digits index an nn.ModuleList or nn.Sequential, as in named_modules' paths.
        or not all(part.isidentifier() or part.isdigit() for part in module.split("."))
    ):
        raise ValueError(
            "module must be a dotted path like 'model.visual' or 'towers.0', or None to find "
            f"the vision tower; got module={module!r}"
        )
    if isinstance(stages, str | bytes) or not isinstance(stages, Sequence) or not stages:
        raise ValueError(
            f"stages must be a non-empty list of stage names from {', '.join(STAGES)}; got "
            f"stages={stages!r} (without graphs in any stage, leave the callback out)"
        )
    unknown = sorted({repr(stage) for stage in stages if stage not in STAGES})
    if unknown:
        raise ValueError(f"stages has {', '.join(unknown)}; allowed: {', '.join(STAGES)}")
    repeated = sorted({stage for stage in stages if list(stages).count(stage) > 1})
    if repeated:
        raise ValueError(f"stages lists {', '.join(repeated)} more than once; got {list(stages)}")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false; got {name}={value!r}")
    check_adapter_argument(adapter)


def check_strategy(trainer: pl.Trainer) -> None:
    """Raise a RuntimeError for a strategy that shards parameters."""
    if isinstance(trainer.strategy, REFUSED_STRATEGIES):
        strategy = type(trainer.strategy).__name__
        raise RuntimeError(
            f"CUDAGraphCallback does not support {strategy}: it shards parameters, and a "
            "graph captured on one shard's addresses cannot replay. Use strategy='ddp' or "
            "'auto', or remove the callback."
        )


def check_batches_not_sharded(trainer: pl.Trainer, stage: str) -> None:
    """Refuse ``encoder_data_parallel`` where the ``stage``'s dataloaders shard the data over
    ranks: each rank would encode its share of another rank's batch as if of its own."""
    loaders = {
        "validate": trainer.val_dataloaders,
        "test": trainer.test_dataloaders,
        "predict": trainer.predict_dataloaders,
    }[stage]
    for loader in _flat(loaders):
        batch_sampler = getattr(loader, "batch_sampler", None)
        for sampler in (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)):
            if isinstance(sampler, DistributedSampler):
                raise _sharded_data(f"the {stage} dataloader", type(sampler).__name__)


def check_sampler_setting(trainer: pl.Trainer) -> None:
    """Refuse ``encoder_data_parallel`` under a Trainer that shards every stage's data over
    ranks; at a fit's start, so before any training (its validation data is set up later)."""
    # Private, so read defensively: without it, each run's start checks the dataloaders.
    if getattr(getattr(trainer, "_accelerator_connector", None), "use_distributed_sampler", False):
        raise _sharded_data("this Trainer", "use_distributed_sampler=True")


def _sharded_data(source: str, how: str) -> ValueError:
    return ValueError(
        "encoder_data_parallel=True shares out the items of a batch that every rank holds, "
        f"but {source} gives each rank its own batches ({how}): pass "
        "Trainer(use_distributed_sampler=False) so that every rank gets the same batches, "
        "or encoder_data_parallel=False"
    )


def _flat(loaders: Any) -> list[Any]:
    """The dataloaders of a stage's loader collection (one, a list or a mapping)."""
    if isinstance(loaders, Mapping):
        return list(loaders.values())
    if isinstance(loaders, list | tuple):
        return list(loaders)
    return [] if loaders is None else [loaders]


def resolve_module(pl_module: nn.Module, path: str | None, adapter: Any = None) -> nn.Module:
    """The submodule at a dotted attribute path, or for None the one tower
    (:func:`find_tower`, told by ``adapter``)."""
    if path is None:
        return find_tower(pl_module, adapter)[1]
    module, walked = pl_module, []
    for part in path.split("."):
        if not hasattr(module, part):
            where = ".".join(walked) or type(pl_module).__name__
            children = ", ".join(name for name, _ in module.named_children()) or "none"
            raise ValueError(
                f"module={path!r} does not exist: {where} has no {part!r}; "
                f"its child modules: {children}"
            )
        module = getattr(module, part)
        walked.append(part)
    if not isinstance(module, nn.Module):
        raise ValueError(f"module={path!r} is a {type(module).__name__}, not a torch.nn.Module")
    return module


def find_tower(pl_module: nn.Module, adapter: Any = None) -> tuple[str, nn.Module]:
    """The dotted path and module of the one vision tower in ``pl_module`` (else ValueError):
    the module an adapter object wraps, or the outermost :func:`is_tower` (a timm model's
    blocks are parts of its tower)."""
    owner = type(pl_module).__name__
    wrapped = getattr(adapter, "tower", None) if is_built_adapter(adapter) else None
    if isinstance(wrapped, nn.Module):
        return _wrapped_tower(pl_module, adapter, wrapped)
    found: list[tuple[str, nn.Module]] = []
    # named_modules walks depth first, a module before its submodules.
    for path, module in pl_module.named_modules():
        if not path or any(path.startswith(f"{outer}.") for outer, _ in found):
            continue  # the LightningModule itself, or a part of a tower found already
        if is_tower(module):
            found.append((path, module))
    if len(found) == 1:
        return found[0]
    if not found:
        children = ", ".join(name for name, _ in pl_module.named_children()) or "none"
        told = "" if adapter is None else f" (adapter={_named(adapter)} says how, not which)"
        raise ValueError(
            f"CUDAGraphCallback found no vision tower in {owner}: no submodule is a "
            "torchvision or timm model, a transformers vision model, a Qwen vision tower, "
            "a tower whose forward takes (pixel_patches, grid_thw), or a GraphableEncoder. "
            f"Pass module='<dotted path>'{told} (and adapter=... if its type picks none); "
            f"its child modules: {children}"
        )
    listed = ", ".join(f"{path!r} ({type(module).__name__})" for path, module in found)
    raise ValueError(
        f"CUDAGraphCallback found {len(found)} vision towers in {owner}: {listed}. "
        f"Pass module= the one to serve, e.g. CUDAGraphCallback(module={found[0][0]!r}), "
        "and one callback per tower."
    )


def _named(adapter: Any) -> str:
    """An adapter argument as an error names it: a name by its repr, else by its name."""
    return (
        repr(adapter)
        if isinstance(adapter, str)
        else getattr(adapter, "__qualname__", type(adapter).__name__)
    )


def _wrapped_tower(pl_module: nn.Module, adapter: Any, wrapped: nn.Module) -> tuple[str, nn.Module]:
    """The path of the module an adapter object wraps, which must be in ``pl_module``."""
    for path, module in pl_module.named_modules():
        if path and module is wrapped:
            return path, module
    raise ValueError(
        f"adapter={type(adapter).__name__} wraps a {type(wrapped).__name__} that is no "
        f"submodule of {type(pl_module).__name__}: build the adapter on the module's tower, "
        "or pass its class or a factory (called with the tower found) and module= its path"
    )


def is_tower(module: nn.Module) -> bool:
    """Whether ``module`` is taken for a vision tower untold: a GraphableEncoder, or a type
    ``adapter_for`` picks an adapter for whose forward takes no text. A ``torch.compile``
    wrapper is judged by the module it wraps."""
    if is_compiled(module):
        module = module._orig_mod
    if isinstance(module, GraphableEncoder):
        return True
    if adapter_name_by_type(module) is None:
        return False
    return not set(TEXT_INPUTS) & set(forward_parameters(module))


def check_one_callback_per_tower(
    callback: Any, others: Sequence[Any], pl_module: nn.Module, tower: nn.Module
) -> None:
    """Refuse a second callback on ``tower``: the first to finish would put back the
    other's wrapper, not the tower's forward."""
    for other in others:
        if other is callback:
            continue
        try:
            same = resolve_module(pl_module, other.module) is tower
        except ValueError:
            continue  # the other callback reports its own missing tower at its setup
        if same:
            raise ValueError(
                f"two CUDAGraphCallbacks serve the same tower {type(tower).__name__}: "
                f"{describe(callback)} and {describe(other)}. Keep one callback per tower "
                "(one callback serves several stages: pass stages=[...])."
            )


def describe(callback: Any) -> str:
    """A callback's identifying settings, as in an error message."""
    return (
        f"CUDAGraphCallback(module={callback.module!r}, stages={list(callback.stages)}, "
        f"mode={callback.mode.value!r})"
    )


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` is wrapped by ``torch.compile`` (the callback leaves it alone)."""
    return hasattr(module, "_orig_mod")
