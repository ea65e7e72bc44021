"""Tower outputs as one row tensor, and back: the manager splits and joins its rows per item.

:class:`TokenLayout`: a Qwen tower's merged tokens and patch-level states (``merge**2`` rows
per token) side by side. :class:`TreeLayout`: every tensor of a batch-first tower's pytree
output (transformers registers every ``ModelOutput``; None fields stay None), per batch row.

A row tensor has one dtype, its carrier (:func:`carrier_dtype`), and every field comes back
bit-identical in dtype and value. Float fields (float16, bfloat16, float32, float64) travel
as values in their promoted dtype, a widening that is exact; the replay-vs-eager check
measures them at that dtype's tolerance, as for a tower of float fields only. Any other
field beside them (integer codes, ids, boolean masks) travels as its bytes, one per element
of the carrier: the float whose bits are the byte plus :data:`_BYTE_BASE`, a positive normal
number below 2**-12 (float16) or 2**-123 (wider). Copies keep its bits, flush-to-zero never
touches it, and it weighs nothing in the check's norm, so a relative error still judges the
float fields alone; a value cast to a float would round (int64 codes in float32 beyond
2**24, indices in bfloat16 beyond 256), and raw bit patterns read as floats would be NaN
and disable the check. Without float fields the carrier is the fields' one dtype, compared
by value, or bytes (uint8) for fields of several dtypes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import (
    TreeSpec,
    keystr,
    tree_flatten,
    tree_flatten_with_path,
    tree_leaves,
    tree_unflatten,
)

#: Each container a field may be, and how to build it from the field's tensors.
_CONTAINERS = {"tensor": lambda tensors: tensors[0], "tuple": tuple, "list": list}
#: Float dtypes whose promoted dtype holds every value of each exactly.
_FLOAT_CARRIERS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Bits of twice each carrier's smallest normal number: plus a byte, a positive normal float.
_BYTE_BASE = {
    torch.float16: 1 << 11,
    torch.bfloat16: 1 << 8,
    torch.float32: 1 << 24,
    torch.float64: 1 << 53,
    torch.uint8: 0,
}
#: The integer dtype of each size, whose values a carrier's bits are read as.
_BITS_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class RowField:
    """One field of the output: a ``tensor``, or a ``tuple`` or ``list`` of ``count``
    tensors, each with ``rows_per_token`` rows (1 or ``merge**2``) of ``width`` columns."""

    name: str
    container: str
    count: int
    rows_per_token: int
    width: int


@dataclass(frozen=True)
class TokenLayout:
    """Where each set field of a tower's output lies in a token's row, in the output's order."""

    output_type: type
    fields: tuple[RowField, ...]

    @property
    def width(self) -> int:
        """Columns of one token's row."""
        return sum(field.count * field.rows_per_token * field.width for field in self.fields)

    @classmethod
    def of(cls, output: Mapping[str, Any], tokens: int, merge_area: int) -> TokenLayout:
        """The layout of ``output`` for ``tokens`` tokens; ValueError for a field it can't split."""
        fields = []
        for name, value in output.items():
            container = "tensor" if isinstance(value, torch.Tensor) else type(value).__name__
            tensors = [value] if container == "tensor" else value
            if container not in _CONTAINERS or not tensors:
                raise ValueError(_unsplittable(name, f"a {container}"))
            rows = {tensor.shape[0] for tensor in tensors if tensor.dim() == 2}
            widths = {tensor.shape[1] for tensor in tensors if tensor.dim() == 2}
            if len(rows) != 1 or len(widths) != 1 or rows.isdisjoint({tokens, tokens * merge_area}):
                shapes = [tuple(tensor.shape) for tensor in tensors]
                raise ValueError(_unsplittable(name, f"tensors of shapes {shapes}"))
            rows_per_token = rows.pop() // tokens
            fields.append(RowField(name, container, len(tensors), rows_per_token, widths.pop()))
        return cls(type(output), tuple(fields))

    def to_rows(self, output: Mapping[str, Any], tokens: int) -> torch.Tensor:
        """``(tokens, width)``: every field of ``output`` flattened to a row per token."""
        columns = []
        for field in self.fields:
            value = output[field.name]
            tensors = [value] if field.container == "tensor" else value
            columns += [tensor.reshape(tokens, -1) for tensor in tensors]
        return torch.cat(columns, dim=1)

    def from_rows(self, rows: torch.Tensor) -> Any:
        """The tower's output rebuilt from ``(tokens, width)`` rows, each tensor contiguous."""
        tokens = rows.shape[0]
        # Set field by field, so the fields keep the tower's order (and to_tuple()'s).
        output = self.output_type()
        sizes = [f.rows_per_token * f.width for f in self.fields for _ in range(f.count)]
        blocks = iter(rows.split(sizes, dim=1))
        for field in self.fields:
            shape = (tokens * field.rows_per_token, field.width)
            tensors = [next(blocks).reshape(shape).contiguous() for _ in range(field.count)]
            output[field.name] = _CONTAINERS[field.container](tensors)
        return output


def _unsplittable(name: str, what: str) -> str:
    return (
        f"the tower's output field {name!r} holds {what}, not 2-D tensors with a row per "
        "output token or per patch, so it cannot be split per item; call the tower "
        "without the option that asks for it, or without the callback"
    )


def carrier_dtype(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """The dtype of the rows that carry fields of ``dtypes`` exactly: the float fields'
    promoted dtype; without float fields, the fields' one dtype, or uint8 for several."""
    floats = [dtype for dtype in dtypes if dtype in _FLOAT_CARRIERS]
    if floats:
        return functools.reduce(torch.promote_types, floats)
    return dtypes[0] if len(set(dtypes)) == 1 else torch.uint8


def _as_bytes(dtype: torch.dtype, carrier: torch.dtype) -> bool:
    """Whether a field of ``dtype`` travels in ``carrier`` rows as its bytes, not its values."""
    return dtype != carrier and dtype not in _FLOAT_CARRIERS


def _columns(tensor: torch.Tensor, batch_size: int, carrier: torch.dtype) -> torch.Tensor:
    """``tensor`` as ``[batch_size, W]`` columns of ``carrier``: its values, or its bytes."""
    flat = tensor.reshape(batch_size, -1)
    if not _as_bytes(tensor.dtype, carrier):
        return flat.to(carrier)
    bits = flat.contiguous().view(torch.uint8).to(_BITS_OF_SIZE[carrier.itemsize])
    return (bits + _BYTE_BASE[carrier]).view(carrier)


@dataclass(frozen=True)
class FieldLayout:
    """One tensor of a structured output: its shape after the batch dimension and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def width(self, carrier: torch.dtype) -> int:
        """Columns of ``carrier`` that one item's tensor takes: an element or byte each."""
        size = self.dtype.itemsize if _as_bytes(self.dtype, carrier) else 1
        return math.prod(self.shape) * size

    def from_columns(self, columns: torch.Tensor, carrier: torch.dtype) -> torch.Tensor:
        """The tensor of the items whose ``carrier`` columns are ``columns``, contiguous."""
        if _as_bytes(self.dtype, carrier):
            bits = columns.view(_BITS_OF_SIZE[carrier.itemsize]) - _BYTE_BASE[carrier]
            columns = bits.to(torch.uint8).contiguous().view(self.dtype)
        return columns.reshape(len(columns), *self.shape).to(self.dtype).contiguous()


@dataclass(frozen=True)
class TreeLayout:
    """Where each field of a structured output lies in a row tensor; None leaves take no columns."""

    treespec: TreeSpec
    fields: tuple[FieldLayout | None, ...]

    @functools.cached_property
    def carrier(self) -> torch.dtype:
        """The dtype of the rows (:func:`carrier_dtype` of the fields')."""
        return carrier_dtype([field.dtype for field in self.fields if field is not None])

    @classmethod
    def of(cls, output: Any, batch_size: int) -> TreeLayout:
        """The layout of ``output``, tensors of ``batch_size`` rows; TypeError naming a field that
        is neither None nor a batch-first tensor, or when there is no tensor."""
        try:
            with_paths, treespec = tree_flatten_with_path(output)
            names = [keystr(path) or "the output" for path, _ in with_paths]
            leaves = [leaf for _, leaf in with_paths]
        except ValueError:  # A node type without keys: fields named by position.
            leaves, treespec = tree_flatten(output)
            names = [f"field {index} of the output" for index in range(len(leaves))]
        if not any(isinstance(leaf, torch.Tensor) for leaf in leaves):
            raise TypeError(f"the output {type(output).__name__} holds no tensors")
        fields = []
        for field, leaf in zip(names, leaves, strict=True):
            if leaf is None:
                fields.append(None)
                continue
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(
                    f"{field} is a {type(leaf).__name__}; only tensors with the items as "
                    "rows of dim 0 can be split per item"
                )
            if leaf.dim() == 0 or leaf.shape[0] != batch_size:
                raise TypeError(
                    f"{field} has shape {list(leaf.shape)} for a batch of {batch_size} items; "
                    "only outputs with the items as rows of dim 0 can be split per item"
                )
            fields.append(FieldLayout(tuple(leaf.shape[1:]), leaf.dtype))
        return cls(treespec, tuple(fields))

    def unflatten(self, rows: torch.Tensor) -> Any:
        """The output of the items whose rows are ``rows [N, W]``, fields contiguous."""
        carrier = self.carrier
        tensors = [field for field in self.fields if field is not None]
        columns = iter(rows.split([field.width(carrier) for field in tensors], dim=1))
        leaves = [
            None if field is None else field.from_columns(next(columns), carrier)
            for field in self.fields
        ]
        return tree_unflatten(leaves, self.treespec)


def output_rows(output: Any, batch_size: int) -> torch.Tensor:
    """Every tensor of ``output`` flattened per item into ``[batch_size, W]`` of its
    :func:`carrier_dtype`, from which :meth:`TreeLayout.unflatten` rebuilds it exactly; no
    host syncs."""
    leaves = [leaf for leaf in tree_leaves(output) if leaf is not None]
    carrier = carrier_dtype([leaf.dtype for leaf in leaves])
    flat = [_columns(leaf, batch_size, carrier) for leaf in leaves]
    return flat[0] if len(flat) == 1 else torch.cat(flat, dim=1)
