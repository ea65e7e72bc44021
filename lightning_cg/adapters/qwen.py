"""GraphableEncoder for the Qwen vision towers of transformers, called as their models call them.

``visual(hidden_states, grid_thw, **options)`` of Qwen2-VL, Qwen2.5-VL and Qwen3-VL(-MoE), on
one path, ``local``, its ``grid_thw`` metadata precomputed on the host by the helpers the towers
call themselves (``transformers.vision_utils``). The towers pass ``cu_seqlens`` to attention only
for an implementation named "flash" (others split sequences on the host, a sync no graph can
hold), so attention runs through :data:`ATTENTION_NAME`, registered with ``AttentionInterface``.
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_cg.adapters import join_rows
from lightning_cg.adapters.packed import LOCAL_PATH, PackedInputs, PackedLadders
from lightning_cg.adapters.packed_call import Grid
from lightning_cg.adapters.row_outputs import TokenLayout
from lightning_cg.engine.attention import sequence_attention, varlen_supported
from lightning_cg.engine.encoder import CaptureSpec, EncoderGraphConfig

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

_CALL = inspect.signature(lambda hidden_states, grid_thw, **options: None)
_PATCHES = "hidden_states"
#: The attention implementation's name; "flash" in it selects the towers' cu_seqlens path.
ATTENTION_NAME = "lightning_cg_flash_varlen"


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


class QwenVisionAdapter(PackedLadders):
    """Graph a Qwen vision tower (of :data:`QWEN_TOWERS`) on one ladder; budgets as ``packed``'s."""

    paths = (LOCAL_PATH,)

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
        super().__init__(tower, max_frames_per_item, min_token_budget, max_token_budget)
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION_NAME, packed_attention_forward)
        self.kind = kind
        config = tower.config
        self.merge = config.spatial_merge_size
        self._merge_area = self.merge**2
        self._patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
        # The distinct configs the tower's modules read their attention implementation from.
        configs = (getattr(module, "config", None) for module in tower.modules())
        self._attention_configs = list(
            {id(c): c for c in configs if hasattr(c, "_attn_implementation")}.values()
        )
        self._layouts: dict[Options, TokenLayout] = {}
        self._options_by_name: dict[str, Options] = {}
        #: Merged tokens along one side of a Qwen2.5-VL attention window.
        self._window_side = 0
        if kind == "qwen2_5_vl":
            self._window_side = tower.window_size // self.merge // tower.patch_size
            if self._window_side < 1:
                raise ValueError(
                    f"window_size ({tower.window_size}) must be >= patch_size * "
                    f"spatial_merge_size ({tower.patch_size * self.merge})"
                )

    def graph_config(self) -> EncoderGraphConfig:
        """One path, ``local``, with graphs per item count (``cu_seqlens`` has a slot per frame)."""
        return self._graph_config(("cu_seqlens", "cu_window_seqlens"))

    def inputs_from_call(self, args: tuple, kwargs: dict) -> QwenInputs:
        """Check a ``visual(hidden_states, grid_thw, **options)`` call; read its grid."""
        bound = _CALL.bind(*args, **kwargs).arguments
        patches, grid_thw = bound["hidden_states"], bound["grid_thw"]
        options = dict(bound.get("options", {}))
        return_dict = options.pop("return_dict", getattr(self.tower.config, "return_dict", True))
        grid = self._read_call(patches, grid_thw, self.merge, _PATCHES)
        for name, value in options.items():
            if name in METADATA_ARGUMENTS:
                raise ValueError(
                    f"{name} is computed from grid_thw under the CUDA graph callback; call the "
                    "tower as visual(hidden_states, grid_thw=...) without it"
                )
            if value is not None and not isinstance(value, bool | int | float | str):
                raise ValueError(
                    f"option {name}={value!r} is not a plain value (None, bool, int, float, "
                    "str), so no graph can be keyed by it; call the tower without it or without "
                    "the callback"
                )
        checked = tuple(sorted(options.items()))
        self._options_by_name[_patches_name(checked)] = checked
        return QwenInputs(patches, grid_thw, grid, checked, bool(return_dict))

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
        metadata = _host_metadata(self.tower, self.kind, [(1, self.merge, rows // self.merge)])
        slots = {"cu_seqlens": spec.max_frames + 1}
        if self.kind == "qwen2_5_vl":
            # The most non-empty windows: a frame of h x w tokens has ceil(h/side) *
            # ceil(w/side), at most h*w / side + 1 (as h + w <= h*w + 1), each with a token.
            budget = spec.token_budget
            windows = min(budget, -(-budget // self._window_side) + spec.max_frames)
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
            **_host_metadata(self.tower, self.kind, inputs.grid),
        }

    def graph_forward(self, path: str, buffers: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The tower's forward on the buffers, as ``(budget, width)`` layout rows."""
        self._check_path(path)
        name, patches = next((n, b) for n, b in buffers.items() if n.startswith(_PATCHES))
        options = self._options_by_name[name]
        rows = patches.shape[0]
        metadata = {name: buffers[name] for name in ("cu_seqlens", "position_ids")}
        metadata["max_seqlen"] = rows  # Every frame fits in all rows.
        if self.kind == "qwen2_5_vl":
            # The tower undoes the window order with argsort(window_index); zeros in the
            # padding would tie with real tokens, so padding tokens map to themselves.
            window_index = buffers["window_index"]
            positions = torch.arange(window_index.shape[0], device=window_index.device)
            real_tokens = buffers["cu_seqlens"][-1] // self._merge_area
            metadata["window_index"] = torch.where(positions < real_tokens, window_index, positions)
            metadata["cu_window_seqlens"] = buffers["cu_window_seqlens"]
            metadata["max_window_seqlen"] = self._window_side**2 * self._merge_area
        if self.kind == "qwen3_vl":
            metadata.update({name: buffers[name] for name in ("interp_indices", "interp_weights")})
        with _packed_attention(self._attention_configs):
            output = self._forward(patches, None, options, metadata)
        return self._rows_of(output, options, rows // self._merge_area)

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
        return self._rows_of(output, inputs.options, tokens)

    def postprocess(self, outputs: list[dict[str, torch.Tensor]], inputs: QwenInputs) -> Any:
        """The tower's output (``ModelOutput``, or its tuple) of all items in order."""
        rows = [output[LOCAL_PATH] for output in outputs if LOCAL_PATH in output]
        joined = (
            join_rows(rows) if rows else self._no_rows(self._layout(inputs.options).width, inputs)
        )
        return self.postprocess_joined({LOCAL_PATH: joined}, inputs)

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

    def _rows_of(self, output: Any, options: Options, tokens: int) -> torch.Tensor:
        """``output`` (of ``tokens`` merged tokens) as layout rows; the first output under
        ``options`` teaches their layout (ValueError for a field it can't split)."""
        if options not in self._layouts:
            self._layouts[options] = TokenLayout.of(output, tokens, merge_area=self._merge_area)
        return self._layouts[options].to_rows(output, tokens)

    def _layout(self, options: Options) -> TokenLayout:
        """The row layout of the output under ``options``: as a forward taught it, else read
        off a one-token item (a call of no items before any forward)."""
        if options not in self._layouts:
            parameter = next(self.tower.parameters())
            patches = torch.zeros(
                self._merge_area, self._patch_dim, dtype=parameter.dtype, device=parameter.device
            )
            grid_thw = torch.tensor([[1, self.merge, self.merge]], device=parameter.device)
            with torch.no_grad():
                output = self._forward(patches, grid_thw, options, {})
            self._layouts[options] = TokenLayout.of(output, tokens=1, merge_area=self._merge_area)
        return self._layouts[options]


def _patches_name(options: Options) -> str:
    """The patches buffer's name under ``options``: names survive every way buffers reach
    :meth:`QwenVisionAdapter.graph_forward`, so it tells which options a graph serves."""
    return _PATCHES + "".join(f"|{name}={value!r}" for name, value in options)


def _host_metadata(tower: nn.Module, kind: str, grid: Grid) -> dict[str, torch.Tensor]:
    """The keyword metadata ``tower`` (of ``kind``) computes from ``grid``: ``cu_seqlens``,
    ``position_ids``, and Qwen2.5-VL's window or Qwen3-VL's interpolation tensors."""
    from transformers import vision_utils

    grid_thw = torch.tensor(grid, dtype=torch.long).reshape(-1, 3)
    merge = tower.config.spatial_merge_size
    metadata = {
        "cu_seqlens": vision_utils.get_vision_cu_seqlens(grid_thw),
        "position_ids": vision_utils.get_vision_position_ids(grid_thw, merge),
    }
    if kind == "qwen2_5_vl":
        metadata["window_index"], metadata["cu_window_seqlens"] = (
            vision_utils.get_vision_window_index(
                grid_thw, merge, tower.window_size, tower.patch_size
            )
        )
    if kind == "qwen3_vl":
        interpolation = vision_utils.get_vision_interpolation_indices_and_weights(
            grid_thw,
            num_grid_per_side=tower.num_grid_per_side,
            mode=tower.interpolation_mode,
            align_corners=tower.interpolation_align_corners,
            spatial_merge_size=merge,
        )
        metadata["interp_indices"], metadata["interp_weights"] = interpolation
    return metadata


def packed_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Attention within each sequence of ``cu_seq_lens_q`` (keys share them), for transformers:
    ``(1, heads, rows, head_dim)`` inputs, ``(1, rows, heads, head_dim)`` and no weights out."""
    if cu_seq_lens_q is None or max_length_q is None:
        raise ValueError(
            f"attention implementation {ATTENTION_NAME!r} needs cu_seq_lens_q and max_length_q "
            f"from the tower; {type(module).__name__} passed none: it does not pack sequences"
        )
    q, k, v = (tensor[0].transpose(0, 1) for tensor in (query, key, value))  # (T, H, hd)
    head_dim = q.shape[-1]
    scale = None if scaling is None or scaling == head_dim**-0.5 else scaling
    use_varlen = varlen_supported(q.dtype, q.device, head_dim)
    attend = sequence_attention(cu_seq_lens_q, q.shape[0], max_length_q, use_varlen, scale)
    return attend(q, k, v).unsqueeze(0), None


@contextmanager
def _packed_attention(configs: list[object]) -> Iterator[None]:
    """Run attention through :data:`ATTENTION_NAME` inside the block, then restore ``configs``
    (set directly: ``set_attn_implementation`` would look the unknown name up on the Hub)."""
    previous = [(config, config._attn_implementation) for config in configs]
    try:
        for config, _ in previous:
            config._attn_implementation = ATTENTION_NAME
        yield
    finally:
        for config, implementation in previous:
            config._attn_implementation = implementation
