"""Packing variable-size items into sub-batches that fit the token budgets.

Next fit, vLLM's greedy: items, smallest first, fill a sub-batch until the next would break
the item count or a path's largest budget. An item above a path's largest budget runs alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def _check_items(item_tokens: Sequence[Mapping[str, int]], paths: Mapping[str, object]) -> None:
    for index, tokens in enumerate(item_tokens):
        for path, count in tokens.items():
            if path not in paths:
                raise ValueError(
                    f"item_tokens[{index}] has tokens on path {path!r}; "
                    f"known paths: {', '.join(map(repr, paths))}"
                )
            if not isinstance(count, int) or count < 0:
                raise ValueError(
                    f"item_tokens[{index}][{path!r}] must be a non-negative integer (got {count!r})"
                )


def _next_fit(
    order: Sequence[int],
    item_tokens: Sequence[Mapping[str, int]],
    max_items: int,
    max_budgets: Mapping[str, int],
) -> list[list[int]]:
    sub_batches: list[list[int]] = []
    sums: dict[str, int] = {}
    for index in order:
        tokens = item_tokens[index]
        if (
            sub_batches
            and len(sub_batches[-1]) < max_items
            and all(sums[path] + tokens.get(path, 0) <= cap for path, cap in max_budgets.items())
        ):
            sub_batches[-1].append(index)
        else:
            sub_batches.append([index])
            sums = dict.fromkeys(max_budgets, 0)
        for path in max_budgets:
            sums[path] += tokens.get(path, 0)
    return sub_batches


def _check_pack_args(max_items: int, max_budgets: Mapping[str, int]) -> None:
    if not isinstance(max_items, int) or max_items < 1:
        raise ValueError(f"max_items must be a positive integer (got max_items={max_items!r})")
    if not max_budgets or any(not isinstance(c, int) or c < 1 for c in max_budgets.values()):
        raise ValueError(
            "max_budgets must map each path to a positive integer "
            f"(got max_budgets={dict(max_budgets)!r})"
        )


def pack_items(
    item_tokens: Sequence[Mapping[str, int]],
    max_items: int,
    max_budgets: Mapping[str, int],
) -> list[list[int]]:
    """Group items into sub-batches that fit the graphs.

    ``item_tokens``: tokens per path of each item (a path not named counts zero). Returns
    sub-batches of item indices, each once, smallest items first; oversize items come
    last, one each.

    Example:
        >>> pack_items([{"p": 30}, {"p": 10}, {"p": 20}], 2, {"p": 32})
        [[1, 2], [0]]
    """
    _check_pack_args(max_items, max_budgets)
    if item_tokens and all(t == item_tokens[0] for t in item_tokens):
        # Same-size items (every batch of a batch-first tower): next_fit cuts
        # their index order into equal runs, so skip the sort and the scan.
        _check_items(item_tokens[:1], max_budgets)
        return _equal_runs(len(item_tokens), item_tokens[0], max_items, max_budgets)
    _check_items(item_tokens, max_budgets)
    # Stable sort: ties keep index order, so packing is deterministic.
    order = sorted(range(len(item_tokens)), key=lambda i: sum(item_tokens[i].values()))
    oversize = {
        i
        for i in order
        if any(item_tokens[i].get(path, 0) > cap for path, cap in max_budgets.items())
    }
    fitting = [i for i in order if i not in oversize]
    sub_batches = _next_fit(fitting, item_tokens, max_items, max_budgets)
    return sub_batches + [[i] for i in order if i in oversize]


def _equal_runs(
    count: int, tokens: Mapping[str, int], max_items: int, max_budgets: Mapping[str, int]
) -> list[list[int]]:
    """What :func:`_next_fit` gives ``count`` items of ``tokens`` each, in index order."""
    if any(tokens.get(path, 0) > cap for path, cap in max_budgets.items()):
        return [[i] for i in range(count)]  # oversize: one per sub-batch
    run = min(
        [max_items]
        + [cap // tokens[path] for path, cap in max_budgets.items() if tokens.get(path, 0)]
    )
    return [list(range(start, min(start + run, count))) for start in range(0, count, run)]
