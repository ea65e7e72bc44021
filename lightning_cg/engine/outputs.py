"""The rows one call's sub-batches give, kept as blocks until the call's output is built.

Splitting per item costs host time per item, so blocks are split only when asked.
"""

from __future__ import annotations

import torch


class CallOutputs:
    """Per path, the blocks of rows of one call: ``(item indices, rows, tokens per item)``."""

    def __init__(self, num_items: int) -> None:
        self.num_items = num_items
        self._blocks: dict[str, list[tuple[list[int], torch.Tensor, list[int]]]] = {}

    def add(self, path: str, indices: list[int], rows: torch.Tensor, tokens: list[int]) -> None:
        """Record ``rows`` of ``path``: ``tokens[i]`` rows of item ``indices[i]``, in order."""
        if sum(tokens):
            self._blocks.setdefault(path, []).append((indices, rows, tokens))

    def per_item(self) -> list[dict[str, torch.Tensor]]:
        """Each item's ``{path: rows}``; paths where the item has no tokens are absent."""
        outputs: list[dict[str, torch.Tensor]] = [{} for _ in range(self.num_items)]
        for path, blocks in self._blocks.items():
            for indices, rows, tokens in blocks:
                for index, item_rows in self._item_rows(indices, rows, tokens):
                    outputs[index][path] = item_rows
        return outputs

    def joined(self) -> dict[str, torch.Tensor] | None:
        """Each path's rows of every item in order as one tensor (None for no items): the
        block as it came when one holds them in order, else one copy per path."""
        if self.num_items == 0:
            return None
        in_order = list(range(self.num_items))
        joined = {}
        for path, blocks in self._blocks.items():
            if len(blocks) == 1 and blocks[0][0] == in_order:
                joined[path] = blocks[0][1]
            else:
                joined[path] = torch.cat(self._rows_in_item_order(blocks))
        return joined

    def _rows_in_item_order(
        self, blocks: list[tuple[list[int], torch.Tensor, list[int]]]
    ) -> list[torch.Tensor]:
        rows_of_item = {
            index: item_rows
            for indices, rows, tokens in blocks
            for index, item_rows in self._item_rows(indices, rows, tokens)
        }
        return [rows_of_item[index] for index in sorted(rows_of_item)]

    @staticmethod
    def _item_rows(
        indices: list[int], rows: torch.Tensor, tokens: list[int]
    ) -> list[tuple[int, torch.Tensor]]:
        """``(item index, its rows)`` of one block, for items with rows."""
        split = rows.split(tokens)
        return [(index, split[i]) for i, index in enumerate(indices) if tokens[i]]
