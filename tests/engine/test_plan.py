"""Path plans: the ladder compiled graphs use (``compiled_ratio``)."""

import pytest

from lightning_cg.engine.config import BudgetConfig
from lightning_cg.engine.plan import compiled_choice


@pytest.mark.parametrize(
    "choice",
    [
        BudgetConfig(ladder="pow2", min_budget=64, max_budget=4096),
        BudgetConfig(ladder="geometric", ratio=1.25, align=32),
    ],
)
def test_a_coarser_generated_ladder_becomes_geometric_at_compiled_ratio(choice):
    refined = compiled_choice(choice)
    assert (refined.ladder, refined.ratio) == ("geometric", 1.05)
    # Everything else is the user's choice, kept.
    kept = ("min_budget", "max_budget", "align", "compiled_ratio")
    assert [getattr(refined, name) for name in kept] == [getattr(choice, name) for name in kept]


@pytest.mark.parametrize(
    "choice",
    [
        BudgetConfig(ladder="geometric", ratio=1.03),  # already finer
        BudgetConfig(ladder="geometric", ratio=1.05),
        BudgetConfig(budgets=[64, 256, 1024]),  # the user's explicit ladder
        BudgetConfig(ladder="auto"),  # learned from the data
        BudgetConfig(ladder="pow2", compiled_ratio=None),  # asked to keep it
    ],
)
def test_finer_explicit_auto_and_opted_out_ladders_are_kept(choice):
    assert compiled_choice(choice) is choice


@pytest.mark.parametrize("bad", [1, 1.0, 0.5, "1.05", True, float("inf")])
def test_compiled_ratio_must_be_a_number_above_one(bad):
    with pytest.raises(
        ValueError,
        match=rf"compiled_ratio must be a finite number > 1 or None; got compiled_ratio={bad!r}",
    ):
        BudgetConfig(compiled_ratio=bad)
