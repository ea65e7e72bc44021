"""lightning-cg: budget-batched CUDA graph replay of vision towers from PyTorch Lightning.

``lightning_cg.budgets``, ``packing`` and ``dispatcher`` are pure Python; the
callback and manager are imported on first use so that importing those stays
free of torch.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["CUDAGraphCallback", "EncoderGraphManager", "BudgetConfig", "GraphMode"]

_LAZY = {
    "CUDAGraphCallback": "lightning_cg.callback",
    "EncoderGraphManager": "lightning_cg.manager",
    "BudgetConfig": "lightning_cg.config",
    "GraphMode": "lightning_cg.dispatcher",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_cg' has no attribute {name!r}")
