"""What the Hydra apps check before any work: every value, and model against data.

:func:`check_config` runs on the composed config before anything is built, and asks the data
module's class, through its ``check_model_input(data, model_input)`` if it has one, whether it
can feed the tower ``model.input`` describes; :func:`check_tower` checks the built tower, before
the Trainer (its sizes against ``model.input``, and the graph plan by building a manager).
"""

from __future__ import annotations

import inspect
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_class, get_object, instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lightning_cg.adapters import adapter_for, check_config_applies
from lightning_cg.adapters.batched import fixed_image_side
from lightning_cg.app.schema import AppSchema
from lightning_cg.callback.checks import resolve_module
from lightning_cg.callback.graph_callback import CUDAGraphCallback
from lightning_cg.engine.manager import EncoderGraphManager

#: The tower's config attributes behind model.input's packed sizes (PackedViTConfig, the
#: Qwen configs): model.input key -> (config attribute, model.input's default).
TOWER_SIZES = {
    "patch_size": ("patch_size", None),
    "merge_size": ("spatial_merge_size", None),
    "temporal_patch_size": ("temporal_patch_size", 1),
}


class ConfigError(ValueError):
    """A config the apps refuse before any work; the app prints its message alone."""


#: Top-level keys an app config may have (``hydra`` when Hydra's own node is kept).
TOP_LEVEL_KEYS = (*AppSchema.__dataclass_fields__, "hydra")


def check_config(cfg: DictConfig, stage: str) -> CUDAGraphCallback:
    """Refuse a config that cannot work for app ``stage``, before anything is built; return
    its callback.

    Raises ConfigError naming the fields and what would fit, or Hydra's InstantiationException
    for a callback option.
    """
    unknown = sorted(set(cfg) - set(TOP_LEVEL_KEYS))
    if unknown:
        raise ConfigError(
            f"unknown top-level key(s) {unknown}; allowed: {', '.join(TOP_LEVEL_KEYS)}"
        )
    compare_eager = cfg.get("compare_eager")
    if compare_eager is not None and not isinstance(compare_eager, bool):
        raise ConfigError(
            f"compare_eager must be true, false or null (on a GPU only); got {compare_eager!r}"
        )
    passes = cfg.get("passes")
    if passes is not None and (
        not isinstance(passes, int) or isinstance(passes, bool) or passes < 1
    ):
        raise ConfigError(f"passes must be a positive integer or null (auto); got passes={passes}")
    _check_adapter_node(cfg.cudagraph.get("adapter"))
    callback = instantiate(cfg.cudagraph)
    served = "validate" if stage == "fit" else stage  # a fit's validation runs
    if served not in callback.stages:
        raise ConfigError(
            f"cudagraph.stages={list(callback.stages)} leaves out {served!r}, the stage this "
            f"app serves: add {served!r}, or leave the callback out of this run"
        )
    if "input" in cfg.model:  # else a model of the user's own: nothing to compare
        _check_data(cfg)
    return callback


def _check_adapter_node(adapter: Any) -> None:
    """Refuse a ``cudagraph.adapter`` node that builds its adapter now, without the tower the
    callback would pass (``_partial_: true`` makes it the factory the callback calls)."""
    if not isinstance(adapter, DictConfig) or adapter.get("_partial_", False):
        return
    target = adapter.get("_target_")
    try:
        signature = inspect.signature(get_object(target))
    except (ImportError, ValueError, TypeError):
        return  # no target, or none to read: instantiate names the fault
    arguments = {key: value for key, value in adapter.items() if not str(key).startswith("_")}
    try:
        signature.bind(**arguments)
    except TypeError as error:
        raise ConfigError(
            f"cudagraph.adapter={{_target_: {target}}} is built before the tower exists "
            f"({error}): add _partial_: true (cudagraph.adapter._partial_=true), so that the "
            "callback calls it with the tower"
        ) from None


def check_tower(cfg: DictConfig, model: nn.Module, callback: CUDAGraphCallback) -> nn.Module:
    """Refuse a built tower the data or the graph options cannot serve (ConfigError); return it."""
    try:
        tower = resolve_module(model, callback.module, callback.adapter)
    except ValueError as error:
        raise ConfigError(f"cudagraph.module={callback.module!r}: {error}") from None
    if "input" in cfg.model and cfg.model.input.get("image_size") is None:
        _check_tower_sizes(cfg, getattr(tower, "config", None))
    elif "input" in cfg.model:
        side, wanted = fixed_image_side(tower), cfg.model.input.image_size
        if side is not None and side != wanted:
            raise ConfigError(
                f"model.input.image_size={wanted} disagrees with the tower "
                f"{type(tower).__name__}, which takes {side}x{side} images only; set "
                f"model.input.image_size={side} (the data is made at that side)"
            )
    try:
        adapter = adapter_for(tower, callback.adapter)
    except ValueError as error:
        raise ConfigError(f"cudagraph.module={callback.module!r}: {error}") from None
    try:
        check_config_applies(adapter, callback.config)
        EncoderGraphManager(adapter, callback.config)
    except ValueError as error:
        raise ConfigError(f"cudagraph: {error}") from None
    return tower


def _check_data(cfg: DictConfig) -> None:
    """Ask the data module's class whether it can feed ``model.input`` (its
    ``check_model_input``, if it has one: the examples' data modules do)."""
    target = cfg.data.get("_target_")
    if not isinstance(target, str):
        return  # no class to ask: instantiating the data reports what is wrong
    try:
        data_class = get_class(target)
    except (ImportError, ValueError):  # the same: instantiate names the target's fault
        return
    check = getattr(data_class, "check_model_input", None)
    if check is None:
        return
    try:
        check(cfg.data, cfg.model.input)
    except ValueError as error:
        raise ConfigError(
            f"data={_choice(cfg, 'data')} cannot feed model={_model_name(cfg)}: {error}"
        ) from None


def _check_tower_sizes(cfg: DictConfig, tower_config: Any) -> None:
    """model.input's packed sizes against the built tower's config (overridable apart)."""
    for input_key, (tower_key, default) in TOWER_SIZES.items():
        tower_value = getattr(tower_config, tower_key, None)
        declared = cfg.model.input.get(input_key, default)
        if isinstance(tower_value, int) and declared != tower_value:
            raise ConfigError(
                f"model.input.{input_key}={declared} disagrees with the tower of "
                f"model={_model_name(cfg)}: its config has {tower_key}={tower_value}; set "
                f"model.input.{input_key}={tower_value} (the data follows it)"
            )


def _choice(cfg: DictConfig, group: str) -> str:
    """The config group's option (``data=photos``), else its ``_target_``'s class name."""
    if HydraConfig.initialized():
        return HydraConfig.get().runtime.choices.get(group, "?")
    return str(cfg[group].get("_target_", "?")).rsplit(".", 1)[-1]


def _model_name(cfg: DictConfig) -> str:
    if HydraConfig.initialized():
        return HydraConfig.get().runtime.choices.get("model", "?")
    tower: Any = OmegaConf.select(cfg, "model.module.vision_tower", default={})
    return tower.get("name") or str(tower.get("_target_", "?")).rsplit(".", 1)[-1]
