"""GraphableEncoder for packed towers: ``tower(pixel_patches [T, C*p*p], grid_thw [N, 3])``.

Two paths: ``local`` (each item at its native resolution, ``t*h*w / merge**2`` tokens) and
``global`` (a fixed low-resolution view of the first frame, or none). Padding repeats the
last ``cu_seqlens`` offset, so padding patches belong to no sequence. Items are packed patch
after patch (the Qwen2-VL convention): item ``i`` owns ``t * h * w`` consecutive rows.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch
from torch import nn

from lightning_cg.adapters import as_slice, join_rows, select_rows
from lightning_cg.adapters.packed_call import Grid, read_packed_call, tower_device
from lightning_cg.engine.budget_memory import MIN_ELEMENT_BYTES
from lightning_cg.engine.encoder import CaptureSpec, EncoderGraphConfig, ItemSpec, PathConfig
from lightning_cg.engine.static_inputs import PieceRows

LOCAL_PATH = "local"
GLOBAL_PATH = "global"
PATHS = (LOCAL_PATH, GLOBAL_PATH)
#: Largest local token budget when the user sets none.
DEFAULT_MAX_TOKEN_BUDGET = 4096
#: Most item sizes whose ItemSpec an adapter keeps; past it, it starts again.
MAX_KEPT_ITEM_SPECS = 4096

#: ``grid_thw`` as a ``(N, 3)`` integer tensor or as host ``(t, h, w)`` triples.
GridTHW = torch.Tensor | Sequence[Sequence[int]]

_CALL = inspect.signature(lambda pixel_patches, grid_thw: None)


class PackedTowerConfig(Protocol):
    """The sizes the adapter reads from ``tower.config`` (a ``PackedViTConfig``)."""

    in_channels: int
    patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    global_view: bool
    global_grid: int


class PackedTower(Protocol):
    """What the adapter calls on a packed tower (``PackedViT`` has it), never ``tower.forward``.

    An optional ``host_metadata_pieces(grid_thw) -> dict[str, list[np.ndarray]]`` gives
    ``host_metadata`` in pieces that replays write straight into the buffers.
    """

    config: PackedTowerConfig

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def host_metadata(self, grid_thw: GridTHW) -> dict[str, torch.Tensor]: ...

    def forward_packed(
        self,
        pixel_patches: torch.Tensor,
        cu_seqlens: torch.Tensor,
        positions: torch.Tensor,
        max_seqlen: int,
    ) -> torch.Tensor: ...

    def global_view_patches(
        self, pixel_patches: torch.Tensor, grid_thw: GridTHW
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def encode_local(self, pixel_patches: torch.Tensor, grid_thw: GridTHW) -> torch.Tensor: ...

    def encode_global(self, pixel_patches: torch.Tensor, grid_thw: GridTHW) -> torch.Tensor: ...


@dataclass
class PackedInputs:
    """One call of a packed tower; ``grid`` is ``grid_thw`` read on the host once per call."""

    pixel_patches: torch.Tensor
    grid_thw: torch.Tensor
    grid: Grid


Inputs = TypeVar("Inputs", bound=PackedInputs)


class PackedLadders:
    """Budgets (checked: else ValueError), graph config, item specs, calls and items on
    ``paths`` of the packed and Qwen adapters (they set ``_merge_area`` and ``_patch_dim``)."""

    paths: tuple[str, ...] = PATHS
    _global_tokens = 0

    def __init__(
        self,
        tower: object,
        max_frames_per_item: int,
        min_token_budget: int,
        max_token_budget: int | None,
    ) -> None:
        if max_frames_per_item < 1:
            raise ValueError(f"max_frames_per_item must be >= 1, got {max_frames_per_item}")
        if min_token_budget < 1:
            raise ValueError(f"min_token_budget must be >= 1, got {min_token_budget}")
        if max_token_budget is not None and max_token_budget < min_token_budget:
            raise ValueError(
                f"max_token_budget ({max_token_budget}) must be None or >= "
                f"min_token_budget ({min_token_budget})"
            )
        self.max_token_budget = max_token_budget or max(DEFAULT_MAX_TOKEN_BUDGET, min_token_budget)
        self.tower = tower
        self.max_frames_per_item = max_frames_per_item
        self.min_token_budget = min_token_budget
        # Specs depend only on the item size (and the sizes above) and are frozen: shared.
        self._specs_by_size: dict[tuple[int, int, int], ItemSpec] = {}

    def token_budget_range(self, path: str) -> tuple[int, int]:
        """``local``: ``(min_token_budget, max_token_budget)``."""
        self._check_path(path)
        return self.min_token_budget, self.max_token_budget

    def min_bytes_per_token(self, path: str) -> int:
        """Least bytes per token of a graph: its ``merge**2`` rows of patches."""
        self._check_path(path)
        return self._merge_area * self._patch_dim * MIN_ELEMENT_BYTES

    def item_specs(self, inputs: PackedInputs) -> list[ItemSpec]:
        """Patches, tokens per path and frames of each item."""
        specs = self._specs_by_size
        return [specs.get(size) or self._new_item_spec(size) for size in inputs.grid]

    def _new_item_spec(self, size: tuple[int, int, int]) -> ItemSpec:
        t, h, w = size
        tokens = {LOCAL_PATH: t * h * w // self._merge_area, GLOBAL_PATH: self._global_tokens}
        path_tokens = {path: tokens[path] for path in self.paths}
        spec = ItemSpec(
            input_size=t * h * w,
            output_tokens=sum(path_tokens.values()),
            path_tokens=path_tokens,
            num_frames=t,
        )
        if len(self._specs_by_size) >= MAX_KEPT_ITEM_SPECS:
            self._specs_by_size.clear()
        self._specs_by_size[size] = spec
        return spec

    def select_items(self, inputs: Inputs, indices: Sequence[int]) -> Inputs:
        """The items at ``indices``, in that order (views when consecutive); other fields kept."""
        offsets = [0, *itertools.accumulate(t * h * w for t, h, w in inputs.grid)]
        consecutive = as_slice(indices)
        if consecutive is not None:
            start, stop = consecutive.start, consecutive.stop
            return dataclasses.replace(
                inputs,
                pixel_patches=inputs.pixel_patches[offsets[start] : offsets[stop]],
                grid_thw=inputs.grid_thw[consecutive],
                grid=inputs.grid[consecutive],
            )
        pieces = [inputs.pixel_patches[offsets[i] : offsets[i + 1]] for i in indices]
        return dataclasses.replace(
            inputs,
            pixel_patches=torch.cat([inputs.pixel_patches[:0], *pieces]),
            # Not grid_thw[indices]: a list index is copied from pageable memory (a GPU wait).
            grid_thw=select_rows(inputs.grid_thw, indices),
            grid=[inputs.grid[i] for i in indices],
        )

    def _graph_config(
        self, offsets: tuple[str, ...], paths: dict | None = None
    ) -> EncoderGraphConfig:
        """Images and videos on ``local`` and ``paths``; ``offsets`` buffers repeat their last."""
        # Graphs per item count: empty cu_seqlens slots still cost flash-attention blocks.
        local = PathConfig(self.min_token_budget, per_item_metadata=True)
        return EncoderGraphConfig(
            paths={LOCAL_PATH: local, **(paths or {})},
            padding_rules=dict.fromkeys(offsets, "repeat_last"),
            max_frames_per_item=self.max_frames_per_item,
        )

    def _read_call(
        self, patches: object, grid_thw: object, merge: int, patches_name: str = "pixel_patches"
    ) -> Grid:
        device = tower_device(self.tower)
        return read_packed_call(patches, grid_thw, self._patch_dim, merge, device, patches_name)

    def _no_rows(self, width: int, inputs: PackedInputs) -> torch.Tensor:
        """The output rows of an empty call: none, of ``width`` columns."""
        dtype = next(self.tower.parameters()).dtype
        return torch.empty((0, width), dtype=dtype, device=inputs.pixel_patches.device)

    def _check_path(self, path: str) -> None:
        if path not in self.paths:
            raise ValueError(f"unknown encoder path {path!r}; allowed: {', '.join(self.paths)}")


class PackedEncoderAdapter(PackedLadders):
    """Graph a packed tower (a :class:`PackedTower`) on a ``local`` and a ``global`` ladder.

    ``max_token_budget`` None is ``max(DEFAULT_MAX_TOKEN_BUDGET, min_token_budget)``. Raises
    TypeError for a tower lacking part of :class:`PackedTower`, ValueError for a budget or
    frame count out of range.
    """

    def __init__(
        self,
        tower: PackedTower,
        max_frames_per_item: int = 1,
        min_token_budget: int = 64,
        max_token_budget: int | None = None,
    ) -> None:
        super().__init__(tower, max_frames_per_item, min_token_budget, max_token_budget)
        _check_packed_tower(tower)
        config = tower.config
        self._merge_area = config.spatial_merge_size**2
        self._patch_dim = config.in_channels * config.patch_size**2
        self._view_tokens = (config.global_grid // config.spatial_merge_size) ** 2
        self._global_tokens = self._view_tokens if config.global_view else 0
        self._metadata_pieces = getattr(tower, "host_metadata_pieces", None)

    def graph_config(self) -> EncoderGraphConfig:
        """Paths ``local`` and ``global``; ``global`` may be empty when the view is off."""
        global_path = PathConfig(self._view_tokens)
        return self._graph_config(("cu_seqlens",), {GLOBAL_PATH: global_path})

    def token_budget_range(self, path: str) -> tuple[int, int]:
        """``local``: ``(min_token_budget, max_token_budget)``; ``global``: one view up."""
        if path == GLOBAL_PATH:
            return self._view_tokens, max(self._view_tokens, self.max_token_budget)
        return super().token_budget_range(path)

    def inputs_from_call(self, args: tuple, kwargs: dict) -> PackedInputs:
        """Check a ``tower(pixel_patches, grid_thw)`` call and read its grid on the host."""
        if len(args) == 2 and not kwargs:
            # The usual call, without inspect's bind (host time).
            pixel_patches, grid_thw = args
        else:
            bound = _CALL.bind(*args, **kwargs).arguments
            pixel_patches, grid_thw = bound["pixel_patches"], bound["grid_thw"]
        grid = self._read_call(pixel_patches, grid_thw, self.tower.config.spatial_merge_size)
        return PackedInputs(pixel_patches, grid_thw, grid)

    def graph_signature(self, inputs: PackedInputs) -> Hashable:
        """Patch dtype and device; resolution is what the budgets absorb."""
        return inputs.pixel_patches.dtype, inputs.pixel_patches.device

    def capture_inputs(self, spec: CaptureSpec) -> dict[str, torch.Tensor]:
        """``pixel_patches``, ``cu_seqlens`` (``max_frames + 1``) and ``positions`` buffers
        for ``token_budget * merge**2`` patches: one frame covering them, then empty ones."""
        self._check_path(spec.path)
        dtype, device = spec.signature
        merge = self.tower.config.spatial_merge_size
        rows = spec.token_budget * self._merge_area
        metadata = self.tower.host_metadata([(1, merge, rows // merge)])
        cu_seqlens = torch.full((spec.max_frames + 1,), rows, dtype=torch.int32)
        cu_seqlens[0] = 0
        return {
            "pixel_patches": torch.zeros(rows, self._patch_dim, dtype=dtype, device=device),
            "cu_seqlens": cu_seqlens.to(device),
            "positions": metadata["positions"].to(device),
        }

    def replay_inputs(self, path: str, inputs: PackedInputs) -> Mapping[str, torch.Tensor]:
        """The path's patches (the items' own, or their global views) and their host
        metadata, as :class:`~lightning_cg.engine.static_inputs.PieceRows` where it can."""
        self._check_path(path)
        patches, grid = inputs.pixel_patches, inputs.grid
        if path == GLOBAL_PATH:
            patches, grid = self.tower.global_view_patches(patches, grid)
        if self._metadata_pieces is not None:
            return PieceRows({"pixel_patches": patches}, self._metadata_pieces(grid))
        return {"pixel_patches": patches, **self.tower.host_metadata(grid)}

    def graph_forward(self, path: str, buffers: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``tower.forward_packed`` on the buffers; every frame fits in all their rows."""
        self._check_path(path)
        patches = buffers["pixel_patches"]
        return self.tower.forward_packed(
            patches, buffers["cu_seqlens"], buffers["positions"], max_seqlen=patches.shape[0]
        )

    def eager_forward(self, path: str, inputs: PackedInputs) -> torch.Tensor:
        """The path on exactly the items' patches, in item order."""
        self._check_path(path)
        encode = self.tower.encode_local if path == LOCAL_PATH else self.tower.encode_global
        return encode(inputs.pixel_patches, inputs.grid)

    def postprocess(
        self, outputs: list[dict[str, torch.Tensor]], inputs: PackedInputs
    ) -> torch.Tensor:
        """Each item's local rows then its global rows, item after item, as the tower's forward."""
        rows = [output[path] for output in outputs for path in PATHS if path in output]
        return join_rows(rows) if rows else self._no_rows(self.tower.config.out_hidden_size, inputs)

    def postprocess_joined(
        self, path_rows: Mapping[str, torch.Tensor], inputs: PackedInputs
    ) -> torch.Tensor:
        """The tower's output from each path's rows of every item in order, interleaved per item."""
        if set(path_rows) == {LOCAL_PATH}:
            return path_rows[LOCAL_PATH]
        specs = self.item_specs(inputs)
        outputs: list[dict[str, torch.Tensor]] = [{} for _ in specs]
        for path, rows in path_rows.items():
            tokens = [spec.path_tokens.get(path, 0) for spec in specs]
            for output, item_rows, count in zip(outputs, rows.split(tokens), tokens, strict=True):
                if count:
                    output[path] = item_rows
        return self.postprocess(outputs, inputs)


def _check_packed_tower(tower: object) -> None:
    """Raise a TypeError naming what ``tower`` lacks of :class:`PackedTower`."""
    methods = [name for name in PackedTower.__dict__ if not name.startswith("_")]
    missing = [f"{name}()" for name in methods if not callable(getattr(tower, name, None))]
    config = getattr(tower, "config", None)
    missing += [
        f"config.{name}" for name in PackedTowerConfig.__annotations__ if not hasattr(config, name)
    ]
    if missing:
        raise TypeError(
            f"adapter='packed' needs a tower with the PackedTower interface of "
            f"lightning_cg.adapters.packed (PackedViT has it); {type(tower).__qualname__} "
            f"lacks {', '.join(missing)}. Give the tower those methods and config fields, "
            "or implement lightning_cg.engine.encoder.GraphableEncoder for it."
        )
