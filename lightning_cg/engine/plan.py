"""The plan: each path's budgets and dispatcher, the item cap, and each call's plan.

A :class:`Plan` is immutable: what changes it (a capture fault, compiling) puts a new one
in the manager's :class:`~lightning_cg.engine.state.EngineState`. It remembers the call
plan (sub-batches and keys) of every call shape it has seen; those go with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lightning_cg.core.budgets import resolve_budgets
from lightning_cg.core.dispatcher import BatchDescriptor, CudagraphDispatcher, GraphMode
from lightning_cg.core.packing import pack_items
from lightning_cg.engine.budget_memory import check_budgets_fit
from lightning_cg.engine.cache import GraphKey, GraphSet
from lightning_cg.engine.config import BudgetConfig, GraphConfig
from lightning_cg.engine.encoder import CaptureSpec, EncoderGraphConfig, GraphableEncoder, ItemSpec

#: Call plans (and sub-batch keys) a plan remembers before it starts over: mixed
#: sizes give many shapes, and a long run must not grow them without bound.
MAX_CALL_PLANS = 4096
#: Growth of the generated ladders of compiled graphs (see :func:`compiled_choice`).
COMPILED_RATIO = 1.05


@dataclass(frozen=True)
class PathPlan:
    """Resolved budgets and dispatcher of one encoder path.

    Attributes:
        item_frames: most frames of one item.
        max_frames: attention sequences the path's FULL graphs hold at most.
        eager_reason: why the path runs eagerly whatever the mode (a capture fault).
    """

    budgets: tuple[int, ...]
    dispatcher: CudagraphDispatcher
    item_frames: int
    max_frames: int
    eager_reason: str | None = None
    _graph_frames: dict[tuple, int] = field(default_factory=dict, repr=False, compare=False)

    def with_budgets(self, budgets: Sequence[int]) -> PathPlan:
        """This plan graphing ``budgets`` (a reduced or compiled ladder)."""
        budgets = tuple(budgets)
        dispatcher = self.dispatcher.replace(budgets=list(budgets))
        return dataclasses.replace(self, budgets=budgets, dispatcher=dispatcher, _graph_frames={})

    def below(self, failed_budget: int) -> PathPlan:
        """This plan without the budgets from ``failed_budget`` on; eager with none left."""
        kept = [budget for budget in self.budgets if budget < failed_budget]
        if kept:
            return self.with_budgets(kept)
        return self.eager(f"out of memory at its smallest token budget {failed_budget}")

    def eager(self, reason: str) -> PathPlan:
        """This path run eagerly for ``reason``."""
        return dataclasses.replace(self, eager_reason=reason)

    def capture_spec(
        self, path: str, desc: BatchDescriptor, signature: object, max_items: int
    ) -> CaptureSpec:
        """The static shape of the graph of one key."""
        items = desc.num_items or max_items
        frames = self.graph_frames(desc, max_items)
        return CaptureSpec(path, desc.num_tokens, items, frames, signature)

    def graph_frames(self, desc: BatchDescriptor, max_items: int) -> int:
        """Attention sequences (frames) the graph of a key holds (remembered per key)."""
        remembered = (desc, max_items)
        frames = self._graph_frames.get(remembered)
        if frames is not None:
            return frames
        items = desc.num_items or max_items
        if desc.uniform:
            frames = items * self.item_frames
        elif desc.num_items is None or items >= min(desc.num_tokens, max_items):
            # One graph for any item count, or a budget's most items.
            frames = self.max_frames
        else:
            # A mixed key of fewer items: as many sequence slots as they need.
            frames = min(items * self.item_frames, self.max_frames)
        self._graph_frames[remembered] = frames
        return frames


@dataclass(frozen=True)
class PathRoute:
    """One path of one sub-batch in a call plan: the key that serves it, or why none
    (``misses``: graphs off or the path eager; else :meth:`Plan.no_key_reason`)."""

    path: str
    total: int
    key: GraphKey | None
    reason: str = ""


@dataclass(frozen=True)
class SubBatchPlan:
    """The items of one sub-batch (their positions in the call) and each path's route."""

    indices: list[int]
    routes: tuple[PathRoute, ...]


@dataclass(frozen=True)
class Plan:
    """The paths' plans, the item cap of a sub-batch, and the call plans they give."""

    paths: Mapping[str, PathPlan]
    max_items: int
    mode: GraphMode
    _calls: dict = field(default_factory=dict, repr=False, compare=False)
    _keys: dict = field(default_factory=dict, repr=False, compare=False)

    def with_paths(self, paths: Mapping[str, PathPlan]) -> Plan:
        """This plan with ``paths``."""
        return Plan(dict(paths), self.max_items, self.mode)

    def call_plan(self, graph_set: GraphSet, specs: Sequence[ItemSpec]) -> list[SubBatchPlan]:
        """The sub-batches of a call and each one's routes, remembered per call shape."""
        shape = (graph_set, tuple((tuple(s.path_tokens.items()), s.num_frames) for s in specs))
        call = self._calls.get(shape)
        if call is None:
            if len(self._calls) >= MAX_CALL_PLANS:
                self._calls.clear()
            call = self._calls[shape] = self._plan_call(graph_set, specs)
        return call

    def _plan_call(self, graph_set: GraphSet, specs: Sequence[ItemSpec]) -> list[SubBatchPlan]:
        item_tokens = [spec.path_tokens for spec in specs]
        max_budgets = {path: plan.budgets[-1] for path, plan in self.paths.items()}
        packed = pack_items(item_tokens, self.max_items, max_budgets)
        sub_batches = []
        # Items in call order: consecutive items are selected as views, not gathered.
        for indices in map(sorted, packed):
            routes = []
            for path in self.paths:
                tokens = [item_tokens[i].get(path, 0) for i in indices]
                frames = sum(specs[i].num_frames for i in indices)
                routes.append(self._route(graph_set, path, tokens, frames))
            sub_batches.append(SubBatchPlan(indices, tuple(routes)))
        return sub_batches

    def _route(self, graph_set: GraphSet, path: str, tokens: list[int], frames: int) -> PathRoute:
        total = sum(tokens)
        if total == 0:
            return PathRoute(path, 0, None)
        key = self.key(graph_set, path, tokens, frames)
        if key is not None:
            return PathRoute(path, total, key)
        return PathRoute(path, total, None, self.no_key_reason(path, total) or "misses")

    def no_key_reason(self, path: str, total: int) -> str:
        """Why a sub-batch of ``total`` tokens on ``path`` has no key: "" when graphs are
        off or the path is eager (a plain miss), ``above_budget``, else the mode or the
        ladder holds no graph of its shape (``no_graph_for_shape``)."""
        if self.mode is GraphMode.NONE or self.paths[path].eager_reason is not None:
            return ""
        return "above_budget" if total > self.paths[path].budgets[-1] else "no_graph_for_shape"

    def key(
        self, graph_set: GraphSet, path: str, tokens: Sequence[int], frames: int
    ) -> GraphKey | None:
        """The key of the graph that holds a sub-batch's ``tokens`` (per item) and
        ``frames`` on ``path``, or None (no graph holds it, or the path is eager)."""
        plan = self.paths[path]
        if self.mode is GraphMode.NONE or plan.eager_reason is not None:
            return None
        desc = BatchDescriptor(sum(tokens), len(tokens), len(set(tokens)) == 1)
        shape = (graph_set, path, desc, frames)
        if shape not in self._keys:
            if len(self._keys) >= MAX_CALL_PLANS:
                self._keys.clear()
            self._keys[shape] = self._find_key(graph_set, path, plan, desc, frames)
        return self._keys[shape]

    def _find_key(
        self, graph_set: GraphSet, path: str, plan: PathPlan, desc: BatchDescriptor, frames: int
    ) -> GraphKey | None:
        found = plan.dispatcher.dispatch(desc)
        if found is not None and frames > plan.graph_frames(found, self.max_items):
            # More sequences than the key's graph holds: a mixed key with enough slots.
            slots = min(-(-frames // plan.item_frames), self.max_items)
            found = plan.dispatcher.dispatch(BatchDescriptor(desc.num_tokens, slots))
        if found is None or frames > plan.graph_frames(found, self.max_items):
            return None  # no graph of the shape, or more frames than a graph holds
        return GraphKey(graph_set, path, found)


def path_budget_choices(
    encoder_config: EncoderGraphConfig, config: GraphConfig
) -> dict[str, BudgetConfig]:
    """Each path's budget choice: its entry in ``config.paths``, else ``config.budgets``."""
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
        ladder=choice.ladder,
        ratio=choice.ratio,
        align=choice.align,
    )


def compiled_choice(choice: BudgetConfig) -> BudgetConfig:
    """The budget choice of graphs from a forward compiled once for every budget: a
    generated ladder coarser than :data:`COMPILED_RATIO` becomes geometric at it (padding
    then costs fused work on every replay; finer budgets cost only captures). An
    explicit ladder stays."""
    if choice.budgets is not None or (
        choice.ladder == "geometric" and choice.ratio <= COMPILED_RATIO
    ):
        return choice
    return dataclasses.replace(choice, ladder="geometric", ratio=COMPILED_RATIO)


def use_ladders(
    encoder: GraphableEncoder,
    plan: Plan,
    choices: Mapping[str, BudgetConfig],
    user_max_items: int | None,
    compiled: bool,
) -> Plan:
    """``plan`` with each path given its choice's ladder, refined by :func:`compiled_choice`
    when ``compiled``, within the budgets it kept (dropped for memory stays dropped)."""
    laddered = {}
    for path, path_plan in plan.paths.items():
        refined = compiled_choice(choices[path])
        if refined is choices[path] or path_plan.eager_reason is not None:
            continue
        choice = refined if compiled else choices[path]
        budgets, _ = resolve_path(encoder, path, choice, user_max_items)
        top = path_plan.budgets[-1]
        laddered[path] = path_plan.with_budgets([b for b in budgets if b <= top])
    # Unchanged, the plan keeps the call plans it remembers.
    return plan.with_paths({**plan.paths, **laddered}) if laddered else plan


def plan_paths(
    encoder: GraphableEncoder, config: GraphConfig, choices: Mapping[str, BudgetConfig]
) -> Plan:
    """The plan of every path, with the item cap of a sub-batch (the tightest path's)."""
    user_max_items = config.max_items_per_batch
    max_items = min(
        resolve_path(encoder, path, choice, user_max_items)[1] for path, choice in choices.items()
    )
    encoder_config = encoder.graph_config()
    counts = pow2_counts(max_items)
    frames_per_item = encoder_config.max_frames_per_item
    max_frames = config.max_frames_per_batch or max_items * frames_per_item
    slot_counts = mixed_slot_counts(max_items, max_frames, frames_per_item)
    plans = {}
    for path, path_config in encoder_config.paths.items():
        # The user's max_items: the resolved one would start every ladder at max_items.
        budgets, _ = resolve_path(encoder, path, choices[path], user_max_items)
        mixed = slot_counts if path_config.per_item_metadata else ()
        plans[path] = PathPlan(
            budgets=tuple(budgets),
            dispatcher=CudagraphDispatcher(config.mode, budgets, counts, mixed_item_counts=mixed),
            item_frames=frames_per_item,
            max_frames=max_frames,
        )
    check_budgets_fit(encoder, {path: list(plan.budgets) for path, plan in plans.items()}, config)
    return Plan(plans, max_items, config.mode)


def pow2_counts(max_items: int) -> list[int]:
    """1, 2, 4, ... below ``max_items``, then ``max_items``."""
    counts = [1]
    while counts[-1] * 2 <= max_items:
        counts.append(counts[-1] * 2)
    if counts[-1] != max_items:
        counts.append(max_items)
    return counts


def mixed_slot_counts(max_items: int, max_frames: int, frames_per_item: int) -> list[int]:
    """Item counts of a per-item-metadata path's FULL graphs: the powers of two whose
    frames stay below ``max_frames``, then ``max_items`` (holding all ``max_frames``)."""
    return [
        count
        for count in pow2_counts(max_items)
        if count < max_items and count * frames_per_item < max_frames
    ] + [max_items]
