"""The contract between a vision tower and the graph manager.

A tower becomes graphable through an adapter that implements
:class:`GraphableEncoder`. The manager never looks inside the tower: it asks the
adapter how many tokens each item costs on each encoder path, for static input
buffers of a given size, and to run the tower on those buffers.

Vocabulary:
    item: one image or video of a batch (one row of a batch-first tower).
    path: one pass of the tower over (a view of) the items, graphed on its own
        token ladder, e.g. ``local`` (native resolution) and ``global`` (a
        fixed low-resolution view).
    token budget: the number of output tokens a captured graph holds; a
        sub-batch runs in the smallest budget its tokens fit.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

#: Padding rules for the rows of a static buffer past the real data.
#: ``zero``: zeros. ``repeat_last``: the last real row repeated, which turns
#: cumulative offsets such as ``cu_seqlens`` into empty sequences, so padding
#: tokens cost no attention.
PADDING_RULES = ("zero", "repeat_last")
#: How ``compile=True`` treats a graph forward's shapes (:attr:`EncoderGraphConfig.compile_shapes`).
COMPILE_SHAPES = ("static", "dynamic")


@dataclass(frozen=True)
class ItemSpec:
    """What one item costs.

    Attributes:
        input_size: rows of the tower's input this item occupies (patches for a
            packed tower, 1 for a batch-first tower).
        output_tokens: rows of output this item produces over all paths.
        path_tokens: output tokens per encoder path; these count against the
            path's token budgets.
        num_frames: attention sequences this item adds (frames of a video, 1
            for an image); graphs hold a fixed number of them.
    """

    input_size: int
    output_tokens: int
    path_tokens: Mapping[str, int]
    num_frames: int = 1


@dataclass(frozen=True)
class PathConfig:
    """One encoder path.

    Attributes:
        min_token_budget: the smallest budget worth a graph on this path.
        allow_zero_tokens: items may have no tokens on this path (the path is
            off for them); a sub-batch with zero tokens skips the path.
        per_item_metadata: the graph's metadata holds a slot per item it may
            serve (e.g. an attention sequence per frame) and empty slots cost
            time, so FULL graphs of mixed batches are captured at each
            power-of-two item count of a budget, and a sub-batch replays the
            one with the fewest slots that hold it. False: one graph per budget.
    """

    min_token_budget: int
    allow_zero_tokens: bool = False
    per_item_metadata: bool = False


@dataclass(frozen=True)
class EncoderGraphConfig:
    """What an adapter tells the manager about its tower.

    Attributes:
        modalities: the kinds of items the tower takes, e.g. ``("image", "video")``.
        paths: encoder paths by name, in the order their outputs are joined.
        padding_rules: static buffer name -> one of :data:`PADDING_RULES`;
            buffers not named are zero-padded.
        max_frames_per_item: most frames one item may have (1 for images).
        out_hidden_size: width of one output token.
        compile_shapes: how ``compile=True`` compiles the graph forward.
            ``dynamic``: once, with symbolic sizes, for every budget (packed
            towers, whose calls need many token budgets). ``static``: the first
            budget's shapes as they are, which gives faster kernels and a
            shorter compile, and a recompile with the sizes that changed made
            symbolic once a second budget is captured (torch.compile's default;
            for batch-first towers, whose calls come in one or two batch sizes).
    """

    modalities: tuple[str, ...]
    paths: Mapping[str, PathConfig]
    padding_rules: Mapping[str, str] = field(default_factory=dict)
    max_frames_per_item: int = 1
    out_hidden_size: int = 0
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

    Attributes:
        path: the encoder path this graph runs.
        token_budget: output tokens the graph holds.
        max_items: items the graph's metadata holds.
        max_frames: attention sequences the graph's metadata holds.
        signature: the adapter's :meth:`GraphableEncoder.graph_signature` of the
            batches this graph serves (e.g. per-item shape and dtype).
    """

    path: str
    token_budget: int
    max_items: int
    max_frames: int
    signature: Hashable


@runtime_checkable
class GraphableEncoder(Protocol):
    """A vision tower the manager can capture and replay.

    ``inputs`` below is whatever the adapter builds from the tower's call
    arguments (see :meth:`inputs_from_call`); the manager passes it back
    untouched. Implement this for your own tower; ``adapters/batched.py`` and
    ``adapters/packed.py`` are worked examples.

    Optionally, ``postprocess_joined(path_rows, inputs)`` builds the same output
    as :meth:`postprocess` from ``{path: rows of every item, in item order}``;
    the manager calls it instead when a call's rows come in one piece per path,
    which saves splitting them per item and joining them again. And
    ``collects_layer_outputs(path, buffers)`` says whether the graph of
    ``buffers`` serves calls that collect per-layer outputs in a Python list
    (transformers' ``output_attentions``): with ``compile_scope`` blocks those
    graphs capture the uncompiled forward, since one compiled block would
    compile again for every block.
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
        """What a graph must match besides size (per-item shape, dtype).

        Batches with a new signature get their own set of graphs.
        """
        ...

    def capture_inputs(self, spec: CaptureSpec) -> dict[str, torch.Tensor]:
        """Static buffers for one graph, filled with valid dummy data.

        Every buffer is indexed by rows on dim 0; :meth:`replay_inputs` returns a
        tensor per buffer name whose rows are a prefix of it.
        """
        ...

    def replay_inputs(self, path: str, inputs: Any) -> dict[str, torch.Tensor]:
        """The real, unpadded rows for each static buffer of ``path``.

        Rows may be on the host for a device buffer (small metadata built from
        host sizes): the manager pads them there and copies them in with one
        asynchronous copy from pinned memory, no kernels and no sync.
        """
        ...

    def graph_forward(self, path: str, buffers: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Run ``path`` on static buffers; rows of the result are output tokens.

        This is what gets captured: no host syncs, no data-dependent shapes.
        """
        ...

    def eager_forward(self, path: str, inputs: Any) -> torch.Tensor:
        """Run ``path`` eagerly; returns exactly the real output rows, in item order."""
        ...

    def postprocess(self, outputs: list[dict[str, torch.Tensor]], inputs: Any) -> Any:
        """Join per-item outputs (path -> rows) into the tower's own output format."""
        ...
