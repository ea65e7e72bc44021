"""The auto ladder: learn a path's budgets from the item sizes of the first batches.

The first ``auto_sample_batches`` batches run eagerly; then each auto path gets the ``k``
budgets that pad them least, and, unless the user fixed it, the item cap drops to fit.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_cg.core.budgets import AUTO_LADDER
from lightning_cg.core.learned_budgets import choose_budgets, expected_padding
from lightning_cg.core.packing import pack_items
from lightning_cg.engine.config import BudgetConfig
from lightning_cg.engine.encoder import ItemSpec
from lightning_cg.engine.plan import PlanRef, next_pow2

log = logging.getLogger(__name__)


class AutoLadder:
    """Samples item sizes and learns the budgets of the ``auto`` paths.

    ``max_items`` is the item cap before learning, which the learned one may lower
    when ``learn_max_items``.
    """

    def __init__(
        self,
        choices: Mapping[str, BudgetConfig],
        plans: PlanRef,
        max_items: int,
        learn_max_items: bool,
    ) -> None:
        self.plans = plans
        self._choices = choices
        self._max_items_limit = max_items
        self._learn_max_items = learn_max_items
        #: The (min, max) budgets of each auto path.
        self._ranges = {
            path: (plans.plan.paths[path].budgets[0], plans.plan.paths[path].budgets[-1])
            for path, choice in choices.items()
            if choice.ladder == AUTO_LADDER
        }
        self._sample: list[list[Mapping[str, int]]] | None = [] if self._ranges else None
        #: Per auto path, the learned ladder, its expected padding and sample size.
        self.learned: dict[str, dict[str, Any]] = {}

    @property
    def sampling(self) -> bool:
        """Whether batches are still being sampled (they run eagerly)."""
        return self._sample is not None

    def add_batch(self, specs: Sequence[ItemSpec]) -> int | None:
        """Add a batch to the sample; None while sampling goes on (the batch runs
        eagerly), then the learned item cap."""
        self._sample.append([spec.path_tokens for spec in specs])
        wanted = max(self._choices[path].auto_sample_batches for path in self._ranges)
        if len(self._sample) < wanted:
            return None
        return self.learn(self._sample)

    def learn(self, batches: Sequence[Sequence[Mapping[str, int]]]) -> int:
        """Learn every auto path's ladder from ``batches`` (packed ``next_fit`` at the
        largest budgets); returns the item cap."""
        self._sample = None
        max_items = self._max_items_limit
        if not self._ranges:
            return max_items
        max_budgets = {path: plan.budgets[-1] for path, plan in self.plans.plan.paths.items()}
        sums: dict[str, list[int]] = {path: [] for path in self._ranges}
        most_items = 0
        for batch in batches:
            for sub_batch in pack_items(batch, self._max_items_limit, max_budgets):
                most_items = max(most_items, len(sub_batch))
                for path, path_sums in sums.items():
                    path_sums.append(sum(batch[i].get(path, 0) for i in sub_batch))
        if self._learn_max_items and most_items:
            max_items = min(self._max_items_limit, next_pow2(most_items))
            self.plans.plan = self.plans.plan.with_max_items(max_items)
            log.info("sub-batches hold at most %d item(s), as many as the sample needs", max_items)
        for path, (min_budget, max_budget) in self._ranges.items():
            choice = self._choices[path]
            budgets = choose_budgets(sums[path], choice.k, min_budget, max_budget, choice.align)
            self.plans.update(path, self.plans.plan.paths[path].with_budgets(budgets))
            padding = expected_padding(sums[path], budgets)
            self.learned[path] = {
                "budgets": budgets,
                "expected_padding": padding,
                "sampled_sub_batches": len(sums[path]),
                "max_items": max_items,
            }
            log.info(
                "auto budgets of path %r: %s, expected padding %.1f%% on %d sampled sub-batches",
                path,
                budgets,
                100 * padding,
                len(sums[path]),
            )
        return max_items

    def learned_ladders(self) -> dict[str, list[int]]:
        """The current ladder of each auto path."""
        return {path: list(self.plans.plan.paths[path].budgets) for path in self._ranges}
