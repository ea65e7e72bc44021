"""GraphConfig's budget choices: what a path's entry inherits from ``budgets``."""

import re

import pytest

from lightning_cg.engine.config import BudgetConfig, GraphConfig


def test_a_path_entry_inherits_only_what_applies_to_its_own_ladder():
    config = GraphConfig.from_options(
        budgets={"min_budget": 8, "ladder": "geometric", "ratio": 1.5},
        paths={"local": {"ladder": "pow2"}, "global": {"max_budget": 64}},
    )
    assert config.paths["local"] == BudgetConfig(min_budget=8, ladder="pow2")
    assert config.paths["global"] == BudgetConfig(
        min_budget=8, max_budget=64, ladder="geometric", ratio=1.5
    )


def test_an_explicit_ladder_of_a_path_stands_alone():
    config = GraphConfig.from_options(
        budgets={"min_budget": 8, "ladder": "geometric", "ratio": 1.5},
        paths={"local": {"budgets": [16, 32]}},
    )
    assert config.paths["local"] == BudgetConfig(budgets=[16, 32])
    assert config.budgets == BudgetConfig(min_budget=8, ladder="geometric", ratio=1.5)


def test_a_path_generating_its_ladder_drops_the_global_explicit_one():
    config = GraphConfig.from_options(
        budgets={"budgets": [8, 16]}, paths={"local": {"max_budget": 64}}
    )
    assert config.paths["local"] == BudgetConfig(max_budget=64)


def test_a_path_error_names_the_keys_it_took_from_budgets():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "paths.local.min_budget must be a positive integer <= max_budget; got min_budget=64, "
            "max_budget=32 (min_budget=64 from budgets)"
        ),
    ):
        GraphConfig.from_options(budgets={"min_budget": 64}, paths={"local": {"max_budget": 32}})


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
