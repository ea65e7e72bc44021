"""The path plan: each encoder path's budgets, dispatcher and graph sizes.

A :class:`PathPlan` is what the manager knows of one path between calls: the
token budgets it graphs, the dispatcher that maps a sub-batch to a key, how
many attention sequences (frames) its graphs hold, and, after a capture
fault, why it runs eagerly. Plans change in three places only, each a method
here: a budget that ran out of memory is dropped (:meth:`PathPlan.keep_budgets_below`),
an auto ladder is learned (:meth:`PathPlan.set_budgets`), and the item cap is
lowered (:func:`cap_items`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from lightning_cg.core.budgets import AUTO_LADDER, resolve_budgets
from lightning_cg.core.dispatcher import BatchDescriptor, CudagraphDispatcher, GraphMode
from lightning_cg.engine.budget_memory import check_budgets_fit
from lightning_cg.engine.config import BudgetConfig, GraphConfig
from lightning_cg.engine.encoder import CaptureSpec, EncoderGraphConfig, GraphableEncoder


@dataclass
class PathPlan:
    """Resolved budgets and dispatcher of one encoder path.

    Attributes:
        budgets: the token budgets graphed, ascending.
        dispatcher: maps a sub-batch's descriptor to a key.
        allow_zero_tokens: items may have no tokens on this path.
        item_frames: most frames of one item.
        max_frames: attention sequences the path's FULL graphs hold at most.
        eager_reason: why the path runs eagerly whatever the mode (a capture
            fault), else None.
    """

    budgets: list[int]
    dispatcher: CudagraphDispatcher
    allow_zero_tokens: bool
    item_frames: int
    max_frames: int
    eager_reason: str | None = None
    _graph_frames: dict[tuple, int] = field(default_factory=dict, repr=False, compare=False)

    @property
    def ladder(self) -> list[int]:
        """The budgets packing may fill; zero is one of its own for optional paths."""
        return ([0] if self.allow_zero_tokens else []) + self.budgets

    def set_budgets(self, budgets: list[int]) -> None:
        """Graph ``budgets`` from now on (a learned or reduced ladder)."""
        self.budgets = budgets
        self.dispatcher = self.dispatcher.replace(budgets=budgets)

    def keep_budgets_below(self, failed_budget: int) -> None:
        """Keep the budgets below ``failed_budget``; with none left, run eagerly."""
        kept = [budget for budget in self.budgets if budget < failed_budget]
        if kept:
            self.set_budgets(kept)
        else:
            self.eager_reason = f"out of memory at its smallest token budget {failed_budget}"

    def capture_spec(
        self,
        path: str,
        runtime_mode: GraphMode,
        desc: BatchDescriptor,
        signature: object,
        max_items: int,
    ) -> CaptureSpec:
        """The static shape of the graph of one key."""
        items = desc.num_items or max_items
        frames = self.graph_frames(runtime_mode, desc, max_items)
        return CaptureSpec(path, desc.num_tokens, items, frames, signature)

    def graph_frames(self, runtime_mode: GraphMode, desc: BatchDescriptor, max_items: int) -> int:
        """Attention sequences (frames) the graph of a key holds.

        Looked up on every call, so remembered per key and frame limit.
        """
        remembered = (runtime_mode, desc, max_items, self.max_frames)
        frames = self._graph_frames.get(remembered)
        if frames is None:
            frames = self._graph_frames[remembered] = self._frames_of(runtime_mode, desc, max_items)
        return frames

    def _frames_of(self, runtime_mode: GraphMode, desc: BatchDescriptor, max_items: int) -> int:
        items = desc.num_items or max_items
        if runtime_mode is GraphMode.PIECEWISE:
            # Attention runs eagerly, so the metadata may hold every frame a
            # sub-batch can have, whatever limit FULL graphs keep to.
            return max(self.max_frames, items * self.item_frames)
        if desc.uniform:
            return items * self.item_frames
        if desc.num_items is None or items >= min(desc.num_tokens, max_items):
            # One graph for any item count, or a budget's most items.
            return self.max_frames
        # A mixed key of fewer items: as many sequence slots as they need.
        return min(items * self.item_frames, self.max_frames)


def path_budget_choices(
    encoder_config: EncoderGraphConfig, config: GraphConfig
) -> dict[str, BudgetConfig]:
    """Each path's budget choice: its entry in ``config.paths``, else ``config.budgets``.

    Raises:
        ValueError: ``config.paths`` names a path the tower does not have.
    """
    unknown = sorted(set(config.paths) - set(encoder_config.paths))
    if unknown:
        raise ValueError(
            f"paths names unknown encoder path(s) {unknown}; "
            f"this tower's paths: {', '.join(encoder_config.paths)}"
        )
    return {path: config.paths.get(path, config.budgets) for path in encoder_config.paths}


def resolve_path(
    encoder: GraphableEncoder, path: str, choice: BudgetConfig, max_items: int | None
) -> tuple[list[int], int]:
    """The budgets of ``path`` and the most items they allow (see :func:`resolve_budgets`)."""
    default_min, default_max = encoder.token_budget_range(path)
    min_budget = choice.min_budget if choice.min_budget is not None else default_min
    max_budget = choice.max_budget if choice.max_budget is not None else default_max
    if choice.min_budget is None and choice.max_budget is not None:
        min_budget = min(min_budget, max_budget)
    return resolve_budgets(
        min_budget,
        max_budget,
        list(choice.budgets) if choice.budgets is not None else None,
        max_items,
        # An auto ladder is pow2 until it is learned.
        ladder="pow2" if choice.ladder == AUTO_LADDER else choice.ladder,
        ratio=choice.ratio,
        align=choice.align,
    )


def compiled_choice(choice: BudgetConfig) -> BudgetConfig:
    """The budget choice of graphs captured from a forward compiled once for
    every budget: a generated ladder coarser than ``choice.compiled_ratio``
    becomes geometric at that ratio. Uncompiled, each budget's graph costs its
    capture and pads as much as before; compiled, padding costs fused work on
    every replay, so finer budgets pay.
    Explicit and ``auto`` ladders are the user's or the data's: kept."""
    ratio = choice.compiled_ratio
    if ratio is None or choice.budgets is not None or choice.ladder == AUTO_LADDER:
        return choice
    if choice.ladder == "geometric" and choice.ratio <= ratio:
        return choice
    return dataclasses.replace(choice, ladder="geometric", ratio=ratio)


def use_ladders(
    encoder: GraphableEncoder,
    plans: Mapping[str, PathPlan],
    choices: Mapping[str, BudgetConfig],
    user_max_items: int | None,
    compiled: bool,
) -> None:
    """Give each path the ladder of its choice, refined by :func:`compiled_choice`
    when ``compiled``, within the budgets it kept (a budget dropped for lack of
    memory stays dropped). Paths whose choice has no compiled ladder keep theirs."""
    for path, plan in plans.items():
        refined = compiled_choice(choices[path])
        if refined is choices[path] or plan.eager_reason is not None:
            continue
        choice = refined if compiled else choices[path]
        budgets, _ = resolve_path(encoder, path, choice, user_max_items)
        plan.set_budgets([budget for budget in budgets if budget <= plan.budgets[-1]])


def plan_paths(
    encoder: GraphableEncoder, config: GraphConfig, choices: Mapping[str, BudgetConfig]
) -> tuple[dict[str, PathPlan], int]:
    """Every path's plan, and the item cap of a sub-batch (the tightest path's).

    Raises:
        ValueError: a path's largest budget cannot fit any memory in reach
            (:func:`~lightning_cg.engine.budget_memory.check_budgets_fit`).
    """
    user_max_items = config.max_items_per_batch
    max_items = min(
        resolve_path(encoder, path, choice, user_max_items)[1] for path, choice in choices.items()
    )
    encoder_config = encoder.graph_config()
    counts = list(config.uniform_item_counts or pow2_counts(max_items))
    frames_per_item = encoder_config.max_frames_per_item
    max_frames = config.max_frames_per_batch or max_items * frames_per_item
    slot_counts = mixed_slot_counts(max_items, max_frames, frames_per_item)
    plans = {}
    for path, path_config in encoder_config.paths.items():
        # The user's max_items, not the resolved one: that would start every
        # ladder at max_items (the seed's 'only max_items' branch).
        budgets, _ = resolve_path(encoder, path, choices[path], user_max_items)
        plans[path] = PathPlan(
            budgets=budgets,
            dispatcher=CudagraphDispatcher(
                config.mode,
                budgets,
                counts,
                mixed_item_counts=slot_counts if path_config.per_item_metadata else (),
            ),
            allow_zero_tokens=path_config.allow_zero_tokens,
            item_frames=frames_per_item,
            max_frames=max_frames,
        )
    check_budgets_fit(encoder, {path: plan.budgets for path, plan in plans.items()}, config)
    return plans, max_items


def cap_items(plans: Mapping[str, PathPlan], max_items: int) -> None:
    """Hold at most ``max_items`` items in a sub-batch, and their frames in a FULL graph.

    A FULL graph's attention is launched for every sequence slot it holds,
    empty or not, so an auto ladder lowers the cap to what its sample needs.
    """
    counts = pow2_counts(max_items)
    for plan in plans.values():
        plan.max_frames = max_items * plan.item_frames
        slot_counts = mixed_slot_counts(max_items, plan.max_frames, plan.item_frames)
        plan.dispatcher = plan.dispatcher.replace(
            uniform_item_counts=counts,
            mixed_item_counts=slot_counts if plan.dispatcher.mixed_item_counts else (),
        )


def next_pow2(count: int) -> int:
    """The smallest power of two >= ``count``."""
    return 1 << (count - 1).bit_length()


def pow2_counts(max_items: int) -> list[int]:
    """1, 2, 4, ... below ``max_items``, then ``max_items``."""
    counts = [1]
    while counts[-1] * 2 <= max_items:
        counts.append(counts[-1] * 2)
    if counts[-1] != max_items:
        counts.append(max_items)
    return counts


def mixed_slot_counts(max_items: int, max_frames: int, frames_per_item: int) -> list[int]:
    """Item counts of the FULL graphs of a path with per-item metadata: the powers
    of two whose frames stay below ``max_frames``, then ``max_items``, whose
    graph holds all ``max_frames`` (the one graph per budget it replaces)."""
    return [
        count
        for count in pow2_counts(max_items)
        if count < max_items and count * frames_per_item < max_frames
    ] + [max_items]


def frames_fit_items(frames: int, plan: PathPlan, max_items: int) -> int:
    """Item slots that hold ``frames`` attention sequences, at most ``max_items``."""
    return min(-(-frames // plan.item_frames), max_items)
