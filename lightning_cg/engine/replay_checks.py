"""Which replays of a graph are checked against eager, and what a check must leave as it was.

A graph is checked at its first replay (a value fixed at capture shows in any replay),
at the first :data:`FIRST_PADDED_CHECKS` replays of each kind of padding it gets (rows
that interact show only once padded, and some only on some data), and from then on at
replays spaced so that checking costs at most :data:`CHECK_SHARE` of the graph's replay
time, for as long as the graph serves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

#: Checked replays of each kind of padding (``tokens``, ``items`` or both) before sampling.
FIRST_PADDED_CHECKS = 3
#: Largest share of a graph's replay time its sampled checks may cost.
CHECK_SHARE = 0.01


@dataclass
class CheckSchedule:
    """One graph's checks: which replay is checked next, from what the last check cost."""

    #: Checks passed per kind of padding (the empty set: an unpadded replay).
    passed: dict[frozenset[str], int] = field(default_factory=dict)
    #: Replays since the graph was captured, checked ones included.
    replays: int = 0
    #: The replay at which the next sampled check is due (None: none passed yet).
    next_sampled: int | None = None

    def due(self, padded: frozenset[str]) -> bool:
        """Whether the next replay, with padding of the kinds ``padded``, is checked."""
        first_checks = FIRST_PADDED_CHECKS if padded else 1
        if self.passed.get(padded, 0) < first_checks:
            return True
        return self.next_sampled is not None and self.replays + 1 >= self.next_sampled

    def replayed(self) -> None:
        """One more replay served unchecked."""
        self.replays += 1

    def checked(self, padded: frozenset[str], replay_seconds: float, check_seconds: float) -> None:
        """A replay with ``padded`` padding matched eager; the check took ``check_seconds``
        beside the replay's ``replay_seconds``: the next sampled check comes once the
        replays since cost ``check_seconds / CHECK_SHARE``."""
        self.replays += 1
        self.passed[padded] = self.passed.get(padded, 0) + 1
        spacing = check_seconds / (CHECK_SHARE * max(replay_seconds, 1e-9))
        self.next_sampled = self.replays + max(1, math.ceil(spacing))


class BufferState:
    """A copy of a module's buffers (none for None): which a forward changed, and putting
    them back."""

    def __init__(self, module: nn.Module | None) -> None:
        self._module = nn.Module() if module is None else module
        buffers = self._module.named_buffers()
        self._saved = {name: (buffer, buffer.clone()) for name, buffer in buffers}

    def changed(self) -> list[str]:
        """Names of the buffers whose value, or tensor, differs from the copy."""
        current = dict(self._module.named_buffers())
        changed = [
            name
            for name, (tensor, copy) in self._saved.items()
            if current.get(name) is not tensor or not _same(tensor, copy)
        ]
        return changed + sorted(set(current) - set(self._saved))

    def restore(self) -> None:
        """Put every saved buffer back, in its own storage (graphs read it by address)."""
        for name, (tensor, copy) in self._saved.items():
            owner_name, _, leaf = name.rpartition(".")
            owner = self._module.get_submodule(owner_name)
            if owner._buffers.get(leaf) is not tensor:
                owner._buffers[leaf] = tensor
            tensor.copy_(copy)


def _same(tensor: torch.Tensor, copy: torch.Tensor) -> bool:
    if tensor.shape != copy.shape or tensor.dtype != copy.dtype:
        return False
    if torch.equal(tensor, copy):
        return True
    # NaN is unequal to itself: a buffer holding NaN is unchanged if the NaNs stay.
    return (
        tensor.is_floating_point()
        and torch.equal(tensor.isnan(), copy.isnan())
        and torch.equal(tensor.nan_to_num(), copy.nan_to_num())
    )
