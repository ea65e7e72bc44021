"""A packed tower's structured output as one tensor with a row per output token, and back.

The manager splits and joins the rows of one tensor per item. A transformers
packed tower returns a ``ModelOutput`` instead: merged tokens
(``pooler_output``, ``deepstack_features``) with one row per output token, and
patch-level states (``last_hidden_state``, ``hidden_states``) with
``merge**2`` rows per token, each item's rows consecutive. :class:`RowLayout`
lays every such tensor side by side, a token's patch rows flattened into one
row, so a sub-batch's output is one ``(tokens, width)`` tensor, and rebuilds the
``ModelOutput`` from those rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

CONTAINERS = ("tensor", "tuple", "list")


@dataclass(frozen=True)
class RowField:
    """One field of the output.

    Attributes:
        name: the field's name in the output.
        container: ``tensor``, or a ``tuple`` or ``list`` of ``count`` tensors.
        count: tensors in the field (1 for a tensor).
        rows_per_token: rows of each tensor per output token (1, or ``merge**2``
            for patch-level states).
        width: columns of each tensor.
    """

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
    """Where each field of a tower's output lies in a token's row.

    Attributes:
        output_type: the ``ModelOutput`` class the tower returns.
        fields: the fields that are set, in the output's order.
    """

    output_type: type
    fields: tuple[RowField, ...]

    @property
    def width(self) -> int:
        """Columns of one token's row."""
        return sum(field.row_width for field in self.fields)

    @classmethod
    def of(cls, output: Mapping[str, Any], tokens: int, merge_area: int) -> RowLayout:
        """The layout of ``output``, a ``ModelOutput`` of items with ``tokens`` tokens.

        ``tokens`` must differ from ``tokens * merge_area`` (unless ``merge_area`` is
        1) for the fields' row counts to tell merged tokens from patches.

        Raises:
            ValueError: a field is not a 2-D tensor (or a tuple or list of them)
                with one row per token or per patch.
        """
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
        """The tower's output rebuilt from ``(tokens, width)`` rows; each tensor
        is contiguous, as the tower returns it."""
        tokens = rows.shape[0]
        # Set field by field, as the tower's output gets its recorded states: the
        # fields keep the tower's order (and with it the order of to_tuple()).
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
