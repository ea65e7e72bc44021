"""The graph configuration: one frozen object, checked once where it is built and trusted after."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

from lightning_cg.core.budgets import (
    Ladder,
    check_budget_list,
    check_geometric_rungs,
    check_ladder,
    check_range,
)
from lightning_cg.core.dispatcher import GraphMode
from lightning_cg.engine.compiled import check_compile

#: When a key is captured (``capture``; see :class:`GraphConfig`).
CaptureName = Literal["paid_back", "first_use", "upfront"]
CAPTURE_POLICIES: tuple[str, ...] = get_args(CaptureName)
#: The values of :class:`~lightning_cg.core.dispatcher.GraphMode`, as users write them.
ModeName = Literal["none", "full", "full_uniform_only"]


def _check_positive_int(name: str, value: Any, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        allowed = "a positive integer or None" if none_ok else "a positive integer"
        raise ValueError(f"{name} must be {allowed}; got {name}={value!r}")


def _check_choice(name: str, value: Any, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {name}={value!r}")


#: Options of a generated ladder, and the ladders that read each.
_LADDER_OPTIONS = {
    "ratio": ("geometric",),
    "align": ("pow2", "geometric"),
}


@dataclass(frozen=True)
class BudgetConfig:
    """How one encoder path's token budgets are chosen.

    Attributes:
        min_budget: smallest budget; None takes the adapter's default (so does max_budget).
        budgets: an explicit ladder, each budget once, in any order; overrides min/max.
        ladder: ``pow2`` (double from min) or ``geometric`` (multiply by ratio).
        align: geometric budgets are rounded up to a multiple of this.
    """

    min_budget: int | None = None
    max_budget: int | None = None
    budgets: Sequence[int] | None = None
    ladder: Ladder = "pow2"
    ratio: float = 1.25
    align: int = 16

    def __post_init__(self) -> None:
        for name in ("min_budget", "max_budget"):
            _check_positive_int(name, getattr(self, name), none_ok=True)
        if None not in (self.min_budget, self.max_budget):
            check_range(self.min_budget, self.max_budget)
        if self.budgets is not None:
            if isinstance(self.budgets, str | bytes) or not isinstance(self.budgets, Sequence):
                raise ValueError(
                    f"budgets must be a list of positive integers; got budgets={self.budgets!r}"
                )
            for index, budget in enumerate(self.budgets):
                _check_positive_int(f"budgets[{index}]", budget)
            check_budget_list(self.budgets)
            object.__setattr__(self, "budgets", tuple(self.budgets))
        check_ladder(self.ladder, self.ratio, self.align)
        self._check_options_apply()

    def _check_options_apply(self) -> None:
        """Refuse an option the chosen ladder would ignore (set away from its default)."""
        explicit = self.budgets is not None
        ladder = "budgets (an explicit ladder)" if explicit else f"ladder={self.ladder!r}"
        for name, ladders in _LADDER_OPTIONS.items():
            value = getattr(self, name)
            applies = not explicit and self.ladder in ladders
            if not applies and _is_set(self, name):
                raise ValueError(
                    f"{name}={value!r} applies only to ladder {' or '.join(map(repr, ladders))}, "
                    f"so with {ladder} it would be ignored; drop it or choose such a ladder"
                )
        if not explicit:
            return
        if self.ladder != _BUDGET_DEFAULTS["ladder"]:
            raise ValueError(
                f"budgets (an explicit ladder) and ladder={self.ladder!r} exclude each other; "
                f"got budgets={list(self.budgets)!r}"
            )
        for name, outside in (("min_budget", min), ("max_budget", max)):
            bound = getattr(self, name)
            if bound is not None and outside(self.budgets) != bound:
                raise ValueError(
                    f"{name}={bound} contradicts budgets={list(self.budgets)!r}: with an "
                    f"explicit ladder, {name} may only repeat its {outside.__name__}imum; drop it"
                )

    @classmethod
    def from_mapping(cls, field_name: str, choice: Mapping[str, Any] | None) -> BudgetConfig:
        """A BudgetConfig from a mapping of its fields (a Hydra node, a dict); errors name it."""
        if isinstance(choice, BudgetConfig):
            return choice
        choice = _as_mapping(choice, field_name)
        unknown = sorted(set(choice) - set(BUDGET_FIELDS))
        if unknown:
            raise ValueError(
                f"{field_name} has unknown key(s) {unknown}; allowed: {', '.join(BUDGET_FIELDS)}"
            )
        if choice.get("budgets") is not None and not isinstance(choice["budgets"], str):
            choice["budgets"] = list(choice["budgets"])
        try:
            return cls(**choice)
        except ValueError as error:
            # Every check names its key first: the message names it under field_name.
            raise ValueError(f"{field_name}.{error}") from None


#: The keys of a budget choice (``budgets:`` and each entry of ``paths:``).
BUDGET_FIELDS = tuple(f.name for f in fields(BudgetConfig))
_BUDGET_DEFAULTS = {option.name: option.default for option in fields(BudgetConfig)}


@dataclass(frozen=True)
class GraphConfig:
    """How a tower's graphs are planned, captured and dispatched.

    Attributes:
        paths: per encoder path, a whole budget choice used on that path instead of
            ``budgets``: keys it leaves out take BudgetConfig's defaults, not those of
            ``budgets`` (a mapping and a BudgetConfig alike).
        max_items_per_batch: most items in one sub-batch; None derives it from the budgets.
        max_frames_per_batch: attention sequences a graph holds; None is
            ``max_items_per_batch * max_frames_per_item``. Larger sub-batches run eagerly.
        compile: capture a ``torch.compile``'d graph forward (``full``, ``full_uniform_only``).
        capture: ``paid_back`` once a key's capture should pay for itself, ``first_use`` when
            a batch first needs it, ``upfront`` a path's whole ladder at its first call.
        cast_weights_per_run: under autocast, graphs read low-precision weight copies
            refreshed each run; false: every replay casts (and sees weights changed mid-run).
            None: copies, except for the callback in a fit, where they would stay allocated
            through training (see :func:`weight_copies`).
        plan: a JSON file of what the capture rule learned (keys' sightings and times, keys
            sent to eager, capture faults): read when a manager is built, if it exists;
            written at each run's end by the callback and on leaving ``graphed``. None: none.
    """

    # Its value too: LightningCLI parses an enum by its member's name (FULL), users write its value.
    mode: GraphMode | ModeName = GraphMode.FULL
    budgets: BudgetConfig = field(default_factory=BudgetConfig)
    paths: Mapping[str, BudgetConfig] = field(default_factory=dict)
    max_items_per_batch: int | None = None
    max_frames_per_batch: int | None = None
    compile: bool = False
    capture: CaptureName = "paid_back"
    cast_weights_per_run: bool | None = None
    plan: str | None = None

    def __post_init__(self) -> None:
        set_field = object.__setattr__
        set_field(self, "mode", GraphMode.parse(self.mode))
        if not isinstance(self.budgets, BudgetConfig):
            raise ValueError(f"budgets must be a BudgetConfig; got budgets={self.budgets!r}")
        if not isinstance(self.paths, Mapping) or not all(
            isinstance(choice, BudgetConfig) for choice in self.paths.values()
        ):
            raise ValueError(f"paths must map path names to BudgetConfig; got paths={self.paths!r}")
        set_field(self, "paths", dict(self.paths))
        for name in ("max_items_per_batch", "max_frames_per_batch"):
            _check_positive_int(name, getattr(self, name), none_ok=True)
        if not isinstance(self.cast_weights_per_run, bool | None):
            raise ValueError(
                "cast_weights_per_run must be true, false or null; "
                f"got cast_weights_per_run={self.cast_weights_per_run!r}"
            )
        check_compile(self.compile, self.mode)
        _check_choice("capture", self.capture, CAPTURE_POLICIES)
        if not self.compile:
            self._check_compile_only_options()
        _check_plan(self.plan)
        for where, choice in self._budget_choices():
            if None not in (choice.min_budget, choice.max_budget):
                check_rungs(where, choice, choice.min_budget, choice.max_budget)

    def _budget_choices(self) -> list[tuple[str, BudgetConfig]]:
        """Each budget choice with the option that holds it: ``budgets``, ``paths.<path>``."""
        return [("budgets", self.budgets), *((f"paths.{p}", c) for p, c in self.paths.items())]

    def _check_compile_only_options(self) -> None:
        """Refuse ``align`` of a pow2 ladder: only compiling reads it (its ladder is geometric)."""
        for where, choice in self._budget_choices():
            if choice.budgets is None and choice.ladder == "pow2" and _is_set(choice, "align"):
                raise ValueError(
                    f"{where}.align={choice.align!r} is read only by compiled capture here, "
                    "and compile is False: drop it, or set compile=True"
                )

    @classmethod
    def from_config_or_options(
        cls, config: GraphConfig | None, options: Mapping[str, Any]
    ) -> GraphConfig:
        """``config``, else one built from ``options`` (an option given as None takes its
        default); a ValueError for both, or for a ``config`` that is no GraphConfig."""
        if config is not None and not isinstance(config, GraphConfig):
            raise ValueError(f"config must be a GraphConfig or None; got config={config!r}")
        _check_option_names(options)
        given = {name: value for name, value in options.items() if value is not None}
        if config is not None and given:
            raise ValueError(
                f"config holds every graph option; pass {sorted(given)} inside it, not beside it"
            )
        return config if config is not None else cls.from_options(**given)

    @classmethod
    def from_options(
        cls,
        budgets: Mapping[str, Any] | BudgetConfig | None = None,
        paths: Mapping[str, Mapping[str, Any] | BudgetConfig] | None = None,
        **options: Any,
    ) -> GraphConfig:
        """A GraphConfig from plain values (Hydra, keywords): ``budgets`` and each ``paths`` entry
        may be mappings of :data:`BUDGET_FIELDS`; a path's entry is its whole budget choice
        (the keys it leaves out take BudgetConfig's defaults, not those of ``budgets``)."""
        _check_option_names(options)
        base = BudgetConfig.from_mapping("budgets", budgets)
        if paths is not None and not isinstance(paths, Mapping):
            raise ValueError(f"paths must map path names to budget choices; got paths={paths!r}")
        path_budgets = {
            path: BudgetConfig.from_mapping(f"paths.{path}", choice)
            for path, choice in (paths or {}).items()
        }
        return cls(budgets=base, paths=path_budgets, **options)


def _check_plan(plan: Any) -> None:
    """A plan file's path (str or os.PathLike), not empty, not a folder."""
    if plan is None:
        return
    if not isinstance(plan, str | os.PathLike) or not os.fspath(plan):
        raise ValueError(f"plan must be a JSON file path or None; got plan={plan!r}")
    if os.path.isdir(plan):
        raise ValueError(f"plan must be a JSON file path, not a folder; got plan={plan!r}")


def check_rungs(where: str, choice: BudgetConfig, min_budget: int, max_budget: int) -> None:
    """Refuse a geometric ``choice`` whose ratio or align leaves its ladder from ``min_budget``
    to ``max_budget`` only its two ends (:func:`~lightning_cg.core.budgets.check_geometric_rungs`);
    the error names the option ``where`` holds it."""
    if choice.budgets is not None or choice.ladder != "geometric":
        return
    try:
        check_geometric_rungs(min_budget, max_budget, choice.ratio, choice.align)
    except ValueError as error:
        raise ValueError(f"{where}.{error}") from None


def _check_option_names(options: Mapping[str, Any]) -> None:
    names = [f.name for f in fields(GraphConfig)]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise ValueError(f"unknown graph option(s) {unknown}; allowed: {', '.join(names)}")


def _is_set(choice: BudgetConfig, name: str) -> bool:
    """Whether ``choice`` sets ``name`` away from its default (None counts as unset)."""
    value = getattr(choice, name)
    return value is not None and value != _BUDGET_DEFAULTS[name]


def _as_mapping(choice: Any, field_name: str) -> dict[str, Any]:
    if choice is None:
        return {}
    if not isinstance(choice, Mapping):
        raise ValueError(
            f"{field_name} must be a mapping of {', '.join(BUDGET_FIELDS)}; got {choice!r}"
        )
    return dict(choice)


def weight_copies(config: GraphConfig, training_follows: bool = False) -> bool:
    """Whether graphs read weight copies made once per run (``cast_weights_per_run``):
    when unset, unless training follows the runs on the same device, whose memory the
    copies would hold through it."""
    if config.cast_weights_per_run is None:
        return not training_follows
    return config.cast_weights_per_run
