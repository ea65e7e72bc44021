"""Graph lifetime: keep a tower reading the storage its graphs were captured on.

A graph reads weights by address; ``.cpu()`` then ``.cuda()`` or ``load_state_dict(assign=True)``
move them. :class:`TensorBinding` copies same-layout values back into the remembered storage
and points the tower at it, so no recapture is needed (that storage stays while it is away).
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
        """Put ``module``'s current values into the bound storage: ``unchanged``,
        ``rebound`` (values copied in, the module points back at the bound tensors) or
        ``changed`` (a layout or the set of tensors differs: recapture; nothing touched)."""
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
                bound, slot = self._tensors[name], slots[name]
                bound.copy_(current[name])
                if slot.is_parameter:
                    # The Parameter object stays (optimizers and hooks hold it); its data moves.
                    getattr(slot.owner, slot.attribute).data = bound
                else:
                    setattr(slot.owner, slot.attribute, bound)
        return REBOUND


def tensor_layouts(module: nn.Module) -> dict[str, tuple]:
    """Each parameter's and buffer's shape, dtype and device: what a graph of the module
    depends on besides the values (no tensor is kept alive)."""
    _, tensors = _tensors_of(module)
    return {name: (t.shape, t.dtype, t.device) for name, t in tensors.items()}


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


def _same_layout(first: torch.Tensor, second: torch.Tensor) -> bool:
    return (first.shape, first.dtype, first.device) == (second.shape, second.dtype, second.device)
