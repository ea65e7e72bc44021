"""Which graph, if any, runs a sub-batch: vLLM's cudagraph dispatcher for vision towers.

Keys are whole-tower (FULL) graphs: relaxed (tokens only) for ``full``, exact (budget,
item count, uniform) for ``full_uniform_only``, whose attention metadata is static only
for uniform batches. Lookup: exact key, then relaxed key, else eager (no key).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lightning_cg.core.budgets import smallest_fitting_budget


class GraphMode(enum.Enum):
    """How a tower's sub-batches are graphed: not at all, or by FULL graphs of every batch
    (``full``) or of uniform batches only (``full_uniform_only``)."""

    NONE = "none"
    FULL = "full"
    FULL_UNIFORM_ONLY = "full_uniform_only"

    @classmethod
    def parse(cls, value: str | GraphMode) -> GraphMode:
        """A mode from its lower-case name, e.g. ``"full_uniform_only"``; a mode as is."""
        if isinstance(value, GraphMode):
            return value
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(mode.value for mode in cls)
            raise ValueError(f"mode must be one of {allowed}; got mode={value!r}") from None


@dataclass(frozen=True)
class BatchDescriptor:
    """The shape of a sub-batch (tokens padded, in a key), and the key of its graph;
    ``num_items`` None is a relaxed key, for any item count."""

    num_tokens: int
    num_items: int | None = None
    uniform: bool = False


def _positive_ints(values: Iterable[int], name: str) -> list[int]:
    values = list(values)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        raise ValueError(f"{name} must be positive integers (got {name}={values!r})")
    return sorted(set(values))


class CudagraphDispatcher:
    """Picks the graph key of each sub-batch.

    Args:
        uniform_item_counts: item counts of ``full_uniform_only``'s exact uniform keys;
            none above a budget (each item has at least one token).
        mixed_item_counts: item counts of ``full``'s keys (for metadata with a slot per
            item, where empty slots cost time); a batch takes the smallest count that
            holds it, up to ``min(budget, max(counts))``. Empty: one key per budget.

    Example:
        >>> dispatcher = CudagraphDispatcher("full", [256, 1024])
        >>> dispatcher.dispatch(BatchDescriptor(300, 2))
        BatchDescriptor(num_tokens=1024, num_items=None, uniform=False)
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
        self.keys: set[BatchDescriptor] = set()
        if self.mode is GraphMode.FULL:
            # Mixed batches of a budget share one graph, or one per item count.
            self.keys = {
                BatchDescriptor(budget, count)
                for budget in self.budgets
                for count in (self._mixed_counts(budget) if self.mixed_item_counts else [None])
            }
        elif self.mode is GraphMode.FULL_UNIFORM_ONLY:
            # Uniform batches get graphs of their exact item count.
            self.keys = {
                BatchDescriptor(budget, count, True)
                for budget in self.budgets
                for count in self.uniform_item_counts
                if count <= budget
            }

    def dispatch(self, desc: BatchDescriptor) -> BatchDescriptor | None:
        """The key of the graph that serves a sub-batch's real descriptor; None when no
        graph serves it (it runs eagerly)."""
        if desc.num_tokens <= 0:
            return None
        budget = smallest_fitting_budget(desc.num_tokens, self.budgets)
        if budget is None:
            return None
        for key in (
            BatchDescriptor(budget, desc.num_items, desc.uniform),
            self._mixed_key(budget, desc.num_items),
        ):
            if key in self.keys:
                return key
        return None

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
        """The item counts of ``budget``'s mixed keys, smallest first."""
        cap = min(budget, self.mixed_item_counts[-1])
        return [count for count in self.mixed_item_counts if count < cap] + [cap]

    def _mixed_key(self, budget: int, items: int | None) -> BatchDescriptor:
        """The key a mixed batch of ``items`` items looks up at ``budget``."""
        if not self.mixed_item_counts or items is None:
            return BatchDescriptor(budget)
        for count in self._mixed_counts(budget):
            if items <= count:
                return BatchDescriptor(budget, count)
        return BatchDescriptor(budget)  # more items than any key holds: no key

    def capture_descriptors(self) -> list[BatchDescriptor]:
        """Every key to capture, largest (then most items) first, so that smaller graphs
        reuse the pool the largest allocated."""
        return sorted(
            self.keys, key=lambda desc: (desc.num_tokens, desc.num_items or 0), reverse=True
        )
