"""Which graph, if any, runs a sub-batch: vLLM's cudagraph dispatcher for vision towers.

FULL keys are whole-tower graphs: relaxed (tokens only) for ``full``, exact (budget, item
count, uniform) for the separate-routine modes, whose attention metadata is static only
for uniform batches. PIECEWISE keys are one per budget; attention runs eagerly between
pieces. Lookup: exact FULL key, relaxed FULL key, PIECEWISE key, else eager (NONE).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lightning_cg.core.budgets import smallest_fitting_budget


class GraphMode(enum.Enum):
    """A configured graph mode, or the runtime mode (NONE, PIECEWISE, FULL) of one dispatch."""

    NONE = "none"
    PIECEWISE = "piecewise"
    FULL = "full"
    FULL_UNIFORM_ONLY = "full_uniform_only"
    FULL_AND_PIECEWISE = "full_and_piecewise"

    def uniform_mode(self) -> GraphMode:
        """The runtime mode of batches whose items are all one size."""
        return _UNIFORM_MODE[self]

    def mixed_mode(self) -> GraphMode:
        """The runtime mode of batches whose items differ in size."""
        return _MIXED_MODE[self]

    def separate_routine(self) -> bool:
        """Whether uniform and mixed batches dispatch to different graphs."""
        return self in (GraphMode.FULL_UNIFORM_ONLY, GraphMode.FULL_AND_PIECEWISE)

    def has_mode(self, mode: GraphMode) -> bool:
        """Whether uniform or mixed batches run as the runtime ``mode``."""
        return mode in (self.uniform_mode(), self.mixed_mode())

    def requires_piecewise(self) -> bool:
        """Whether the tower must be split into pieces for this mode."""
        return self.has_mode(GraphMode.PIECEWISE)

    @classmethod
    def parse(cls, value: str | GraphMode) -> GraphMode:
        """A mode from its lower-case name, e.g. ``"full_and_piecewise"``; a mode as is."""
        if isinstance(value, GraphMode):
            return value
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(mode.value for mode in cls)
            raise ValueError(f"mode must be one of {allowed}; got mode={value!r}") from None


_UNIFORM_MODE = {
    GraphMode.NONE: GraphMode.NONE,
    GraphMode.PIECEWISE: GraphMode.PIECEWISE,
    GraphMode.FULL: GraphMode.FULL,
    GraphMode.FULL_UNIFORM_ONLY: GraphMode.FULL,
    GraphMode.FULL_AND_PIECEWISE: GraphMode.FULL,
}
_MIXED_MODE = {
    GraphMode.NONE: GraphMode.NONE,
    GraphMode.PIECEWISE: GraphMode.PIECEWISE,
    GraphMode.FULL: GraphMode.FULL,
    GraphMode.FULL_UNIFORM_ONLY: GraphMode.NONE,
    GraphMode.FULL_AND_PIECEWISE: GraphMode.PIECEWISE,
}


@dataclass(frozen=True)
class BatchDescriptor:
    """The shape of a sub-batch (tokens padded, in a key), and the key of its graph;
    ``num_items`` None is a relaxed key, for any item count."""

    num_tokens: int
    num_items: int | None = None
    uniform: bool = False

    def relaxed(self) -> BatchDescriptor:
        """This descriptor with only its tokens: the key any batch of that size fits."""
        return BatchDescriptor(self.num_tokens)


def _positive_ints(values: Iterable[int], name: str) -> list[int]:
    values = list(values)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        raise ValueError(f"{name} must be positive integers (got {name}={values!r})")
    return sorted(set(values))


class CudagraphDispatcher:
    """Picks the runtime mode and graph key of each sub-batch.

    Args:
        uniform_item_counts: item counts of the separate-routine modes' exact uniform
            FULL keys; none above a budget (each item has at least one token).
        mixed_item_counts: item counts of ``full``'s mixed FULL keys (for metadata with a
            slot per item, where empty slots cost time); a batch takes the smallest count
            that holds it, up to ``min(budget, max(counts))``. Empty: one per budget.

    Example:
        >>> dispatcher = CudagraphDispatcher("full", [256, 1024])
        >>> dispatcher.dispatch(BatchDescriptor(300, 2))
        (<GraphMode.FULL: 'full'>, BatchDescriptor(num_tokens=1024, num_items=None, uniform=False))
    """

    def __init__(
        self,
        mode: str | GraphMode,
        budgets: Sequence[int],
        uniform_item_counts: Sequence[int] = (),
        mixed_item_counts: Sequence[int] = (),
    ) -> None:
        self.mode = GraphMode.parse(mode)
        self.budgets = _positive_ints(budgets, "budgets")
        self.uniform_item_counts = _positive_ints(uniform_item_counts, "uniform_item_counts")
        self.mixed_item_counts = _positive_ints(mixed_item_counts, "mixed_item_counts")
        self.keys: dict[GraphMode, set[BatchDescriptor]] = {
            GraphMode.FULL: set(),
            GraphMode.PIECEWISE: set(),
        }
        mixed_mode = self.mode.mixed_mode()
        if mixed_mode is GraphMode.FULL and self.mixed_item_counts:
            self.keys[mixed_mode] |= {
                BatchDescriptor(budget, count)
                for budget in self.budgets
                for count in self._mixed_counts(budget)
            }
        elif mixed_mode in self.keys:
            # Mixed batches of a budget share one graph; NONE captures nothing.
            self.keys[mixed_mode] |= {BatchDescriptor(budget) for budget in self.budgets}
        # Uniform batches get graphs of their exact item count.
        if self.mode.separate_routine():
            self.keys[self.mode.uniform_mode()] |= {
                BatchDescriptor(budget, count, True)
                for budget in self.budgets
                for count in self.uniform_item_counts
                if count <= budget
            }

    def dispatch(
        self, desc: BatchDescriptor, disable_full: bool = False
    ) -> tuple[GraphMode, BatchDescriptor | None]:
        """``(runtime mode, key)`` for a sub-batch's real descriptor; ``(NONE, None)``
        when no graph serves it. ``disable_full`` skips FULL keys."""
        if desc.num_tokens <= 0:
            return GraphMode.NONE, None
        budget = smallest_fitting_budget(desc.num_tokens, self.budgets)
        if budget is None:
            return GraphMode.NONE, None
        padded = BatchDescriptor(budget, desc.num_items, desc.uniform)
        relaxed = padded.relaxed()
        if not disable_full:
            for key in (padded, self._mixed_key(budget, desc.num_items)):
                if key in self.keys[GraphMode.FULL]:
                    return GraphMode.FULL, key
        if relaxed in self.keys[GraphMode.PIECEWISE]:
            return GraphMode.PIECEWISE, relaxed
        return GraphMode.NONE, None

    def replace(self, **changes: object) -> CudagraphDispatcher:
        """A dispatcher with these constructor arguments changed, the others kept."""
        arguments = {
            "mode": self.mode,
            "budgets": self.budgets,
            "uniform_item_counts": self.uniform_item_counts,
            "mixed_item_counts": self.mixed_item_counts,
        }
        return CudagraphDispatcher(**{**arguments, **changes})

    def _mixed_counts(self, budget: int) -> list[int]:
        """The item counts of ``budget``'s mixed FULL keys, smallest first."""
        cap = min(budget, self.mixed_item_counts[-1])
        return [count for count in self.mixed_item_counts if count < cap] + [cap]

    def _mixed_key(self, budget: int, items: int | None) -> BatchDescriptor:
        """The FULL key a mixed batch of ``items`` items looks up at ``budget``."""
        if not self.mixed_item_counts or items is None:
            return BatchDescriptor(budget)
        for count in self._mixed_counts(budget):
            if items <= count:
                return BatchDescriptor(budget, count)
        return BatchDescriptor(budget)  # more items than any key holds: no FULL key

    def capture_descriptors(self) -> list[tuple[GraphMode, BatchDescriptor]]:
        """Every key to capture: PIECEWISE, then FULL, each largest (then most items) first,
        so that smaller graphs reuse the pool the largest allocated."""
        return [
            (mode, key)
            for mode in (GraphMode.PIECEWISE, GraphMode.FULL)
            for key in sorted(
                self.keys[mode],
                key=lambda desc: (desc.num_tokens, desc.num_items or 0),
                reverse=True,
            )
        ]
