"""Structured tower outputs as one row per item, and back.

The manager scatters and joins the rows of one tensor per path. A tower that
returns several tensors (a Hugging Face ``ModelOutput``, a tuple, a dict, nested
tuples of hidden states) is flattened into one ``[B, W]`` tensor whose row ``i``
holds every field of item ``i`` side by side; a :class:`RowLayout` remembers the
structure and each field's shape and dtype, and rebuilds the output from the
joined rows. Structures are pytrees (``torch.utils._pytree``), where
transformers registers every ``ModelOutput`` class: a rebuilt ``ModelOutput`` has
the same class and fields, and its None fields stay None.

Example:
    >>> output = {"tokens": torch.randn(3, 5, 4), "pooled": torch.randn(3, 4)}
    >>> layout = RowLayout.of(output, batch_size=3)
    >>> rows = output_rows(output, batch_size=3)
    >>> rows.shape
    torch.Size([3, 24])
    >>> torch.equal(layout.unflatten(rows)["tokens"], output["tokens"])
    True
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
    """Where each field of a structured output lies in a row tensor.

    Attributes:
        treespec: the output's structure (its class, field names, nesting).
        fields: per leaf of the structure, a :class:`FieldLayout`, or None for a
            None leaf (which takes no columns and comes back as None). Rows hold
            the fields in their promoted dtype (exact for mixed floating
            precisions and booleans).
    """

    treespec: TreeSpec
    fields: tuple[FieldLayout | None, ...]

    @classmethod
    def of(cls, output: Any, batch_size: int) -> RowLayout:
        """The layout of ``output``, a structure of tensors with ``batch_size`` rows each.

        Raises:
            TypeError: no field is a tensor, a field is neither a tensor nor None,
                or a tensor is not batch-first (its first dimension is not
                ``batch_size``); the message names the field.
        """
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
    """Every tensor of ``output`` flattened per item and joined into ``[batch_size, W]``.

    Traceable: no host syncs, only reshapes and one concatenation (none for a
    single tensor), so a graph forward may end with it.
    """
    leaves = [leaf for leaf in tree_leaves(output) if leaf is not None]
    dtype = functools.reduce(torch.promote_types, (leaf.dtype for leaf in leaves))
    flat = [leaf.reshape(batch_size, -1).to(dtype) for leaf in leaves]
    return flat[0] if len(flat) == 1 else torch.cat(flat, dim=1)


def _named_leaves(output: Any) -> tuple[list[tuple[str, Any]], TreeSpec]:
    """The leaves of ``output`` with their paths for messages (``.hidden_states[2]``),
    or their positions where the structure cannot say (older transformers releases register
    ModelOutput without key paths)."""
    try:
        leaves, treespec = tree_flatten_with_path(output)
    except ValueError:
        leaves, treespec = tree_flatten(output)
        return [
            (f"field {index} of the output", leaf) for index, leaf in enumerate(leaves)
        ], treespec
    return [(keystr(path) or "the output", leaf) for path, leaf in leaves], treespec
