"""Learned (``auto``) budget ladders: the K budgets that pad a sample of real batches least."""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Callable, Sequence

from lightning_cg.core.budgets import check_range, is_positive_int, smallest_fitting_budget


def _batches(sample_tokens: Sequence[int] | Sequence[Sequence[int]]) -> list[Sequence[int]]:
    # One batch's item tokens, or a list of batches.
    if all(isinstance(tokens, int) for tokens in sample_tokens):
        return [sample_tokens] if sample_tokens else []
    return list(sample_tokens)


def sub_batch_sums(
    sample_tokens: Sequence[int] | Sequence[Sequence[int]], max_budget: int, max_items: int
) -> list[int]:
    """Tokens of each sub-batch ``next_fit`` packing forms from a sample, batch by batch.

    One path of :func:`lightning_cg.core.packing.pack_items`; it does not depend on the
    ladder below ``max_budget``. ``sample_tokens`` is one batch's item tokens or a list
    of batches, each packed on its own; items above ``max_budget`` run eagerly: left out.

    Example:
        >>> sub_batch_sums([[30, 10, 20], [50]], max_budget=32, max_items=4)  # 50: eager
        [30, 30]
    """
    if not is_positive_int(max_budget):
        raise ValueError(f"max_budget must be a positive integer (got max_budget={max_budget!r})")
    if not is_positive_int(max_items):
        raise ValueError(f"max_items must be a positive integer (got max_items={max_items!r})")
    sums = []
    for batch in _batches(sample_tokens):
        if any(not isinstance(tokens, int) or tokens < 0 for tokens in batch):
            raise ValueError(
                f"sample_tokens must hold non-negative integers, one per item (got {batch!r})"
            )
        total, count = 0, 0
        for tokens in sorted(tokens for tokens in batch if tokens <= max_budget):
            if count and count < max_items and total + tokens <= max_budget:
                total, count = total + tokens, count + 1
                continue
            sums.append(total)
            total, count = tokens, 1
        sums.append(total)
    return [total for total in sums if total > 0]


def expected_padding(sums: Sequence[int], budgets: Sequence[int]) -> float:
    """Padded tokens per real token (``padding_waste``) of sub-batches of ``sums`` tokens;
    sums above the largest budget run eagerly and count nothing.

    Example:
        >>> expected_padding([100, 300], [128, 512])
        0.6
    """
    ladder = sorted(budgets)
    served = [total for total in sums if 0 < total <= ladder[-1]]
    real = sum(served)
    padded = sum(smallest_fitting_budget(total, ladder) - total for total in served)
    return padded / real if real else 0.0


def _candidate(total: int, min_budget: int, max_budget: int, step: int) -> int:
    return min(max(math.ceil(total / step) * step, min_budget), max_budget)


def _least_padding_rungs(sums: Sequence[int], candidates: Sequence[int], count: int) -> list[int]:
    """The ``count`` candidates, the largest among them, that pad ``sums`` least.

    ``best[j]``: least padding of the sums up to candidate ``j`` with a rung at ``j``. The
    cost is a Monge matrix, so split points are monotone and divide and conquer finds
    each layer in ``O(m log m)``; ties go to the lower split point.
    """
    m = len(candidates)
    # Sums grouped by their smallest fitting candidate; prefix counts and totals.
    counts, totals = [0] * (m + 1), [0] * (m + 1)
    for total in sums:
        index = bisect_left(candidates, total)
        counts[index + 1] += 1
        totals[index + 1] += total
    for index in range(m):
        counts[index + 1] += counts[index]
        totals[index + 1] += totals[index]

    def cost(first: int, last: int) -> int:
        # Sums of groups first..last padded up to candidates[last].
        served = counts[last + 1] - counts[first]
        return served * candidates[last] - (totals[last + 1] - totals[first])

    best: list[float] = [cost(0, last) for last in range(m)]
    splits: list[list[int]] = []
    for rungs in range(2, count + 1):
        best, split = _next_layer(best, cost, rungs, m)
        splits.append(split)
    chosen, last = [candidates[m - 1]], m - 1
    for split in reversed(splits):
        last = split[last]
        chosen.append(candidates[last])
    return chosen[::-1]


def _next_layer(
    best: Sequence[float], cost: Callable[[int, int], int], rungs: int, m: int
) -> tuple[list[float], list[int]]:
    # layer[j]: least padding with `rungs` rungs, the last at j; split[j]: the one before.
    layer, split = [math.inf] * m, [-1] * m
    todo = [(rungs - 1, m - 1, rungs - 2, m - 2)]
    while todo:
        low, high, split_low, split_high = todo.pop()
        if low > high:
            continue
        mid = (low + high) // 2
        for previous in range(split_low, min(split_high, mid - 1) + 1):
            value = best[previous] + cost(previous + 1, mid)
            if value < layer[mid]:
                layer[mid], split[mid] = value, previous
        todo += [(low, mid - 1, split_low, split[mid]), (mid + 1, high, split[mid], split_high)]
    return layer, split


def _hedge_rung(budgets: Sequence[int], min_budget: int, step: int) -> int | None:
    """A rung in the widest gap (by ratio) of the ladder, or None when none fits."""
    gaps = [(budgets[0] / min_budget, min_budget, budgets[0], True)]
    gaps += [
        (high / low, low, high, False) for low, high in zip(budgets, budgets[1:], strict=False)
    ]
    for _, low, high, inclusive in sorted(gaps, key=lambda gap: -gap[0]):
        middle = math.sqrt(low * high)
        for rung in (math.ceil(middle / step) * step, math.floor(middle / step) * step):
            if (low < rung or (inclusive and low == rung)) and rung < high:
                return rung
    return None


def choose_budgets(
    sums: Sequence[int], k: int, min_budget: int, max_budget: int, align: int = 16
) -> list[int]:
    """At most ``k`` increasing budgets, ``max_budget`` last, that pad ``sums`` least.

    Exact over ladders whose rungs are ``min_budget``, ``max_budget`` or multiples of
    ``gcd(align, min_budget)``; that keeps the ``pow2`` and aligned ``geometric`` ladders
    in the search, so the result never pads the sample more than they do. Rungs the
    sample does not need split the widest gaps (by ratio), for sizes it missed.

    Example:
        >>> choose_budgets([100, 100, 300], k=3, min_budget=16, max_budget=1024)
        [112, 304, 1024]
    """
    check_range(min_budget, max_budget)
    if not is_positive_int(k):
        raise ValueError(f"k must be a positive integer, the number of budgets (got k={k!r})")
    if not is_positive_int(align):
        raise ValueError(f"align must be a positive integer (got align={align!r})")
    step = math.gcd(align, min_budget)
    served = sorted(total for total in sums if 0 < total <= max_budget)
    candidates = sorted(
        {min_budget, max_budget} | {_candidate(t, min_budget, max_budget, step) for t in served}
    )
    if len(candidates) <= k:
        budgets = candidates
    else:
        budgets = _least_padding_rungs(served, candidates, k)
    while len(budgets) < k:
        rung = _hedge_rung(budgets, min_budget, step)
        if rung is None:
            break
        insort(budgets, rung)
    return budgets


def learn_budgets(
    sample_tokens: Sequence[int] | Sequence[Sequence[int]],
    k: int,
    min_budget: int,
    max_budget: int,
    max_items: int,
    align: int = 16,
) -> list[int]:
    """:func:`choose_budgets` for the sub-batches (:func:`sub_batch_sums`) of a sample.

    Example:
        >>> learn_budgets([[100], [60, 40], [300]], 3, min_budget=16, max_budget=1024, max_items=4)
        [112, 304, 1024]
    """
    if not is_positive_int(k):
        raise ValueError(f"k must be a positive integer, the number of budgets (got k={k!r})")
    sums = sub_batch_sums(sample_tokens, max_budget, max_items)
    return choose_budgets(sums, k, min_budget, max_budget, align)
