"""Weight casts made once per run instead of on every replay.

A graph captured under autocast replays a cast kernel per weight. Graphs are captured
with low-precision copies of ``Linear`` and ``Conv`` weights instead (autocast leaves
them as they are), refreshed at each run's start; 2-D conv copies are channels_last
(NHWC, faster in low precision). Weights changed mid-run are seen from the next run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from lightning_cg.engine.replay import relative_error

#: The forwards of modules whose weight and bias feed only autocast's
#: low-precision ops (subclasses that keep them are served too).
_SERVED_FORWARDS = frozenset(kind.forward for kind in (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))
#: Autocast dtypes the copies are made in.
_LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass
class _Copy:
    module: nn.Module
    name: str
    master: nn.Parameter
    low: nn.Parameter


def weight_casts_for(encoder: object, enabled: bool) -> WeightCasts | None:
    """Weight copies for an adapter's ``tower``; None when off or it names no module."""
    tower = getattr(encoder, "tower", None)
    return WeightCasts(tower) if enabled and isinstance(tower, nn.Module) else None


class WeightCasts:
    """Low-precision copies of a tower's ``Linear`` and ``Conv`` weights, per autocast dtype.

    Args:
        tower: the module whose graphs are captured.

    Example:
        >>> casts = WeightCasts(tower)
        >>> with casts.swapped_in(torch.bfloat16):
        ...     graph = capture(tower)          # reads the bfloat16 copies
        >>> casts.refresh()                     # at each run's start
    """

    def __init__(self, tower: nn.Module) -> None:
        self._tower = tower
        self._copies: dict[torch.dtype, list[_Copy]] = {}
        #: Conv copies in channels_last: a tower with grouped convolutions keeps their
        #: layout (one layout throughout, no conversions between layers).
        self.channels_last = not any(
            isinstance(module, nn.Conv2d) and module.groups > 1 for module in tower.modules()
        )

    @contextlib.contextmanager
    def swapped_in(self, dtype: torch.dtype | None) -> Iterator[None]:
        """The tower with its served weights as ``dtype`` copies; a no-op for
        ``None`` or a dtype that needs no cast."""
        copies = self._copies_for(dtype) if dtype in _LOW_PRECISION else []
        for copy in copies:
            copy.module._parameters[copy.name] = copy.low
        try:
            yield
        finally:
            for copy in copies:
                copy.module._parameters[copy.name] = copy.master

    def refresh(self) -> None:
        """Copy the tower's current weights into every copy (cast as autocast would)."""
        with torch.no_grad():
            for copies in self._copies.values():
                for copy in copies:
                    copy.low.copy_(copy.master)

    def clear(self) -> None:
        """Drop every copy (the graphs that read them are gone)."""
        self._copies.clear()

    @property
    def nbytes(self) -> int:
        """Bytes of GPU (or host) memory the copies hold, over every dtype."""
        return sum(
            copy.low.numel() * copy.low.element_size()
            for copies in self._copies.values()
            for copy in copies
        )

    def _copies_for(self, dtype: torch.dtype) -> list[_Copy]:
        if dtype not in self._copies:
            self._copies[dtype] = list(self._make_copies(dtype))
        return self._copies[dtype]

    def _make_copies(self, dtype: torch.dtype) -> Iterator[_Copy]:
        for module in self._tower.modules():
            if type(module).forward not in _SERVED_FORWARDS:
                continue
            for name, master in module.named_parameters(recurse=False):
                if master.dtype != torch.float32:
                    continue
                low = master.detach().to(dtype)
                if low.dim() == 4 and self.channels_last:
                    # A 2-D convolution's weight: channels_last makes cuDNN run the
                    # convolution and what follows it in NHWC (see the module docstring).
                    low = low.contiguous(memory_format=torch.channels_last)
                yield _Copy(module, name, master, nn.Parameter(low, requires_grad=False))

    @staticmethod
    def agree(with_copies: torch.Tensor, without: torch.Tensor, tolerance: float) -> bool:
        """Whether a warm-up with the copies gave what one without them did."""
        if with_copies.shape != without.shape or with_copies.dtype != without.dtype:
            return False
        return relative_error(with_copies, without) <= tolerance
