"""Structured tower outputs (a ``ModelOutput``, tuple, dict, nested) as one row per item.

:func:`output_rows` flattens every tensor into one ``[B, W]`` tensor; a :class:`RowLayout`
rebuilds the output from joined rows. Structures are pytrees (``torch.utils._pytree``),
where transformers registers every ``ModelOutput``: None fields stay None.
"""

from __future__ import annotations

import functools
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


@dataclass(frozen=True)
class FieldLayout:
    """One tensor of a structured output: its shape after the batch dimension and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def width(self) -> int:
        """Columns the field takes in a row."""
        return functools.reduce(lambda a, b: a * b, self.shape, 1)


@dataclass(frozen=True)
class RowLayout:
    """Where each field of a structured output lies in a row tensor; None leaves take no columns."""

    treespec: TreeSpec
    fields: tuple[FieldLayout | None, ...]

    @classmethod
    def of(cls, output: Any, batch_size: int) -> RowLayout:
        """The layout of ``output``, tensors of ``batch_size`` rows; TypeError naming a field that
        is neither None nor a batch-first tensor, or when there is no tensor."""
        leaves, treespec = _named_leaves(output)
        if not any(isinstance(leaf, torch.Tensor) for _, leaf in leaves):
            raise TypeError(f"the output {type(output).__name__} holds no tensors")
        fields = []
        for field, leaf in leaves:
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
        count = rows.shape[0]
        tensors = [field for field in self.fields if field is not None]
        columns = iter(rows.split([field.width for field in tensors], dim=1))
        leaves = [
            None
            if field is None
            else next(columns).reshape(count, *field.shape).to(field.dtype).contiguous()
            for field in self.fields
        ]
        return tree_unflatten(leaves, self.treespec)


def output_rows(output: Any, batch_size: int) -> torch.Tensor:
    """Every tensor of ``output`` flattened per item into ``[batch_size, W]``, no host syncs."""
    leaves = [leaf for leaf in tree_leaves(output) if leaf is not None]
    dtype = functools.reduce(torch.promote_types, (leaf.dtype for leaf in leaves))
    flat = [leaf.reshape(batch_size, -1).to(dtype) for leaf in leaves]
    return flat[0] if len(flat) == 1 else torch.cat(flat, dim=1)


def _named_leaves(output: Any) -> tuple[list[tuple[str, Any]], TreeSpec]:
    """The leaves of ``output`` named by path for messages (by position where there are none)."""
    try:
        leaves, treespec = tree_flatten_with_path(output)
    except ValueError:
        leaves, treespec = tree_flatten(output)
        return [
            (f"field {index} of the output", leaf) for index, leaf in enumerate(leaves)
        ], treespec
    return [(keystr(path) or "the output", leaf) for path, leaf in leaves], treespec
