"""Every option is declared once, in GraphConfig: the callback, the Hydra schema and
the YAML follow from it; the callback takes each by name, or all as one ``config``."""

import dataclasses
import inspect

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf
from test_app import CONF, compose_config
from torch import nn

from lightning_cg.adapters import adapter_for
from lightning_cg.adapters.batched import BatchedEncoderAdapter
from lightning_cg.app.schema import BudgetsSchema, CUDAGraphSchema
from lightning_cg.callback.graph_callback import CUDAGraphCallback
from lightning_cg.engine.config import BudgetConfig, GraphConfig

#: The callback's arguments that are not GraphConfig fields.
CALLBACK_OWN = ("module", "stages", "adapter", "encoder_data_parallel", "keep_graphs")


def schema_defaults(schema: type) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(schema))


def config_defaults(config: object) -> dict:
    values = {}
    for config_field in dataclasses.fields(config):
        value = getattr(config, config_field.name)
        if dataclasses.is_dataclass(value):
            value = config_defaults(value)
        elif isinstance(value, tuple):
            value = list(value)
        values[config_field.name] = getattr(value, "value", value)
    return values


def test_the_callback_names_its_own_arguments_and_every_graph_option():
    # A named argument is what LightningCLI can set (--trainer.callbacks.<name>).
    parameters = inspect.signature(CUDAGraphCallback).parameters
    named = [name for name, p in parameters.items() if p.kind is not p.VAR_KEYWORD]
    graph_fields = [f.name for f in dataclasses.fields(GraphConfig)]
    assert sorted(named) == sorted([*CALLBACK_OWN, *graph_fields, "config"])


def test_the_schema_is_the_callbacks_own_arguments_and_every_graph_option():
    graph_fields = [f.name for f in dataclasses.fields(GraphConfig)]
    schema_fields = [f.name for f in dataclasses.fields(CUDAGraphSchema)]
    assert schema_fields == ["_target_", "_convert_", *CALLBACK_OWN, *graph_fields]
    assert [f.name for f in dataclasses.fields(BudgetsSchema)] == [
        f.name for f in dataclasses.fields(BudgetConfig)
    ]


def test_the_schema_defaults_are_the_configs():
    defaults = schema_defaults(CUDAGraphSchema)
    expected = config_defaults(GraphConfig())
    assert {name: defaults[name] for name in expected} == expected
    callback = inspect.signature(CUDAGraphCallback).parameters
    for name in ("module", "keep_graphs", "encoder_data_parallel", "adapter"):
        assert defaults[name] == callback[name].default, name
    assert defaults["stages"] == list(callback["stages"].default)


def test_the_yaml_sets_only_declared_options_at_their_defaults():
    node = OmegaConf.load(CONF / "cudagraph" / "full.yaml")
    defaults = schema_defaults(CUDAGraphSchema)
    keys = [key for key in node if key != "defaults"]
    assert set(keys) <= set(defaults)
    assert {key: OmegaConf.to_container(node)[key] for key in keys} == {
        key: defaults[key] for key in keys
    }
    budgets = OmegaConf.to_container(OmegaConf.load(CONF / "cudagraph" / "budgets" / "pow2.yaml"))
    assert budgets == {key: schema_defaults(BudgetsSchema)[key] for key in budgets}


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(GraphConfig)])
def test_the_callback_takes_every_graph_option_by_keyword(name):
    value = getattr(GraphConfig(), name)
    callback = CUDAGraphCallback(**{name: value})
    assert callback.config == GraphConfig()


def test_a_config_carries_every_graph_option_and_excludes_the_keywords():
    config = GraphConfig(
        mode="none", cast_weights_per_run=False, budgets=BudgetConfig(max_budget=64)
    )
    callback = CUDAGraphCallback(config=config)
    assert callback.config is config
    with pytest.raises(ValueError, match=r"config holds every graph option; pass \['capture'\]"):
        CUDAGraphCallback(config=config, capture="upfront")
    with pytest.raises(ValueError, match="config must be a GraphConfig"):
        CUDAGraphCallback(config={"mode": "none"})


def test_an_unknown_option_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"unknown graph option\(s\) \['verfy'\]; allowed: mode"):
        CUDAGraphCallback(verfy=True)


class Doubler(nn.Module):
    def forward(self, x):
        return 2 * x


def test_adapter_takes_a_name_an_adapter_or_a_factory():
    tower = Doubler()
    assert isinstance(adapter_for(tower, "batched"), BatchedEncoderAdapter)
    built = adapter_for(tower, BatchedEncoderAdapter)
    assert isinstance(built, BatchedEncoderAdapter) and built.tower is tower
    assert adapter_for(tower, built) is built
    with pytest.raises(TypeError, match="built a int, which does not implement GraphableEncoder"):
        adapter_for(tower, lambda tower: 3)
    for adapter in (BatchedEncoderAdapter, built, lambda tower: BatchedEncoderAdapter(tower)):
        assert CUDAGraphCallback(adapter=adapter).adapter is adapter
    with pytest.raises(ValueError, match="adapter must be one of packed, batched, hf, a Graph"):
        CUDAGraphCallback(adapter=42)
    with pytest.raises(ValueError, match="adapter must be one of"):
        CUDAGraphCallback(adapter=Doubler())  # a module, not an adapter


def test_a_path_entry_replaces_budgets_whole_in_every_form():
    """The Python mapping, a BudgetConfig and the Hydra override give one budget choice:
    the entry's keys, BudgetConfig's defaults for the rest (none taken from budgets)."""
    budgets = {"min_budget": 8, "ladder": "geometric", "ratio": 1.5}
    hydra = compose_config(
        "predict",
        [
            "cudagraph/budgets=geometric",
            "cudagraph.budgets.min_budget=8",
            "cudagraph.budgets.ratio=1.5",
            "+cudagraph.paths.local.max_budget=64",
        ],
    )
    forms = {
        "mapping": CUDAGraphCallback(budgets=budgets, paths={"local": {"max_budget": 64}}),
        "BudgetConfig": CUDAGraphCallback(
            budgets=budgets, paths={"local": BudgetConfig(max_budget=64)}
        ),
        "hydra": instantiate(hydra.cudagraph),
    }
    chosen = {form: callback.config.paths["local"] for form, callback in forms.items()}
    assert chosen == dict.fromkeys(forms, BudgetConfig(max_budget=64))
    assert {form: callback.config.budgets for form, callback in forms.items()} == dict.fromkeys(
        forms, BudgetConfig(**budgets)
    )
