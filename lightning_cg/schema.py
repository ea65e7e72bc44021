"""Hydra structured config schemas of the apps' configs (``conf/predict.yaml`` and friends).

``conf/predict.yaml``, ``validate.yaml``, ``test.yaml`` and ``train.yaml`` name ``app_schema``
first in their defaults list, so Hydra merges every YAML and command-line
override into these dataclasses: a wrong type (``cudagraph.budgets.max_budget=abc``,
``budgets=[64.9]``, ``stages=validate``) or an unknown key (``+cudagraph.verfy=true``)
fails at composition, naming the full key. Importing this module registers the
schema in Hydra's ConfigStore; :mod:`lightning_cg.app` imports it.

Flags are typed ``Any``, not ``bool``: OmegaConf would turn ``yes``, ``off``,
``0`` or ``2`` into a bool silently; left as given, the callback
(:class:`~lightning_cg.CUDAGraphCallback`) and :func:`lightning_cg.app.check_config`
accept exactly ``true`` and ``false``. Choices (``mode``, ``packing``, ...) are
strings the callback checks against its allowed values. The budget fields'
defaults are :class:`~lightning_cg.config.BudgetConfig`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from lightning_cg.config import BudgetConfig

#: The name the apps' YAML files list first in their defaults.
APP_SCHEMA = "app_schema"


@dataclass
class BudgetsSchema:
    """``cudagraph.budgets``: the fields of :class:`~lightning_cg.config.BudgetConfig`."""

    min_budget: int | None = None
    max_budget: int | None = None
    budgets: list[int] | None = None
    ladder: str = BudgetConfig.ladder
    ratio: float = BudgetConfig.ratio
    align: int = BudgetConfig.align
    k: int = BudgetConfig.k
    auto_sample_batches: int = BudgetConfig.auto_sample_batches
    compiled_ratio: float | None = BudgetConfig.compiled_ratio


@dataclass
class CUDAGraphSchema:
    """``cudagraph``: the keyword arguments of :class:`~lightning_cg.CUDAGraphCallback`."""

    _target_: str = "lightning_cg.CUDAGraphCallback"
    _convert_: str = "all"
    module: str = "vision_tower"
    mode: str = "full"
    budgets: BudgetsSchema = field(default_factory=BudgetsSchema)
    # Each entry overrides only the keys of `budgets` it names, so entries stay untyped
    # here (schema defaults would name every key); the callback checks them.
    paths: dict[str, Any] = field(default_factory=dict)
    max_items_per_batch: int | None = None
    max_frames_per_batch: int | None = None
    stages: list[str] = field(default_factory=lambda: ["validate", "test", "predict"])
    capture_during_sanity_check: Any = False
    keep_graphs: Any = True
    verify: Any = False
    adapter: str | None = None
    packing: str = "next_fit"
    splitting_ops: list[str] | None = None
    piecewise_fallback: str = "error"
    encoder_data_parallel: Any = False
    dispatch: str = "budget"
    compile: Any = "auto"
    compile_scope: str = "auto"
    repay_runs: int = 2
    capture: str = "paid_back"
    min_sightings: int = 2
    drop_slower_graphs: Any = True
    cast_weights_per_run: Any = True


@dataclass
class AppSchema:
    """The top level of ``predict.yaml``, ``validate.yaml``, ``test.yaml`` and ``train.yaml``.

    ``model``, ``data`` and ``trainer`` are ``_target_`` nodes of their groups,
    checked by :func:`lightning_cg.app.check_config` against each other.
    """

    model: Any = MISSING
    data: Any = MISSING
    trainer: Any = MISSING
    cudagraph: CUDAGraphSchema = field(default_factory=CUDAGraphSchema)
    seed: int = 0
    passes: int | None = 1
    compare_eager: Any = None


ConfigStore.instance().store(name=APP_SCHEMA, node=AppSchema)
