"""Patch (row, column) positions of packed frames in merge-window order, on the host.

A frame of ``h x w`` patches is packed window after window (row-major), each
``merge x merge`` window's patches row-major (see
:func:`examples.models.packed_patches.patchify`). Window rows come one after
another, so the positions of an ``h x w`` frame are the first ``h * w`` rows of
those of any taller frame of the same width: one table per width serves every
height up to its own. Frame sizes are cached as views of those tables, so
many image sizes fit the cache (a size seen before is one lookup) and a new
size costs a slice, not a new array.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

#: Frames whose positions (views of a table) are kept, by (h, w, merge).
_FRAMES = 1024
#: Tables kept, by (width, merge, window rows rounded up to a power of two).
_TABLES = 256


def packed_positions(frames: Sequence[tuple[int, int]], merge: int) -> np.ndarray:
    """int32 ``(sum(h*w), 2)`` patch (row, column) of ``(h, w)`` frames, frame after
    frame; a new array (callers may write it)."""
    if not frames:
        return np.empty((0, 2), dtype=np.int32)
    # numpy: a few microseconds per frame where torch's small ops cost tens.
    tables = [frame_positions(h, w, merge) for h, w in frames]
    # One frame (an image alone): a copy costs half the host time of np.concatenate.
    return tables[0].copy() if len(tables) == 1 else np.concatenate(tables)


@lru_cache(maxsize=_FRAMES)
def frame_positions(h: int, w: int, merge: int) -> np.ndarray:
    """int32 ``(h*w, 2)`` patch (row, column) of one frame, in merge-window order.

    A read-only view of a table of the frame's width, cached: a frame size
    seen before costs one cache lookup. Copy it before writing.
    """
    window_rows = h // merge
    # Heights rounded up to a power of two: a width needs a few tables, not one per height.
    table = _width_table(w, merge, 1 << max(window_rows - 1, 0).bit_length())
    return table[: h * w]


@lru_cache(maxsize=_TABLES)
def _width_table(w: int, merge: int, window_rows: int) -> np.ndarray:
    """Positions of a frame ``window_rows * merge`` patches tall and ``w`` wide."""
    windows_across = w // merge
    within = np.arange(merge, dtype=np.int32)
    # (window row, window column, row in window, column in window, (row, column))
    positions = np.empty((window_rows, windows_across, merge, merge, 2), dtype=np.int32)
    down = np.arange(window_rows, dtype=np.int32) * merge
    across = np.arange(windows_across, dtype=np.int32) * merge
    positions[..., 0] = down[:, None, None, None] + within[None, None, :, None]
    positions[..., 1] = across[None, :, None, None] + within[None, None, None, :]
    table = positions.reshape(window_rows * merge * w, 2)
    table.flags.writeable = False
    return table
