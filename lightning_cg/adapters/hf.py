"""GraphableEncoder for transformers-style towers: ``tower(pixel_values=x, **options)``.

Each batch row is one item on the path ``image``. Hashable options (and the config's
defaults) key the graphs; per-item tensors are split like the pixels, other tensors copied
whole; the output is carried as rows (:class:`~lightning_cg.adapters.row_outputs.TreeLayout`).
transformers is an optional dependency: imported only when needed, never to recognise a tower.

The engine moves one row tensor per path, graphed or eager, and checks a replay's rows
against eager rows by relative error. Every field comes back bit-identical in dtype and
value: float fields travel as values in their promoted float dtype (an exact widening),
which sets the check's tolerance; integer, boolean and other fields beside them (a VQ
tokenizer's codes, ids, masks) travel byte by byte as tiny positive normal floats, which
copies keep exactly and which weigh nothing in the check, so it still judges the float
fields. Casting them to the float dtype instead would round codes (above 2**24 in float32,
above 256 in bfloat16); reading their raw bits as floats would give NaNs that void the check.
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_cg.adapters import join_rows, select_rows
from lightning_cg.adapters.batched import IMAGE_PATH, BatchedEncoderAdapter, dummy_rows
from lightning_cg.adapters.row_outputs import TreeLayout, output_rows
from lightning_cg.engine.encoder import CaptureSpec, ItemSpec
from lightning_cg.engine.replay import autocast_key

#: Where to get the optional dependency.
INSTALL_HINT = "pip install 'lightning-cg[hf]'"
#: Tensor arguments that hold one row per item: padded and split with the pixels.
PER_ITEM_INPUTS = ("bool_masked_pos", "attention_mask", "pixel_attention_mask", "pixel_mask")
#: Tensor arguments that apply to the whole batch: copied whole into every replay.
SHARED_INPUTS = ("head_mask",)
#: Config fields transformers reads when the call leaves them out; part of the signature.
CONFIG_FLAGS = ("return_dict", "output_hidden_states", "output_attentions", "_attn_implementation")
#: Separates an argument's name from its call's index in a static buffer's name.
_CALL_MARK = "@"


def require_transformers(what: str) -> Any:
    """The transformers module, or an ImportError that says how to install it."""
    try:
        import transformers
    except ImportError as error:
        raise ImportError(
            f"{what} needs the optional dependency transformers, which is not installed: "
            f"{INSTALL_HINT}"
        ) from error
    return transformers


@dataclass(frozen=True)
class TensorSpec:
    """Shape (per item for batched tensors), dtype and device of a tensor argument."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, tensor: torch.Tensor, per_item: bool) -> TensorSpec:
        """The spec of ``tensor``, or of one item's row of it when ``per_item``."""
        return cls(
            tuple(tensor.shape[1:] if per_item else tensor.shape), tensor.dtype, tensor.device
        )


@dataclass(frozen=True)
class HFCallSignature:
    """What one set of graphs is captured for: tensor specs, other arguments, config flags."""

    pixels: TensorSpec
    per_item: tuple[tuple[str, TensorSpec], ...]
    shared: tuple[tuple[str, TensorSpec], ...]
    options: tuple[tuple[str, Hashable], ...]
    config: tuple[tuple[str, Hashable], ...]


@dataclass(frozen=True)
class HFInputs:
    """One call of the tower: pixels, per-item and shared tensors, and its signature."""

    pixels: torch.Tensor
    per_item: Mapping[str, torch.Tensor]
    shared: Mapping[str, torch.Tensor]
    signature: HFCallSignature


class HFEncoderAdapter(BatchedEncoderAdapter):
    """Graph a batch-first tower called with options that returns structured outputs.

    Args:
        tower: called as ``tower(pixel_values [B, ...], **options)`` (or the forward's
            first parameter), returning a tensor or a structure of tensors of ``B`` rows.
        per_item_inputs: names of tensor arguments with a row per item.
        shared_inputs: names of tensor arguments for the whole batch. A tensor named in
            neither is per item when its first dimension is the batch size.

    Raises ImportError without transformers, TypeError for a forward with no pixel argument.
    """

    def __init__(
        self,
        tower: nn.Module,
        max_batch_size: int = 64,
        per_item_inputs: Sequence[str] = PER_ITEM_INPUTS,
        shared_inputs: Sequence[str] = SHARED_INPUTS,
    ) -> None:
        require_transformers("adapter='hf'")
        super().__init__(tower, max_batch_size)
        self._call = inspect.signature(self._forward)
        parameters = self._call.parameters
        if "pixel_values" in parameters:
            self._input_name = "pixel_values"
        elif self._input_name is None or parameters[self._input_name].kind in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        ):
            raise TypeError(
                f"HFEncoderAdapter serves towers called as tower(pixel_values, **options); "
                f"the forward of {type(tower).__name__} takes {self._call}, with no parameter "
                "for the pixel batch. Implement lightning_cg.engine.encoder.GraphableEncoder "
                "for it."
            )
        self.per_item_inputs = tuple(per_item_inputs)
        self.shared_inputs = tuple(shared_inputs)
        #: Call signatures' indices, in order of first use; a buffer name carries the index.
        self._signature_index: dict[HFCallSignature, int] = {}
        self._layouts: dict[tuple[HFCallSignature, tuple], TreeLayout] = {}

    def inputs_from_call(self, args: tuple, kwargs: dict) -> HFInputs:
        """Sort a call's arguments into pixels, per-item and shared tensors, and options."""
        arguments = self._bind(args, kwargs)
        pixels = arguments.pop(self._input_name, None)
        if not isinstance(pixels, torch.Tensor) or pixels.dim() < 1:
            got = f"{self._input_name} is {type(pixels).__name__}, not a batch tensor"
            raise ValueError(self._convention_message(got))
        per_item: dict[str, torch.Tensor] = {}
        shared: dict[str, torch.Tensor] = {}
        options: dict[str, Hashable] = {}
        for name, value in arguments.items():
            if isinstance(value, torch.Tensor):
                rows_match = value.dim() > 0 and value.shape[0] == len(pixels)
                batched = rows_match and name not in self.shared_inputs
                if name in self.per_item_inputs and name not in self.shared_inputs and not batched:
                    raise ValueError(
                        f"{name} has shape {list(value.shape)}; as a per-item input it needs "
                        f"{len(pixels)} rows, one per row of {self._input_name}"
                    )
                (per_item if batched else shared)[name] = value
            else:
                try:
                    hash(value)
                except TypeError:
                    raise ValueError(
                        f"argument {name}={value!r} is neither a tensor nor hashable; graphs are "
                        "captured per value of every non-tensor argument, so it must be hashable "
                        "(a bool, a number, a string, None, a tuple)"
                    ) from None
                options[name] = value
        config = getattr(self.tower, "config", None)
        signature = HFCallSignature(
            pixels=TensorSpec.of(pixels, per_item=True),
            per_item=tuple((name, TensorSpec.of(v, per_item=True)) for name, v in per_item.items()),
            shared=tuple((name, TensorSpec.of(v, per_item=False)) for name, v in shared.items()),
            options=tuple(options.items()),
            config=tuple((flag, getattr(config, flag, None)) for flag in CONFIG_FLAGS),
        )
        self._signature_index.setdefault(signature, len(self._signature_index))
        return HFInputs(pixels, per_item, shared, signature)

    def item_specs(self, inputs: HFInputs) -> list[ItemSpec]:
        """One single-token item per row of the pixel batch."""
        return super().item_specs(inputs.pixels)

    def select_items(self, inputs: HFInputs, indices: Sequence[int]) -> HFInputs:
        """The pixel rows and per-item rows at ``indices``; shared tensors whole."""
        return HFInputs(
            select_rows(inputs.pixels, indices),
            {name: select_rows(value, indices) for name, value in inputs.per_item.items()},
            inputs.shared,
            inputs.signature,
        )

    def graph_signature(self, inputs: HFInputs) -> Hashable:
        """Per-item shapes, dtypes and devices of the tensors, and the options."""
        return inputs.signature

    def capture_inputs(self, spec: CaptureSpec) -> dict[str, torch.Tensor]:
        """Random pixels, zero per-item tensors of ``spec.token_budget`` rows, ones shared."""
        self._check_path(spec.path)
        signature: HFCallSignature = spec.signature
        batched = [(self._input_name, signature.pixels), *signature.per_item]
        buffers = {
            name: dummy_rows(spec.token_budget, item.shape, item.dtype, item.device)
            for name, item in batched
        }
        for name, whole in signature.shared:
            buffers[name] = torch.ones((1, *whole.shape), dtype=whole.dtype, device=whole.device)
        return self._named_for(signature, buffers)

    def replay_inputs(self, path: str, inputs: HFInputs) -> dict[str, torch.Tensor]:
        """The pixel and per-item rows, and each shared tensor as one row."""
        self._check_path(path)
        return self._named_for(inputs.signature, self._tensors(inputs, shared_as_row=True))

    def graph_forward(self, path: str, buffers: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The original forward on the static buffers, its output flattened to rows."""
        self._check_path(path)
        signature, tensors = self._unnamed(buffers)
        batch_size = tensors[self._input_name].shape[0]
        for name, _ in signature.shared:
            tensors[name] = tensors[name][0]
        output = self._forward(**tensors, **dict(signature.options))
        if not torch.compiler.is_compiling():
            self._remember_layout(signature, output, batch_size)
        return output_rows(output, batch_size)

    def eager_forward(self, path: str, inputs: HFInputs) -> torch.Tensor:
        """The original forward on exactly ``inputs``, its output flattened to rows."""
        self._check_path(path)
        output = self._run_call(inputs)
        self._remember_layout(inputs.signature, output, len(inputs.pixels))
        return output_rows(output, len(inputs.pixels))

    def postprocess(self, outputs: list[dict[str, torch.Tensor]], inputs: HFInputs) -> Any:
        """The tower's own output type joined from the items' rows (an empty batch runs it)."""
        if not outputs:
            return self._run_call(inputs)
        return self._layout(inputs).unflatten(join_rows([item[IMAGE_PATH] for item in outputs]))

    def postprocess_joined(self, path_rows: Mapping[str, torch.Tensor], inputs: HFInputs) -> Any:
        """The tower's own output type and fields from the rows of every item in order."""
        return self._layout(inputs).unflatten(path_rows[IMAGE_PATH])

    def _bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The call's arguments by name, ``**kwargs`` spread out; defaults left to the forward."""
        try:
            bound = self._call.bind(*args, **kwargs)
        except TypeError as error:
            raise ValueError(self._convention_message(f"the call does not bind: {error}")) from None
        arguments: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            kind = self._call.parameters[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL and value:
                extra = f"{len(value)} extra positional arguments for *{name}"
                raise ValueError(self._convention_message(extra))
            if kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(value)
            elif kind is not inspect.Parameter.VAR_POSITIONAL:
                arguments[name] = value
        return arguments

    def _tensors(self, inputs: HFInputs, shared_as_row: bool = False) -> dict[str, torch.Tensor]:
        # A static buffer is indexed by rows: a shared tensor is one row of it.
        shared = {name: v.unsqueeze(0) if shared_as_row else v for name, v in inputs.shared.items()}
        return {self._input_name: inputs.pixels, **inputs.per_item, **shared}

    def _run_call(self, inputs: HFInputs) -> Any:
        return self._forward(**self._tensors(inputs), **dict(inputs.signature.options))

    def _named_for(
        self, signature: HFCallSignature, tensors: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        # graph_forward gets only the buffers, so their names carry the call's index.
        index = self._signature_index.setdefault(signature, len(self._signature_index))
        return {f"{name}{_CALL_MARK}{index}": tensor for name, tensor in tensors.items()}

    def _unnamed(
        self, buffers: Mapping[str, torch.Tensor]
    ) -> tuple[HFCallSignature, dict[str, torch.Tensor]]:
        split = {name.rpartition(_CALL_MARK): tensor for name, tensor in buffers.items()}
        (index,) = {int(index) for _, _, index in split}
        return list(self._signature_index)[index], {name: t for (name, _, _), t in split.items()}

    def _remember_layout(self, signature: HFCallSignature, output: Any, batch_size: int) -> None:
        key = (signature, autocast_key())
        if key not in self._layouts:
            self._layouts[key] = TreeLayout.of(output, batch_size)

    def _layout(self, inputs: HFInputs) -> TreeLayout:
        """This call's output layout (an item runs eagerly once if a compiled forward kept none)."""
        key = (inputs.signature, autocast_key())
        if key not in self._layouts:
            with torch.no_grad():
                self.eager_forward(IMAGE_PATH, self.select_items(inputs, [0]))
        return self._layouts[key]

    def _convention_message(self, got: str) -> str:
        return (
            f"HFEncoderAdapter serves towers called as tower({self._input_name}=x [B, ...], "
            f"**options) that return tensors of B rows; {got}. Implement "
            "lightning_cg.engine.encoder.GraphableEncoder for "
            f"{type(self.tower).__name__} to graph other calling conventions."
        )
