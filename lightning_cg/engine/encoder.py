"""The contract between a vision tower and the graph manager: :class:`GraphableEncoder`.

An item is one image or video of a batch; a path is one pass of the tower over (a view
of) the items, graphed on its own token ladder (e.g. ``local`` and ``global``); a token
budget is the number of output tokens a captured graph holds.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

#: Padding rules for a static buffer's rows past the real data. ``repeat_last`` turns
#: offsets such as ``cu_seqlens`` into empty sequences: padding costs no attention.
PADDING_RULES = ("zero", "repeat_last")
#: How ``compile=True`` treats a graph forward's shapes (:attr:`EncoderGraphConfig.compile_shapes`).
COMPILE_SHAPES = ("static", "dynamic")


@dataclass(frozen=True)
class ItemSpec:
    """What one item costs.

    Attributes:
        input_size: rows of the tower's input (patches, or 1 for a batch-first tower).
        output_tokens: output rows over all paths.
        path_tokens: output tokens per path, counted against its budgets.
        num_frames: attention sequences this item adds (1 for an image).
    """

    input_size: int
    output_tokens: int
    path_tokens: Mapping[str, int]
    num_frames: int = 1


@dataclass(frozen=True)
class PathConfig:
    """One encoder path; a sub-batch with no tokens on it skips it.

    Attributes:
        per_item_metadata: the graph's metadata has a slot per item and empty slots
            cost time, so mixed FULL graphs are captured per power-of-two item count
            and a sub-batch replays the one with the fewest slots that hold it.
    """

    min_token_budget: int
    per_item_metadata: bool = False


@dataclass(frozen=True)
class EncoderGraphConfig:
    """What an adapter tells the manager about its tower.

    Attributes:
        paths: encoder paths by name, in the order their outputs are joined.
        padding_rules: static buffer name -> one of :data:`PADDING_RULES` (default zero).
        compile_shapes: ``dynamic`` compiles once with symbolic sizes for every budget
            (packed towers); ``static`` compiles the first budget's shapes (faster
            kernels) and recompiles symbolically at a second (batch-first towers).
    """

    paths: Mapping[str, PathConfig]
    padding_rules: Mapping[str, str] = field(default_factory=dict)
    max_frames_per_item: int = 1
    compile_shapes: str = "dynamic"

    def __post_init__(self) -> None:
        if not self.paths:
            raise ValueError("EncoderGraphConfig.paths must name at least one encoder path")
        for name, rule in self.padding_rules.items():
            if rule not in PADDING_RULES:
                raise ValueError(
                    f"EncoderGraphConfig.padding_rules[{name!r}] is {rule!r}; "
                    f"allowed: {', '.join(PADDING_RULES)}"
                )
        if self.compile_shapes not in COMPILE_SHAPES:
            raise ValueError(
                f"EncoderGraphConfig.compile_shapes is {self.compile_shapes!r}; "
                f"allowed: {', '.join(COMPILE_SHAPES)}"
            )


@dataclass(frozen=True)
class CaptureSpec:
    """The static shape of one graph: what ``capture_inputs`` must allocate for.

    ``max_items`` and ``max_frames`` are what the graph's metadata holds; ``signature``
    is :meth:`GraphableEncoder.graph_signature` of the batches it serves.
    """

    path: str
    token_budget: int
    max_items: int
    max_frames: int
    signature: Hashable


@runtime_checkable
class GraphableEncoder(Protocol):
    """A vision tower the manager can capture and replay.

    ``inputs`` is whatever :meth:`inputs_from_call` builds; the manager passes it back
    untouched. ``adapters/batched.py`` and ``adapters/packed.py`` are worked examples.

    Optional: ``postprocess_joined(path_rows, inputs)`` builds :meth:`postprocess`'s
    output from ``{path: every item's rows in order}`` (no per-item split);
    ``collects_layer_outputs(path, buffers)`` says whether a graph serves calls that
    collect per-layer outputs in a list: with compiled blocks those capture the
    uncompiled forward, since each block would compile again; ``tower``, the module itself:
    graphs read low-precision copies of its weights under autocast, and calls while it is
    in train mode run eagerly.
    """

    def graph_config(self) -> EncoderGraphConfig:
        """Paths, padding rules and sizes of the tower."""
        ...

    def token_budget_range(self, path: str) -> tuple[int, int]:
        """Default ``(min_budget, max_budget)`` of a path when the user sets none."""
        ...

    def inputs_from_call(self, args: tuple, kwargs: dict) -> Any:
        """Turn the tower's call arguments into this adapter's inputs."""
        ...

    def item_specs(self, inputs: Any) -> list[ItemSpec]:
        """One spec per item, in input order."""
        ...

    def select_items(self, inputs: Any, indices: Sequence[int]) -> Any:
        """The inputs of the items at ``indices``, in that order."""
        ...

    def graph_signature(self, inputs: Any) -> Hashable:
        """What a graph must match besides size (per-item shape, dtype); one graph set each."""
        ...

    def capture_inputs(self, spec: CaptureSpec) -> dict[str, torch.Tensor]:
        """Static buffers for one graph, filled with valid dummy data, rows on dim 0."""
        ...

    def replay_inputs(self, path: str, inputs: Any) -> dict[str, torch.Tensor]:
        """The real, unpadded rows of each static buffer of ``path`` (a prefix of it).

        Host rows for a device buffer are padded on the host and copied in from pinned
        memory, with no kernels and no sync.
        """
        ...

    def graph_forward(self, path: str, buffers: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Run ``path`` on static buffers (captured: no host syncs, no data-dependent shapes)."""
        ...

    def eager_forward(self, path: str, inputs: Any) -> torch.Tensor:
        """Run ``path`` eagerly; returns exactly the real output rows, in item order."""
        ...

    def postprocess(self, outputs: list[dict[str, torch.Tensor]], inputs: Any) -> Any:
        """Join per-item outputs (path -> rows) into the tower's own output format."""
        ...
