"""GraphableEncoder for the Qwen vision towers of transformers, called as their models call them.

``visual(hidden_states, grid_thw, **options)`` of Qwen2-VL, Qwen2.5-VL and Qwen3-VL(-MoE), on
one path, ``local``: the tower's own forward with its ``grid_thw`` metadata precomputed on the
host, attention through :data:`~lightning_cg.adapters.hf_attention.ATTENTION_NAME`.
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_cg.adapters import join_rows
from lightning_cg.adapters.hf_attention import (
    attention_configs,
    packed_attention,
    register_packed_attention,
)
from lightning_cg.adapters.packed import LOCAL_PATH, largest_budget
from lightning_cg.adapters.packed_inputs import (
    PackedInputs,
    read_packed_call,
    select_packed_items,
    tower_device,
)
from lightning_cg.adapters.qwen_metadata import (
    host_metadata,
    most_windows,
    window_metadata,
    window_side,
)
from lightning_cg.adapters.row_outputs import RowLayout
from lightning_cg.engine.budget_memory import MIN_ELEMENT_BYTES
from lightning_cg.engine.encoder import CaptureSpec, EncoderGraphConfig, ItemSpec, PathConfig

#: Vision towers this adapter serves, by class name, and what each computes.
QWEN_TOWERS = {
    "Qwen2VisionTransformerPretrainedModel": "qwen2_vl",
    "Qwen2_5_VisionTransformerPretrainedModel": "qwen2_5_vl",
    "Qwen3VLVisionModel": "qwen3_vl",
    # Qwen3-VL-MoE's vision tower is Qwen3-VL's under another name.
    "Qwen3VLMoeVisionModel": "qwen3_vl",
}
#: Keyword arguments the adapter computes from ``grid_thw`` itself.
METADATA_ARGUMENTS = (
    "cu_seqlens",
    "position_ids",
    "max_seqlen",
    "window_index",
    "cu_window_seqlens",
    "max_window_seqlen",
    "interp_indices",
    "interp_weights",
)
#: Fewest slots of an offsets buffer (``cu_seqlens``, ``cu_window_seqlens``): with two, a
#: dynamic-shape compile would specialize on one sequence and recompile for more frames.
#: The third slot is an empty sequence, which costs no attention.
MIN_OFFSET_SLOTS = 3
#: Call options (besides ``return_dict``) that become part of the graph signature.
Options = tuple[tuple[str, bool | int | float | str | None], ...]

_CALL = inspect.Signature(
    [
        inspect.Parameter("hidden_states", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("grid_thw", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("options", inspect.Parameter.VAR_KEYWORD),
    ]
)
_PATCHES = "hidden_states"


def qwen_tower_kind(tower: nn.Module) -> str | None:
    """``qwen2_vl``, ``qwen2_5_vl`` or ``qwen3_vl`` for a Qwen tower of transformers, else None."""
    cls = type(tower)
    if not cls.__module__.startswith("transformers."):
        return None
    return QWEN_TOWERS.get(cls.__name__)


@dataclass
class QwenInputs(PackedInputs):
    """One call of a Qwen vision tower, with its sorted ``options`` and ``return_dict``."""

    options: Options = ()
    return_dict: bool = True


class QwenVisionAdapter:
    """Graph a Qwen vision tower (of :data:`QWEN_TOWERS`) on one ladder; budgets as ``packed``'s."""

    def __init__(
        self,
        tower: nn.Module,
        max_frames_per_item: int = 1,
        min_token_budget: int = 64,
        max_token_budget: int | None = None,
    ) -> None:
        kind = qwen_tower_kind(tower)
        if kind is None:
            raise ValueError(
                f"QwenVisionAdapter serves the transformers towers {', '.join(QWEN_TOWERS)}; "
                f"got {type(tower).__module__}.{type(tower).__qualname__}"
            )
        self.max_token_budget = largest_budget(
            max_frames_per_item, min_token_budget, max_token_budget
        )
        register_packed_attention()
        self.tower = tower
        self.kind = kind
        self.max_frames_per_item = max_frames_per_item
        self.min_token_budget = min_token_budget
        config = tower.config
        self.merge = config.spatial_merge_size
        self._merge_area = self.merge**2
        self._patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
        self._attention_configs = attention_configs(tower)
        self._layouts: dict[Options, RowLayout] = {}
        self._options_by_name: dict[str, Options] = {}
        self._window_side = window_side(tower) if kind == "qwen2_5_vl" else 0

    def graph_config(self) -> EncoderGraphConfig:
        """One path, ``local``, with graphs per item count (``cu_seqlens`` has a slot per frame)."""
        return EncoderGraphConfig(
            modalities=("image", "video"),
            paths={LOCAL_PATH: PathConfig(self.min_token_budget, per_item_metadata=True)},
            padding_rules={"cu_seqlens": "repeat_last", "cu_window_seqlens": "repeat_last"},
            max_frames_per_item=self.max_frames_per_item,
            out_hidden_size=self._layout(()).width,
        )

    def token_budget_range(self, path: str) -> tuple[int, int]:
        """``(min_token_budget, max_token_budget)``."""
        self._check_path(path)
        return self.min_token_budget, self.max_token_budget

    def min_bytes_per_token(self, path: str) -> int:
        """Least bytes per token of a graph: its ``merge**2`` rows of ``hidden_states``."""
        self._check_path(path)
        return self._merge_area * self._patch_dim * MIN_ELEMENT_BYTES

    def inputs_from_call(self, args: tuple, kwargs: dict) -> QwenInputs:
        """Check a ``visual(hidden_states, grid_thw, **options)`` call; read its grid."""
        bound = _CALL.bind(*args, **kwargs).arguments
        patches, grid_thw = bound["hidden_states"], bound["grid_thw"]
        options = dict(bound.get("options", {}))
        return_dict = options.pop("return_dict", getattr(self.tower.config, "return_dict", True))
        grid = read_packed_call(
            patches,
            grid_thw,
            self._patch_dim,
            self.merge,
            tower_device(self.tower),
            patches_name=_PATCHES,
        )
        checked = _check_options(options)
        self._layout(checked)
        self._options_by_name[_patches_name(checked)] = checked
        return QwenInputs(patches, grid_thw, grid, checked, bool(return_dict))

    def item_specs(self, inputs: QwenInputs) -> list[ItemSpec]:
        """Patches, output tokens and frames of each item."""
        specs = []
        for t, h, w in inputs.grid:
            tokens = t * h * w // self._merge_area
            specs.append(
                ItemSpec(
                    input_size=t * h * w,
                    output_tokens=tokens,
                    path_tokens={LOCAL_PATH: tokens},
                    num_frames=t,
                )
            )
        return specs

    def select_items(self, inputs: QwenInputs, indices: Sequence[int]) -> QwenInputs:
        """The items at ``indices``, in that order (views when consecutive)."""
        return select_packed_items(inputs, indices)

    def graph_signature(self, inputs: QwenInputs) -> Hashable:
        """Patch dtype and device, and the call options that change the forward."""
        return inputs.pixel_patches.dtype, inputs.pixel_patches.device, inputs.options

    def capture_inputs(self, spec: CaptureSpec) -> dict[str, torch.Tensor]:
        """Buffers for ``token_budget * merge**2`` patches (named for the signature's
        options) and their metadata: one frame covering them, then empty frames; each
        offsets buffer has a slot per frame or window, at least :data:`MIN_OFFSET_SLOTS`."""
        self._check_path(spec.path)
        dtype, device, options = spec.signature
        rows = spec.token_budget * self._merge_area
        metadata = host_metadata(self.tower, self.kind, [(1, self.merge, rows // self.merge)])
        slots = {"cu_seqlens": spec.max_frames + 1}
        if self.kind == "qwen2_5_vl":
            windows = most_windows(spec.token_budget, spec.max_frames, self._window_side)
            slots["cu_window_seqlens"] = windows + 1
        for name, size in slots.items():
            offsets = metadata[name]
            padding = max(size, MIN_OFFSET_SLOTS) - len(offsets)
            metadata[name] = torch.cat([offsets, offsets[-1:].expand(padding)])
        patches = torch.zeros(rows, self._patch_dim, dtype=dtype)
        buffers = {_patches_name(options): patches, **metadata}
        return {name: buffer.to(device) for name, buffer in buffers.items()}

    def replay_inputs(self, path: str, inputs: QwenInputs) -> dict[str, torch.Tensor]:
        """The items' patches and, on the host, their metadata."""
        self._check_path(path)
        return {
            _patches_name(inputs.options): inputs.pixel_patches,
            **host_metadata(self.tower, self.kind, inputs.grid),
        }

    def graph_forward(self, path: str, buffers: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The tower's forward on the buffers, as ``(budget, width)`` layout rows."""
        self._check_path(path)
        name, patches = next((n, b) for n, b in buffers.items() if n.startswith(_PATCHES))
        options = self._options_by_name[name]
        rows = patches.shape[0]
        metadata = {
            "cu_seqlens": buffers["cu_seqlens"],
            "position_ids": buffers["position_ids"],
            # Every frame fits in all rows.
            "max_seqlen": rows,
        }
        if self.kind == "qwen2_5_vl":
            metadata.update(window_metadata(buffers, self._merge_area, self._window_side))
        if self.kind == "qwen3_vl":
            metadata["interp_indices"] = buffers["interp_indices"]
            metadata["interp_weights"] = buffers["interp_weights"]
        with packed_attention(self._attention_configs):
            output = self._forward(patches, None, options, metadata)
        return self._layout(options).to_rows(output, rows // self._merge_area)

    def collects_layer_outputs(self, path: str, buffers: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``buffers``' graph collects attentions in a list (compiled blocks recompile)."""
        name = next(name for name in buffers if name.startswith(_PATCHES))
        requested = dict(self._options_by_name[name]).get("output_attentions")  # None: the config's
        default = getattr(self.tower.config, "output_attentions", False)
        return bool(default if requested is None else requested)

    def eager_forward(self, path: str, inputs: QwenInputs) -> torch.Tensor:
        """The tower's own forward (its own attention) on exactly the items, as layout rows."""
        self._check_path(path)
        output = self._forward(inputs.pixel_patches, inputs.grid_thw, inputs.options, {})
        tokens = sum(t * h * w for t, h, w in inputs.grid) // self._merge_area
        return self._layout(inputs.options).to_rows(output, tokens)

    def postprocess(self, outputs: list[dict[str, torch.Tensor]], inputs: QwenInputs) -> Any:
        """The tower's output (``ModelOutput``, or its tuple) of all items in order."""
        rows = [output[LOCAL_PATH] for output in outputs if LOCAL_PATH in output]
        if rows:
            return self.postprocess_joined({LOCAL_PATH: join_rows(rows)}, inputs)
        width = self._layout(inputs.options).width
        dtype = next(self.tower.parameters()).dtype
        empty = torch.empty((0, width), dtype=dtype, device=inputs.pixel_patches.device)
        return self.postprocess_joined({LOCAL_PATH: empty}, inputs)

    def postprocess_joined(self, path_rows: Mapping[str, torch.Tensor], inputs: QwenInputs) -> Any:
        """The tower's output from the layout rows of every item in order."""
        output = self._layout(inputs.options).from_rows(path_rows[LOCAL_PATH])
        return output if inputs.return_dict else output.to_tuple()

    def _forward(
        self,
        patches: torch.Tensor,
        grid_thw: torch.Tensor | None,
        options: Options,
        metadata: Mapping[str, Any],
    ) -> Any:
        # The class's forward: the callback replaces the instance's.
        forward = type(self.tower).forward
        return forward(
            self.tower, patches, grid_thw=grid_thw, return_dict=True, **dict(options), **metadata
        )

    def _layout(self, options: Options) -> RowLayout:
        """The row layout of the output under ``options``, read once off a one-token item."""
        layout = self._layouts.get(options)
        if layout is None:
            parameter = next(self.tower.parameters())
            patches = torch.zeros(
                self._merge_area, self._patch_dim, dtype=parameter.dtype, device=parameter.device
            )
            grid_thw = torch.tensor([[1, self.merge, self.merge]], device=parameter.device)
            with torch.no_grad():
                output = self._forward(patches, grid_thw, options, {})
            layout = RowLayout.of(output, tokens=1, merge_area=self._merge_area)
            self._layouts[options] = layout
        return layout

    def _check_path(self, path: str) -> None:
        if path != LOCAL_PATH:
            raise ValueError(f"unknown encoder path {path!r}; allowed: {LOCAL_PATH}")


def _check_options(options: dict[str, Any]) -> Options:
    for name, value in options.items():
        if name in METADATA_ARGUMENTS:
            raise ValueError(
                f"{name} is computed from grid_thw under the CUDA graph callback; call the "
                "tower as visual(hidden_states, grid_thw=...) without it"
            )
        if value is not None and not isinstance(value, bool | int | float | str):
            raise ValueError(
                f"option {name}={value!r} is not a plain value (None, bool, int, float, str), "
                "so no graph can be keyed by it; call the tower without it or without the callback"
            )
    return tuple(sorted(options.items()))


def _patches_name(options: Options) -> str:
    """The patches buffer's name under ``options``: names survive every way buffers reach
    :meth:`QwenVisionAdapter.graph_forward`, so it tells which options a graph serves."""
    return _PATCHES + "".join(f"|{name}={value!r}" for name, value in options)
