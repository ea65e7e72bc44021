"""A packed tower's ``ModelOutput`` as one ``(tokens, width)`` tensor, and back.

The manager splits and joins one tensor's rows per item. A Qwen tower's output holds
merged tokens (one row per output token) and patch-level states (``merge**2`` rows per
token); :class:`RowLayout` lays them side by side, a token's patch rows in one row.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

CONTAINERS = ("tensor", "tuple", "list")


@dataclass(frozen=True)
class RowField:
    """One field of the output: a ``tensor``, or a ``tuple`` or ``list`` of ``count``
    tensors, each with ``rows_per_token`` rows (1 or ``merge**2``) of ``width`` columns."""

    name: str
    container: str
    count: int
    rows_per_token: int
    width: int

    @property
    def row_width(self) -> int:
        """Columns this field takes in a token's row."""
        return self.count * self.rows_per_token * self.width


@dataclass(frozen=True)
class RowLayout:
    """Where each set field of a tower's output lies in a token's row, in the output's order."""

    output_type: type
    fields: tuple[RowField, ...]

    @property
    def width(self) -> int:
        """Columns of one token's row."""
        return sum(field.row_width for field in self.fields)

    @classmethod
    def of(cls, output: Mapping[str, Any], tokens: int, merge_area: int) -> RowLayout:
        """The layout of ``output`` for ``tokens`` tokens; ValueError for a field it can't split."""
        fields = []
        for name, value in output.items():
            container = "tensor" if isinstance(value, torch.Tensor) else type(value).__name__
            tensors = [value] if container == "tensor" else value
            if container not in CONTAINERS or not tensors:
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
        start = 0
        for field in self.fields:
            tensors = []
            for _ in range(field.count):
                stop = start + field.rows_per_token * field.width
                block = rows[:, start:stop].reshape(tokens * field.rows_per_token, field.width)
                tensors.append(block.contiguous())
                start = stop
            if field.container == "tensor":
                output[field.name] = tensors[0]
            else:
                output[field.name] = tuple(tensors) if field.container == "tuple" else tensors
        return output


def _unsplittable(name: str, what: str) -> str:
    return (
        f"the tower's output field {name!r} holds {what}, not 2-D tensors with a row per "
        "output token or per patch, so it cannot be split per item; call the tower "
        "without the option that asks for it, or without the callback"
    )
