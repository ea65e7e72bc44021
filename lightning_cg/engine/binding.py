"""Graph lifetime: keep a tower reading the storage its graphs were captured on.

A CUDA graph reads parameters and buffers by address. Lightning's teardown
moves a module to the CPU and back (``.cpu()`` then ``.cuda()``), and
``load_state_dict(..., assign=True)`` swaps tensors in: the tower then holds
equal-shaped tensors in new storage, and graphs captured before would read
freed memory. :class:`TensorBinding` remembers the tensors a capture read and,
when the tower comes back with tensors of the same shapes, dtypes and device
in new storage, copies the new values into the remembered storage and points
the tower back at it: the graphs stay valid and nothing is recaptured. Only a
change of shape, dtype or device (or of which tensors exist) needs a recapture.

While the tower is elsewhere (on the CPU between runs), the remembered device
tensors stay allocated: that is the price of keeping the graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

#: Outcomes of :meth:`TensorBinding.rebind`.
UNCHANGED, REBOUND, CHANGED = "unchanged", "rebound", "changed"


@dataclass(frozen=True)
class _Slot:
    """Where a tensor lives in the module tree: owner module, attribute, kind."""

    owner: nn.Module
    attribute: str
    is_parameter: bool


class TensorBinding:
    """The parameters and buffers of a module as its graphs read them.

    Example:
        >>> binding = TensorBinding(tower)      # before capturing
        >>> tower.cpu(); tower.cuda()           # what a Trainer's teardown does
        >>> binding.rebind(tower)               # values copied back, graphs kept
        'rebound'
    """

    def __init__(self, module: nn.Module) -> None:
        self._slots, self._tensors = _tensors_of(module)

    def rebind(self, module: nn.Module) -> str:
        """Put ``module``'s current values into the bound storage.

        Returns:
            ``unchanged`` (same storage), ``rebound`` (new storage of the same
            layout: values copied in, the module points at the bound tensors
            again) or ``changed`` (a shape, dtype, device or the set of tensors
            differs: graphs must be recaptured; nothing was touched).
        """
        slots, current = _tensors_of(module)
        if slots.keys() != self._slots.keys() or any(
            not _same_layout(current[name], self._tensors[name]) for name in current
        ):
            return CHANGED
        moved = [
            name
            for name in current
            if current[name].data_ptr() != self._tensors[name].data_ptr()
            or slots[name] != self._slots[name]
        ]
        if not moved:
            return UNCHANGED
        with torch.no_grad():
            for name in moved:
                self._tensors[name].copy_(current[name])
                _point_at(slots[name], self._tensors[name])
        return REBOUND


def _tensors_of(module: nn.Module) -> tuple[dict[str, _Slot], dict[str, torch.Tensor]]:
    """Every parameter and buffer by qualified name: where it lives, and its data."""
    slots, tensors = {}, {}
    for kind, named in (("param", module.named_parameters), ("buffer", module.named_buffers)):
        for name, tensor in named(remove_duplicate=False):
            if tensor is None:
                continue
            owner_name, _, attribute = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            key = f"{kind}:{name}"
            slots[key] = _Slot(owner, attribute, kind == "param")
            tensors[key] = tensor.detach()
    return slots, tensors


def _point_at(slot: _Slot, bound: torch.Tensor) -> None:
    if slot.is_parameter:
        # The Parameter object stays (optimizers and hooks hold it); its data moves.
        getattr(slot.owner, slot.attribute).data = bound
    else:
        setattr(slot.owner, slot.attribute, bound)


def _same_layout(first: torch.Tensor, second: torch.Tensor) -> bool:
    return (first.shape, first.dtype, first.device) == (second.shape, second.dtype, second.device)
