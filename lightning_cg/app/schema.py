"""Hydra structured config schemas of the apps' configs (``conf/predict.yaml`` and friends).

``conf/predict.yaml``, ``validate.yaml``, ``test.yaml`` and ``train.yaml`` name ``app_schema``
first in their defaults list, so Hydra merges every YAML and command-line
override into these dataclasses: a wrong type (``cudagraph.budgets.max_budget=abc``,
``budgets=[64.9]``, ``stages=validate``) or an unknown key (``+cudagraph.verfy=true``)
fails at composition, naming the full key. Importing this module registers the
schema in Hydra's ConfigStore; :mod:`lightning_cg.app.runner` imports it.

The ``cudagraph`` node is built from :class:`~lightning_cg.engine.config.GraphConfig`
and :class:`~lightning_cg.engine.config.BudgetConfig`, the one place an option is
declared, plus the callback's own arguments: its keys, types and defaults
follow theirs. Flags are typed ``Any``, not ``bool``: OmegaConf would turn
``yes``, ``off``, ``0`` or ``2`` into a bool silently; left as given, the
callback accepts exactly ``true`` and ``false``. Choices (``mode``, ``packing``,
...) are strings the callback checks against its allowed values.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from lightning_cg.callback.checks import STAGES
from lightning_cg.engine.config import BudgetConfig, GraphConfig

#: The name the apps' YAML files list first in their defaults.
APP_SCHEMA = "app_schema"
#: GraphConfig fields the callback sets itself.
CALLBACK_SET = ("capture_errors",)


def _node_type(annotation: Any) -> Any:
    """The OmegaConf type of a config field's annotation."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is bool:
        return Any
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return str
    if annotation is BudgetConfig:
        return BudgetsSchema
    if origin in (Mapping, dict):
        return dict[str, Any]  # each path's entry overrides only the keys it names
    if origin in (tuple, Sequence, list):
        return list[args[0]]
    if type(None) in args:
        (inner,) = [arg for arg in args if arg is not type(None)]
        return _node_type(inner) | None
    return annotation


def _node_default(config_field: dataclasses.Field) -> dataclasses.Field:
    if config_field.default_factory is not dataclasses.MISSING:
        made = config_field.default_factory()
        if isinstance(made, BudgetConfig):
            return field(default_factory=BudgetsSchema)
        return field(default_factory=type(made))
    default = config_field.default
    if isinstance(default, enum.Enum):
        return field(default=default.value)
    if isinstance(default, tuple):
        # A tuple default (splitting_ops) is the callback's None.
        return field(default=None)
    return field(default=default)


def _schema_fields(config_class: type, skip: Sequence[str] = ()) -> list[tuple]:
    hints = typing.get_type_hints(config_class)
    fields = []
    for config_field in dataclasses.fields(config_class):
        if config_field.name in skip:
            continue
        node_type = _node_type(hints[config_field.name])
        if isinstance(config_field.default, tuple):
            node_type = node_type | None
        fields.append((config_field.name, node_type, _node_default(config_field)))
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
        *_schema_fields(GraphConfig, skip=CALLBACK_SET),
    ],
    "``cudagraph``: the keyword arguments of :class:`~lightning_cg.CUDAGraphCallback`.",
)


@dataclass
class AppSchema:
    """The top level of ``predict.yaml``, ``validate.yaml``, ``test.yaml`` and ``train.yaml``.

    ``model``, ``data`` and ``trainer`` are ``_target_`` nodes of their groups,
    checked by :func:`lightning_cg.app.runner.check_config` against each other.
    """

    model: Any = MISSING
    data: Any = MISSING
    trainer: Any = MISSING
    cudagraph: CUDAGraphSchema = field(default_factory=CUDAGraphSchema)
    seed: int = 0
    passes: int | None = 1
    compare_eager: Any = None


def _app_node() -> DictConfig:
    """The schema as a config whose ``cudagraph.paths`` takes new path names, so
    ``cudagraph.paths={global:{budgets:[64,256]}}`` sets it as written; each
    entry is still checked, its path name against the tower's paths and its keys
    against the budget choice's."""
    node = OmegaConf.structured(AppSchema)
    OmegaConf.set_struct(node.cudagraph.paths, False)
    return node


ConfigStore.instance().store(name=APP_SCHEMA, node=_app_node())
