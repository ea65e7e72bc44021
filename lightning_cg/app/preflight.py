"""What the Hydra apps check before any work: every value, and model against data.

:func:`check_config` runs on the composed config before anything is built; :func:`check_tower`
on the built tower, before the Trainer (its sizes, and the graph plan by building a manager).
"""

from __future__ import annotations

from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lightning_cg.adapters import adapter_for
from lightning_cg.adapters.batched import fixed_image_side
from lightning_cg.app.schema import AppSchema
from lightning_cg.callback.checks import resolve_module
from lightning_cg.callback.graph_callback import CUDAGraphCallback
from lightning_cg.engine.manager import EncoderGraphManager

PACKED = "packed"
BATCH_FIRST = "batch-first"
#: The conf/data options, by the ``_target_`` of their data module. PhotosDataModule
#: serves batch-first images when ``fixed_size`` is set, packed batches otherwise.
DATA_OPTIONS = {
    "examples.data.synthetic.FakeDataModule": "fake",
    "examples.data.photos.PhotosDataModule": "photos",
    "examples.data.synthetic.SyntheticDataModule": "synthetic",
}
#: The batch kinds each conf/data option can serve.
DATA_KINDS = {"fake": (BATCH_FIRST,), "photos": (PACKED, BATCH_FIRST), "synthetic": (PACKED,)}
#: Sizes packed data must share with the tower: data key -> (model.input key, default).
PACKED_SIZES = {
    "patch_size": ("patch_size", None),
    "merge_size": ("merge_size", None),
    "temporal_patch_size": ("temporal_patch_size", 1),
}
#: Sizes batch-first data must share with the tower (fake's and photos' image side).
BATCH_FIRST_SIZES = {"image_size": ("image_size", None), "fixed_size": ("image_size", None)}
#: The tower's config attributes behind the packed sizes (PackedViTConfig, the Qwen configs).
TOWER_SIZES = {
    "patch_size": "patch_size",
    "merge_size": "spatial_merge_size",
    "temporal_patch_size": "temporal_patch_size",
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
    callback = instantiate(cfg.cudagraph)
    served = "validate" if stage == "fit" else stage  # a fit's validation runs
    if served not in callback.stages:
        raise ConfigError(
            f"cudagraph.stages={list(callback.stages)} leaves out {served!r}, the stage this "
            f"app serves: add {served!r}, or leave the callback out of this run"
        )
    if "input" in cfg.model:  # else a model of the user's own: nothing to compare
        _check_batch_kind(cfg)
        _check_shared_sizes(cfg)
    return callback


def check_tower(cfg: DictConfig, model: nn.Module, callback: CUDAGraphCallback) -> nn.Module:
    """Refuse a built tower the data or the graph options cannot serve (ConfigError); return it."""
    try:
        tower = resolve_module(model, callback.module)
    except ValueError as error:
        raise ConfigError(f"cudagraph.module={callback.module!r}: {error}") from None
    if "input" in cfg.model and _tower_kind(cfg) == PACKED:
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
        EncoderGraphManager(adapter, callback.config)
    except ValueError as error:
        raise ConfigError(f"cudagraph: {error}") from None
    return tower


def _tower_kind(cfg: DictConfig) -> str:
    return BATCH_FIRST if cfg.model.input.get("image_size") is not None else PACKED


def _check_batch_kind(cfg: DictConfig) -> None:
    option = DATA_OPTIONS.get(cfg.data.get("_target_"))
    if option is None:
        return  # a data module of the user's own: nothing to compare
    # Photos are packed unless data.fixed_size is set; every other option serves one kind.
    fixed = option == "photos" and cfg.data.get("fixed_size") is not None
    wanted, served = _tower_kind(cfg), BATCH_FIRST if fixed else DATA_KINDS[option][0]
    if wanted == served:
        return
    takes = {
        PACKED: "packed batches (pixel_patches, grid_thw; model.input.image_size is null)",
        BATCH_FIRST: f"batch-first images of side model.input.image_size="
        f"{cfg.model.input.get('image_size')}",
    }
    serves = {PACKED: "packed batches", BATCH_FIRST: "batch-first images"}
    photos = {PACKED: "data.fixed_size=null", BATCH_FIRST: "data.fixed_size=model.input.image_size"}
    fits = [name for name, kinds in DATA_KINDS.items() if wanted in kinds]
    if HydraConfig.initialized():
        option = HydraConfig.get().runtime.choices.get("data", option)
    raise ConfigError(
        f"model={_model_name(cfg)} takes {takes[wanted]}, but data={option} "
        f"serves {serves[served]}; data options that fit: {', '.join(fits)} "
        f"(photos with {photos[wanted]})"
    )


def _check_shared_sizes(cfg: DictConfig) -> None:
    data, model_input = cfg.data, cfg.model.input
    sizes = PACKED_SIZES if _tower_kind(cfg) == PACKED else BATCH_FIRST_SIZES
    for data_key, (input_key, default) in sizes.items():
        expected = model_input.get(input_key, default)
        if data_key in data and expected is not None and data[data_key] != expected:
            raise ConfigError(
                f"data.{data_key}={data[data_key]} disagrees with the tower of "
                f"model={_model_name(cfg)}: model.input.{input_key}={expected}; "
                f"set data.{data_key}={expected} (its default follows the model)"
            )


def _check_tower_sizes(cfg: DictConfig, tower_config: Any) -> None:
    # model.input may be overridden apart from the tower's own config.
    for data_key, tower_key in TOWER_SIZES.items():
        tower_value = getattr(tower_config, tower_key, None)
        if isinstance(tower_value, int) and cfg.data.get(data_key, tower_value) != tower_value:
            raise ConfigError(
                f"data.{data_key}={cfg.data[data_key]} disagrees with the tower of "
                f"model={_model_name(cfg)}: its config has {tower_key}={tower_value}; set "
                f"data.{data_key}={tower_value} and model.input.{PACKED_SIZES[data_key][0]}="
                f"{tower_value}"
            )


def _model_name(cfg: DictConfig) -> str:
    if HydraConfig.initialized():
        return HydraConfig.get().runtime.choices.get("model", "?")
    tower: Any = OmegaConf.select(cfg, "model.module.vision_tower", default={})
    return tower.get("name") or str(tower.get("_target_", "?")).rsplit(".", 1)[-1]
