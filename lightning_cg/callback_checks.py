"""What :class:`~lightning_cg.callback.CUDAGraphCallback` refuses, and where it finds the tower.

Its own arguments are checked at construction, the trainer's strategy at
``setup``; the tower is the submodule at a dotted attribute path of the
LightningModule. Every error names the field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from torch import nn

from lightning_cg.adapters import ADAPTERS
from lightning_cg.config import GraphConfig
from lightning_cg.encoder import GraphableEncoder

STAGES = ("validate", "test", "predict")
#: Builds the adapter of a tower (an adapter class is one).
AdapterFactory = Callable[[nn.Module], GraphableEncoder]
#: Strategies that shard parameters: a graph would capture one shard's addresses.
REFUSED_STRATEGIES = (FSDPStrategy, DeepSpeedStrategy, ModelParallelStrategy)


def check_callback_args(module: Any, stages: Any, flags: Mapping[str, Any], adapter: Any) -> None:
    """Raise a ValueError for a ``module`` that is no dotted attribute path, ``stages``
    outside :data:`STAGES`, a flag (by name) that is not a bool, or an ``adapter``
    that is no adapter name, adapter or callable."""
    if not isinstance(module, str) or not all(part.isidentifier() for part in module.split(".")):
        raise ValueError(
            f"module must be a dotted attribute path like 'model.visual'; got {module!r}"
        )
    _check_stages(stages)
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false; got {name}={value!r}")
    named = isinstance(adapter, str) and adapter in ADAPTERS
    if not (adapter is None or named or _is_adapter_or_factory(adapter)):
        raise ValueError(
            f"adapter must be one of {', '.join(ADAPTERS)}, a GraphableEncoder, a callable "
            f"that builds one from the tower, or None; got adapter={adapter!r}"
        )


def graph_config(config: Any, options: Mapping[str, Any]) -> GraphConfig:
    """The callback's graph options: ``config`` or the keyword ``options``, not both.

    A capture that fails mid-run turns the rank eager, not the run into an error,
    so ``capture_errors`` is the callback's to set.

    Raises:
        ValueError: both given, ``config`` no GraphConfig, ``capture_errors``
            among the options, or a bad option (named, with the allowed values).
    """
    if "capture_errors" in options:
        raise ValueError(
            "capture_errors is not a callback option: a capture that fails mid-run "
            "always turns the rank eager"
        )
    if config is None:
        return GraphConfig.from_options(capture_errors="eager", **options)
    if not isinstance(config, GraphConfig):
        raise ValueError(f"config must be a GraphConfig or None; got config={config!r}")
    if options:
        raise ValueError(
            f"config holds every graph option; pass {sorted(options)} inside it, not beside it"
        )
    return dataclasses.replace(config, capture_errors="eager")


def check_strategy(trainer: pl.Trainer) -> None:
    """Raise a RuntimeError for a strategy that shards parameters."""
    if isinstance(trainer.strategy, REFUSED_STRATEGIES):
        strategy = type(trainer.strategy).__name__
        raise RuntimeError(
            f"CUDAGraphCallback does not support {strategy}: it shards parameters, and a "
            "graph captured on one shard's addresses cannot replay. Use strategy='ddp' or "
            "'auto', or remove the callback."
        )


def resolve_module(pl_module: nn.Module, path: str) -> nn.Module:
    """The submodule at a dotted attribute path, with an error naming what is missing."""
    try:
        module = operator.attrgetter(path)(pl_module)
    except AttributeError:
        children = ", ".join(name for name, _ in pl_module.named_children()) or "none"
        raise ValueError(
            f"module={path!r} does not exist on {type(pl_module).__name__}; "
            f"its child modules: {children}"
        ) from None
    if not isinstance(module, nn.Module):
        raise ValueError(f"module={path!r} is a {type(module).__name__}, not a torch.nn.Module")
    return module


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` is wrapped by ``torch.compile`` (the callback leaves it alone)."""
    return hasattr(module, "_orig_mod")


def _is_adapter_or_factory(adapter: Any) -> bool:
    if isinstance(adapter, type):
        return True  # an adapter class builds the adapter
    return isinstance(adapter, GraphableEncoder) or (
        callable(adapter) and not isinstance(adapter, nn.Module)
    )


def _check_stages(stages: Any) -> None:
    if isinstance(stages, str) or not isinstance(stages, Sequence):
        raise ValueError(
            f"stages must be a list of stage names from {', '.join(STAGES)}; got stages={stages!r}"
        )
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        raise ValueError(f"stages has {unknown}; allowed: {', '.join(STAGES)}")
