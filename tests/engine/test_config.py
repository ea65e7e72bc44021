"""GraphConfig's budget choices: a path's entry replaces ``budgets``; errors name the option."""

import re

import pytest

from lightning_cg.engine.config import BudgetConfig, GraphConfig


@pytest.mark.parametrize(
    ("budgets", "entry"),
    [
        ({"min_budget": 8, "ladder": "geometric", "ratio": 1.5}, {"ladder": "pow2"}),
        ({"min_budget": 8, "ladder": "geometric", "ratio": 1.5}, {"max_budget": 64}),
        # merged, these two would contradict each other
        ({"min_budget": 64}, {"max_budget": 32}),
    ],
    ids=["pow2 entry under geometric budgets", "max-only entry", "entry below budgets' min"],
)
def test_a_path_entry_replaces_budgets_whole_as_a_mapping_or_a_budget_config(budgets, entry):
    as_mapping = GraphConfig.from_options(budgets=budgets, paths={"local": entry})
    as_object = GraphConfig.from_options(budgets=budgets, paths={"local": BudgetConfig(**entry)})
    assert as_mapping.paths["local"] == as_object.paths["local"] == BudgetConfig(**entry)
    assert as_mapping.budgets == BudgetConfig(**budgets)


def test_compile_only_options_are_accepted_with_compile():
    config = GraphConfig.from_options(budgets={"align": 32}, compile=True)
    assert config.budgets.align == 32


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"paths": {"image": {"max_budget": "x"}}}, "paths.image.max_budget must be"),
        ({"budgets": {"min_budget": 0}}, "budgets.min_budget must be"),
        ({"budgets": {"ratio": 1.5}}, "budgets.ratio=1.5 applies only to ladder"),
        ({"budgets": {"budgets": [8, 16, 8]}}, "budgets.budgets must list each budget once"),
    ],
)
def test_a_bad_budget_key_is_named_with_the_option_that_holds_it(options, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        GraphConfig.from_options(**options)
