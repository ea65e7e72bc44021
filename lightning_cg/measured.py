"""Measured dispatch: run a sub-batch in a graph only where the graph is faster.

A graph of budget ``B`` costs about the same whatever the real tokens ``T <= B``
of a sub-batch: padding is computed too. Eager costs grow with ``T``. So for
small towers a graph wins almost everywhere (the CPU cannot launch kernels fast
enough), while for GPU-bound batches a graph padded well past ``T`` can lose to
eager (DESIGN.md: 2.5x slower at 9440 of 16384 tokens).

:class:`DecisionTable` holds, for one encoder path, the measured cost of
replaying each budget's graph (copies in and the clone out included) and of
the eager forward at a few token counts, and chooses per sub-batch the cheapest
of: the graph of the smallest fitting budget, eager, or a split of the items
into groups that fit smaller budgets. The table logic is pure Python;
:func:`measure_decision_table` fills a table on a CUDA device.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from lightning_cg.budgets import smallest_fitting_budget

#: Dispatch policies of the manager: ``budget`` replays the smallest fitting
#: budget's graph whenever one exists; ``measured`` consults a DecisionTable.
DISPATCHES = ("budget", "measured")
#: Runners a :class:`Decision` names.
RUNNERS = ("graph", "eager", "split")
#: Decisions a table remembers, by the item tokens of a sub-batch.
_CACHE_SIZE = 4096


def check_dispatch(dispatch: str) -> str:
    """``dispatch`` if it names a policy of :data:`DISPATCHES`.

    Raises:
        ValueError: it does not; the message lists the allowed names.
    """
    if dispatch not in DISPATCHES:
        raise ValueError(f"dispatch must be one of {', '.join(DISPATCHES)}; got {dispatch!r}")
    return dispatch


@dataclass(frozen=True)
class Decision:
    """How one path of one sub-batch runs, and what the table expects it to cost.

    Attributes:
        runner: ``graph`` (replay ``budget``'s graph), ``eager``, or ``split``
            (run each of ``parts`` as a sub-batch of its own).
        cost_ms: the table's estimate.
        budget: the graph's budget; None unless ``runner`` is ``graph``.
        parts: groups of item positions in the sub-batch; empty unless ``split``.
    """

    runner: str
    cost_ms: float
    budget: int | None = None
    parts: tuple[tuple[int, ...], ...] = field(default=())


class DecisionTable:
    """Graph or eager, by measured cost, for the sub-batches of one encoder path.

    Args:
        graph_ms: milliseconds of one replay of each budget's graph, copies
            into its buffers and the clone of its output included.
        eager_ms: ``(tokens, milliseconds)`` of the eager forward at a few token
            counts. Costs in between are interpolated linearly, below the first
            held at the first, above the last extrapolated along the last
            segment; more tokens never cost less (a running maximum evens out noise).

    Example:
        >>> table = DecisionTable({256: 1.0, 1024: 4.0}, [(256, 3.0), (1024, 3.5)])
        >>> table.choose([100]).runner, table.choose([900]).runner
        ('graph', 'eager')
    """

    def __init__(
        self, graph_ms: Mapping[int, float], eager_ms: Iterable[tuple[int, float]]
    ) -> None:
        eager_points = sorted(eager_ms)
        if not graph_ms or not all(
            isinstance(b, int) and b > 0 and _is_cost(ms) for b, ms in graph_ms.items()
        ):
            raise ValueError(
                "graph_ms must map positive integer budgets to non-negative milliseconds "
                f"(got graph_ms={dict(graph_ms)!r})"
            )
        if not eager_points or not all(
            isinstance(t, int) and t > 0 and _is_cost(ms) for t, ms in eager_points
        ):
            raise ValueError(
                "eager_ms must be (positive tokens, non-negative milliseconds) pairs "
                f"(got eager_ms={eager_points!r})"
            )
        self.graph_ms = dict(sorted(graph_ms.items()))
        self.budgets = list(self.graph_ms)
        self.eager_points: list[tuple[int, float]] = []
        for tokens, ms in eager_points:
            highest = self.eager_points[-1][1] if self.eager_points else 0.0
            if self.eager_points and self.eager_points[-1][0] == tokens:
                self.eager_points[-1] = (tokens, max(ms, highest))
            else:
                self.eager_points.append((tokens, max(ms, highest)))
        self._decisions: dict[tuple[int, ...], Decision] = {}

    def eager_cost(self, tokens: int) -> float:
        """Estimated milliseconds of the eager forward on ``tokens`` tokens."""
        points = self.eager_points
        index = bisect_left(points, (tokens, -math.inf))
        if index < len(points) and points[index][0] == tokens:
            return points[index][1]
        if index == 0:
            return points[0][1]
        if index == len(points):
            if len(points) == 1:
                return points[0][1] * tokens / points[0][0]
            index -= 1
        (low_tokens, low_ms), (high_tokens, high_ms) = points[index - 1], points[index]
        slope = (high_ms - low_ms) / (high_tokens - low_tokens)
        return low_ms + slope * (tokens - low_tokens)

    def choose(self, item_tokens: Sequence[int]) -> Decision:
        """The cheapest way to run a sub-batch of items with these token counts.

        Options, in order of preference on equal cost: eager; the graph of the
        smallest budget that fits the sum; a split into groups that each fit a
        smaller budget (items smallest first, as packing fills sub-batches),
        each group costed at its own best of graph and eager.
        """
        key = tuple(item_tokens)
        decision = self._decisions.get(key)
        if decision is None:
            decision = self._choose(key)
            if len(self._decisions) >= _CACHE_SIZE:
                self._decisions.clear()
            self._decisions[key] = decision
        return decision

    def _choose(self, item_tokens: tuple[int, ...]) -> Decision:
        total = sum(item_tokens)
        options = [Decision("eager", self.eager_cost(total))]
        budget = smallest_fitting_budget(total, self.budgets)
        if budget is not None:
            options.append(Decision("graph", self.graph_ms[budget], budget=budget))
            options += self._splits(item_tokens, budget)
        return min(options, key=lambda option: option.cost_ms)

    def _splits(self, item_tokens: tuple[int, ...], budget: int) -> list[Decision]:
        order = sorted(range(len(item_tokens)), key=lambda i: item_tokens[i])
        largest = item_tokens[order[-1]]
        splits = []
        for cap in self.budgets[: self.budgets.index(budget)]:
            if cap < largest:
                continue
            parts: list[list[int]] = []
            room = 0
            for index in order:
                if parts and item_tokens[index] <= room:
                    parts[-1].append(index)
                    room -= item_tokens[index]
                else:
                    parts.append([index])
                    room = cap - item_tokens[index]
            cost = sum(self._best_single(sum(item_tokens[i] for i in part)) for part in parts)
            # Each part in sub-batch order: consecutive items are selected as a view.
            in_order = tuple(tuple(sorted(part)) for part in parts)
            splits.append(Decision("split", cost, parts=in_order))
        return splits

    def _best_single(self, tokens: int) -> float:
        budget = smallest_fitting_budget(tokens, self.budgets)
        eager = self.eager_cost(tokens)
        return eager if budget is None else min(eager, self.graph_ms[budget])

    def graph_wins_from(self, budget: int) -> int | None:
        """The fewest tokens for which ``budget``'s graph beats eager, or None.

        Only token counts that ``budget`` is the smallest fitting budget of
        count; eager costs never fall with more tokens, so the graph wins from
        there up to ``budget``.
        """
        position = self.budgets.index(budget)
        low = self.budgets[position - 1] + 1 if position else 1
        graph = self.graph_ms[budget]
        if self.eager_cost(budget) <= graph:
            return None
        high = budget
        while low < high:
            middle = (low + high) // 2
            if self.eager_cost(middle) > graph:
                high = middle
            else:
                low = middle + 1
        return low

    def rows(self) -> list[dict[str, float | int | None]]:
        """One row per budget: graph and eager milliseconds, and where the graph wins."""
        return [
            {
                "budget": budget,
                "graph_ms": graph,
                "eager_ms": self.eager_cost(budget),
                "graph_wins_from": self.graph_wins_from(budget),
            }
            for budget, graph in self.graph_ms.items()
        ]


def _is_cost(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0


# ------------------------------------------------------------------- timing


def time_ms(run: Callable[[], object], repeats: int = 10, warmup: int = 3) -> float:
    """Mean milliseconds of ``run()`` on the current CUDA stream, timed by CUDA events.

    Runs back to back, so what is timed is what limits a stream of them: the
    GPU, or the CPU launching its kernels.
    """
    for _ in range(warmup):
        run()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def fill_budget(
    item_tokens: Sequence[int],
    item_frames: Sequence[int],
    budget: int,
    max_items: int,
    max_frames: int,
) -> list[int]:
    """Positions of real items, taken in turn and repeated, that fill ``budget``.

    A budget's graph and eager are timed on such a stand-in sub-batch so that
    attention sees the data's own sequence lengths, not one sequence over the
    whole budget. Passes over the items smallest first (as packing orders
    them, whatever order the sub-batch holds them in), taking each that still
    fits (tokens, items and frames), until a pass takes none.

    Example:
        >>> fill_budget([3, 5], [1, 1], budget=12, max_items=8, max_frames=8)
        [0, 1, 0]
    """
    positions: list[int] = []
    room, frames = budget, 0
    taken = True
    smallest_first = sorted(range(len(item_tokens)), key=item_tokens.__getitem__)
    while taken and len(positions) < max_items:
        taken = False
        for position in smallest_first:
            tokens, item_frame_count = item_tokens[position], item_frames[position]
            fits = 0 < tokens <= room and frames + item_frame_count <= max_frames
            if fits and len(positions) < max_items:
                positions.append(position)
                room -= tokens
                frames += item_frame_count
                taken = True
    return positions


@dataclass(frozen=True)
class TimingSample:
    """One budget's graph and eager, each run on the same stand-in sub-batch.

    Attributes:
        budget: the graph's token budget.
        tokens: real tokens of the sub-batch; None where no real item fits the
            budget, and only the graph (on its capture buffers) is timed.
        replay: runs the graph as the manager does: copies in, replay, clone out.
        eager: runs the path eagerly on the sub-batch; None with ``tokens``.
    """

    budget: int
    tokens: int | None
    replay: Callable[[], object]
    eager: Callable[[], object] | None = None


def measure_decision_table(samples: Iterable[TimingSample], repeats: int = 10) -> DecisionTable:
    """Time each sample's graph and eager forward into one path's decision table.

    Where a budget has several graphs (exact keys), the slowest counts. Eager
    is timed at each sample's real token count.

    Raises:
        ValueError: no sample has real tokens, so eager was never timed.
    """
    graph_ms: dict[int, float] = {}
    eager_ms: dict[int, float] = {}
    for sample in samples:
        graph_ms[sample.budget] = max(
            graph_ms.get(sample.budget, 0.0), time_ms(sample.replay, repeats)
        )
        if sample.eager is not None and sample.tokens not in eager_ms:
            eager_ms[sample.tokens] = time_ms(sample.eager, repeats)
    return DecisionTable(graph_ms, list(eager_ms.items()))
