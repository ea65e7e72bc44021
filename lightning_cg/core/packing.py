"""Packing variable-size items into sub-batches that fit the token budgets.

``next_fit`` (vLLM's greedy): items, smallest first, fill a sub-batch until the next
would break the item count or a path's largest budget. ``min_padding``: a dynamic
program over the same order that cuts where padding (then sub-batches) is least; it
never pads more than ``next_fit``. An item above a path's largest budget runs alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lightning_cg.core.budgets import smallest_fitting_budget

#: Packing strategies accepted by :func:`pack_items`.
PACKING_STRATEGIES = ("next_fit", "min_padding")


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


def _sorted_ladders(budgets: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
    ladders = {path: sorted(set(ladder)) for path, ladder in budgets.items()}
    # A 0 rung is allowed: it is how an optional path says "no tokens, no graph".
    for path, ladder in ladders.items():
        if not ladder or ladder[0] < 0 or ladder[-1] <= 0:
            raise ValueError(
                f"budgets[{path!r}] must be non-negative integers, the largest positive "
                f"(got {list(budgets[path])!r})"
            )
    return ladders


def _path_padding(tokens: int, ladder: Sequence[int]) -> int:
    # A path with no tokens is skipped: no graph runs on it.
    if not tokens:
        return 0
    budget = smallest_fitting_budget(tokens, ladder)
    assert budget is not None, "the caller runs sub-batches above the ladder eagerly"
    return budget - tokens


def _sub_batch_padding(sums: Mapping[str, int], ladders: Mapping[str, Sequence[int]]) -> int:
    # A sub-batch too large for a path's ladder runs eagerly on every path.
    if any(sums[path] > ladder[-1] for path, ladder in ladders.items()):
        return 0
    return sum(_path_padding(sums[path], ladder) for path, ladder in ladders.items())


def _token_sums(
    sub_batch: Sequence[int], item_tokens: Sequence[Mapping[str, int]], paths: Sequence[str]
) -> dict[str, int]:
    return {path: sum(item_tokens[i].get(path, 0) for i in sub_batch) for path in paths}


def padded_tokens(
    sub_batches: Sequence[Sequence[int]],
    item_tokens: Sequence[Mapping[str, int]],
    budgets: Mapping[str, Sequence[int]],
) -> int:
    """Padding tokens the graphs compute for a packing (:func:`pack_items`' sub-batches).

    A path a sub-batch has no tokens on, and a sub-batch above a path's largest
    budget (eager), count zero.
    """
    ladders = _sorted_ladders(budgets)
    _check_items(item_tokens, ladders)
    return sum(
        _sub_batch_padding(_token_sums(sub_batch, item_tokens, list(ladders)), ladders)
        for sub_batch in sub_batches
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


def _min_padding(
    order: Sequence[int],
    item_tokens: Sequence[Mapping[str, int]],
    max_items: int,
    max_budgets: Mapping[str, int],
    ladders: Mapping[str, Sequence[int]],
) -> list[list[int]]:
    # best[end]: least (padding, sub-batches) packing order[:end] into contiguous
    # runs; first[end]: where the last run starts. next_fit's sub-batches are such
    # runs under the same limits, so the optimum never pads more than next_fit.
    best: list[tuple[int, int]] = [(0, 0)]
    first: list[int] = [0]
    for end in range(1, len(order) + 1):
        options = []
        sums = dict.fromkeys(max_budgets, 0)
        for start in range(end - 1, max(end - max_items, 0) - 1, -1):
            for path in max_budgets:
                sums[path] += item_tokens[order[start]].get(path, 0)
            # Growing the run backwards only adds tokens: stop at the first overflow.
            if any(sums[path] > cap for path, cap in max_budgets.items()):
                break
            padding, count = best[start]
            options.append(((padding + _sub_batch_padding(sums, ladders), count + 1), start))
        # A lone item always fits (oversize ones are packed apart), so options is
        # never empty; ties go to the earliest start, i.e. the longest last run.
        cost, start = min(options)
        best.append(cost)
        first.append(start)
    runs = []
    end = len(order)
    while end:
        runs.append(list(order[first[end] : end]))
        end = first[end]
    return runs[::-1]


def _check_pack_args(
    max_items: int,
    max_budgets: Mapping[str, int],
    strategy: str,
    budgets: Mapping[str, Sequence[int]] | None,
) -> dict[str, list[int]] | None:
    if strategy not in PACKING_STRATEGIES:
        allowed = ", ".join(PACKING_STRATEGIES)
        raise ValueError(f"strategy must be one of {allowed} (got {strategy!r})")
    if not isinstance(max_items, int) or max_items < 1:
        raise ValueError(f"max_items must be a positive integer (got max_items={max_items!r})")
    if not max_budgets or any(not isinstance(c, int) or c < 1 for c in max_budgets.values()):
        raise ValueError(
            "max_budgets must map each path to a positive integer "
            f"(got max_budgets={dict(max_budgets)!r})"
        )
    if strategy != "min_padding":
        return None
    if budgets is None:
        raise ValueError("strategy='min_padding' needs budgets: the token ladder of each path")
    ladders = _sorted_ladders(budgets)
    if ladders.keys() != max_budgets.keys():
        raise ValueError(
            f"budgets must name the same paths as max_budgets "
            f"(got {sorted(ladders)} and {sorted(max_budgets)})"
        )
    for path, cap in max_budgets.items():
        if ladders[path][-1] != cap:
            raise ValueError(
                f"budgets[{path!r}] must end at max_budgets[{path!r}]={cap} (got {ladders[path]!r})"
            )
    return ladders


def pack_items(
    item_tokens: Sequence[Mapping[str, int]],
    max_items: int,
    max_budgets: Mapping[str, int],
    strategy: str = "next_fit",
    budgets: Mapping[str, Sequence[int]] | None = None,
) -> list[list[int]]:
    """Group items into sub-batches that fit the graphs.

    ``item_tokens``: tokens per path of each item (a path not named counts zero);
    ``budgets``: each path's ladder, required by ``min_padding``. Returns sub-batches of
    item indices, each once, smallest items first; oversize items come last, one each.

    Example:
        >>> pack_items([{"p": 30}, {"p": 10}, {"p": 20}], 2, {"p": 32})
        [[1, 2], [0]]
    """
    ladders = _check_pack_args(max_items, max_budgets, strategy, budgets)
    if ladders is None and item_tokens and all(t == item_tokens[0] for t in item_tokens):
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
    if ladders is None:
        sub_batches = _next_fit(fitting, item_tokens, max_items, max_budgets)
    else:
        sub_batches = _min_padding(fitting, item_tokens, max_items, max_budgets, ladders)
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
