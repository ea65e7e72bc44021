"""Token budgets: the sizes a vision tower's CUDA graphs are captured at.

A CUDA graph replays one static shape, so a sub-batch of items runs in the
smallest captured graph its tokens fit, and the rows past its real tokens are
padding. Padding costs real GPU time (a sub-batch just past a power of two
nearly doubles its work), so the ladder of budgets must be fine where the real
batches fall. ``pow2`` is the cheap-to-capture default; ``geometric`` with a
small ratio bounds the padding of any sub-batch to about ``ratio - 1`` of its
tokens at the cost of more graphs; ``auto``
(:func:`lightning_cg.core.learned_budgets.learn_budgets`) spends K graphs where a
sample of real batches falls, choosing the K budgets that pad the sample least.

This module is pure Python: it must not import torch.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence

#: Budget ladder shapes accepted by :func:`generate_budgets`.
LADDERS = ("pow2", "geometric")
#: The ladder learned from a sample of item sizes (:mod:`lightning_cg.core.learned_budgets`).
AUTO_LADDER = "auto"


def is_positive_int(value: object) -> bool:
    # bool is an int subclass; True is never a meant budget.
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def is_finite_number(value: object) -> bool:
    """An int or float (not a bool) that is neither infinite nor NaN."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_range(min_budget: int, max_budget: int) -> None:
    if not is_positive_int(max_budget):
        raise ValueError(f"max_budget must be a positive integer (got max_budget={max_budget!r})")
    if not is_positive_int(min_budget) or min_budget > max_budget:
        raise ValueError(
            "min_budget must be a positive integer <= max_budget "
            f"(got min_budget={min_budget!r}, max_budget={max_budget!r})"
        )


def _check_ladder(ladder: str, ratio: float, align: int) -> None:
    if ladder not in LADDERS:
        raise ValueError(f"ladder must be one of {', '.join(LADDERS)} (got ladder={ladder!r})")
    if not is_finite_number(ratio) or not ratio > 1:
        raise ValueError(f"ratio must be a finite number > 1 (got ratio={ratio!r})")
    if not is_positive_int(align):
        raise ValueError(f"align must be a positive integer (got align={align!r})")


def _pow2_ladder(min_budget: int, max_budget: int) -> list[int]:
    budgets = []
    budget = min_budget
    while budget <= max_budget:
        budgets.append(budget)
        budget *= 2
    return budgets


def _geometric_ladder(min_budget: int, max_budget: int, ratio: float, align: int) -> list[int]:
    budgets = []
    budget = min_budget
    while budget < max_budget:
        budgets.append(budget)
        if budget * ratio >= max_budget:
            break  # the next rung is max_budget, which the caller appends
        # round() drops float noise such as 100 * 1.1 = 110.00000000000001, which
        # ceil would turn into 111; the +1 keeps the ladder strictly increasing.
        grown = max(math.ceil(round(budget * ratio, 6)), budget + 1)
        budget = math.ceil(grown / align) * align
    return budgets


def generate_budgets(
    min_budget: int,
    max_budget: int,
    ladder: str = "pow2",
    ratio: float = 1.25,
    align: int = 16,
) -> list[int]:
    """A ladder of token budgets from ``min_budget`` to ``max_budget``.

    Args:
        min_budget: the smallest budget, always the first rung.
        max_budget: the largest budget, always the last rung.
        ladder: ``pow2`` doubles from ``min_budget``; ``geometric`` grows by
            ``ratio`` and rounds each rung up to a multiple of ``align``.
        ratio: growth factor of a ``geometric`` ladder, > 1.
        align: rungs of a ``geometric`` ladder between the first and the last
            are multiples of this, >= 1.

    Returns:
        Strictly increasing budgets, ``min_budget`` first and ``max_budget`` last.

    Raises:
        ValueError: an argument is out of range; the message names it.

    Example:
        >>> generate_budgets(64, 1000)
        [64, 128, 256, 512, 1000]
    """
    check_range(min_budget, max_budget)
    _check_ladder(ladder, ratio, align)
    if ladder == "pow2":
        budgets = _pow2_ladder(min_budget, max_budget)
    else:
        budgets = _geometric_ladder(min_budget, max_budget, ratio, align)
    if not budgets or budgets[-1] != max_budget:
        budgets.append(max_budget)
    return budgets


def smallest_fitting_budget(tokens: int, budgets: Sequence[int]) -> int | None:
    """The smallest budget that holds ``tokens``.

    Args:
        tokens: tokens to place; they fit a budget ``b`` when ``tokens <= b``.
        budgets: the ladder, sorted ascending.

    Returns:
        The budget, or ``None`` when ``tokens`` exceed the largest one.
    """
    index = bisect_left(budgets, tokens)
    return budgets[index] if index < len(budgets) else None


def _check_user_budgets(user_budgets: Sequence[int]) -> list[int]:
    if not user_budgets or not all(is_positive_int(budget) for budget in user_budgets):
        raise ValueError(
            f"budgets must be a non-empty list of positive integers (got budgets={user_budgets!r})"
        )
    return sorted(set(user_budgets))


def _check_user_max_items(user_max_items: int, limit: int, limit_name: str) -> None:
    if not is_positive_int(user_max_items) or user_max_items > limit:
        raise ValueError(
            f"max_items must be a positive integer <= {limit_name}, {limit} "
            f"(got max_items={user_max_items!r}): every item yields at least one output "
            "token, so a graph of budget B holds at most B items"
        )


def _resolve_user_budgets(
    min_budget: int, max_budget: int, user_budgets: Sequence[int], user_max_items: int | None
) -> tuple[list[int], int]:
    budgets = _check_user_budgets(user_budgets)
    if user_max_items is None:
        return budgets, min(max_budget // min_budget, budgets[0])
    _check_user_max_items(user_max_items, budgets[0], "the smallest budget")
    return budgets, user_max_items


def resolve_budgets(
    min_budget: int,
    max_budget: int,
    user_budgets: Sequence[int] | None,
    user_max_items: int | None,
    *,
    ladder: str = "pow2",
    ratio: float = 1.25,
    align: int = 16,
) -> tuple[list[int], int]:
    """The budgets to capture and the most items one graph holds.

    What the user set wins; what they left out is derived from the tower's
    ``(min_budget, max_budget)`` range. Every item is assumed to yield at least
    ``min_budget`` tokens, so the largest budget holds ``max_budget // min_budget``
    items; a graph of budget ``B`` never holds more than ``B`` items.

    Args:
        min_budget: the tower's smallest budget worth a graph.
        max_budget: the tower's largest budget.
        user_budgets: budgets the user asked for, or ``None``.
        user_max_items: items per graph the user asked for, or ``None``.
        ladder: ladder shape when budgets are generated, see :func:`generate_budgets`.
        ratio: growth factor of a ``geometric`` ladder.
        align: alignment of a ``geometric`` ladder.

    Returns:
        ``(budgets, max_items)``: budgets sorted ascending and unique.

    Raises:
        ValueError: a value is out of range; the message names the field.

    Example:
        >>> resolve_budgets(64, 1024, None, None)
        ([64, 128, 256, 512, 1024], 16)
    """
    check_range(min_budget, max_budget)
    _check_ladder(ladder, ratio, align)
    if user_budgets is not None:
        return _resolve_user_budgets(min_budget, max_budget, user_budgets, user_max_items)
    if user_max_items is None:
        return generate_budgets(min_budget, max_budget, ladder, ratio, align), (
            max_budget // min_budget
        )
    _check_user_max_items(user_max_items, max_budget, "max_budget")
    # The smallest graph must hold max_items items of at least one token each.
    budgets = generate_budgets(max(min_budget, user_max_items), max_budget, ladder, ratio, align)
    return budgets, user_max_items
