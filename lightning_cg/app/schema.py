"""Hydra schemas of the apps' configs, listed first in their YAML so bad keys fail at composition.

``cudagraph`` follows :class:`~lightning_cg.engine.config.GraphConfig`; flags are typed ``Any``
so OmegaConf does not turn ``yes`` or ``0`` into a bool (the callback takes only ``true`` and
``false``). Importing this module registers the schema.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from lightning_cg.callback.checks import STAGES
from lightning_cg.engine.config import BudgetConfig, GraphConfig

#: The name the apps' YAML files list first in their defaults.
APP_SCHEMA = "app_schema"


def _node_type(annotation: Any) -> Any:
    """The OmegaConf type of a config field's annotation."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is bool:
        return Any
    if origin is typing.Literal:
        return str  # the config's own check names the allowed values
    if any(isinstance(arg, type) and issubclass(arg, enum.Enum) for arg in (annotation, *args)):
        return str
    if annotation is BudgetConfig:
        return BudgetsSchema
    if origin in (Mapping, dict):
        return dict[str, Any]  # each path's entry, a whole budget choice, checked by the config
    if origin in (tuple, Sequence, list):
        return list[args[0]]
    if type(None) in args:
        (inner,) = [arg for arg in args if arg is not type(None)]
        return _node_type(inner) | None
    return annotation


def _schema_fields(config_class: type) -> list[tuple]:
    """``(name, type, field)`` of each field of a config class, for ``make_dataclass``."""
    hints = typing.get_type_hints(config_class)
    fields = []
    for config_field in dataclasses.fields(config_class):
        node_type, default = _node_type(hints[config_field.name]), config_field.default
        if config_field.default_factory is not dataclasses.MISSING:
            made = type(config_field.default_factory())
            node = field(default_factory=BudgetsSchema if made is BudgetConfig else made)
        else:
            node = field(default=default.value if isinstance(default, enum.Enum) else default)
        fields.append((config_field.name, node_type, node))
    return fields


def _schema(name: str, fields: list[tuple], doc: str) -> type:
    schema = dataclasses.make_dataclass(name, fields)
    schema.__module__, schema.__doc__ = __name__, doc
    return schema


BudgetsSchema = _schema(
    "BudgetsSchema",
    _schema_fields(BudgetConfig),
    "``cudagraph.budgets``: the fields of :class:`~lightning_cg.engine.config.BudgetConfig`.",
)

#: The callback's own arguments, then every GraphConfig field it takes.
CUDAGraphSchema = _schema(
    "CUDAGraphSchema",
    [
        ("_target_", str, field(default="lightning_cg.CUDAGraphCallback")),
        ("_convert_", str, field(default="all")),
        # None: the callback finds the one vision tower of the LightningModule.
        ("module", str | None, field(default=None)),
        ("stages", list[str], field(default_factory=lambda: list(STAGES))),
        # A name, or a _target_ node that builds an adapter (_partial_: a factory).
        ("adapter", Any, field(default=None)),
        ("encoder_data_parallel", Any, field(default=False)),
        ("keep_graphs", Any, field(default=True)),
        *_schema_fields(GraphConfig),
    ],
    "``cudagraph``: the keyword arguments of :class:`~lightning_cg.CUDAGraphCallback`.",
)


@dataclass
class AppSchema:
    """The top level of ``predict.yaml``, ``validate.yaml``, ``test.yaml`` and ``train.yaml``."""

    model: Any = MISSING
    data: Any = MISSING
    trainer: Any = MISSING
    cudagraph: CUDAGraphSchema = field(default_factory=CUDAGraphSchema)
    seed: int = 0
    passes: int | None = 1
    compare_eager: Any = None


_APP_NODE = OmegaConf.structured(AppSchema)
# cudagraph.paths is open to new path names; each entry is still checked against the
# tower's paths and the budget choice's keys.
OmegaConf.set_struct(_APP_NODE.cudagraph.paths, False)
ConfigStore.instance().store(name=APP_SCHEMA, node=_APP_NODE)
