"""lightning-cg: budget-batched CUDA graph replay of vision towers from PyTorch Lightning.

``lightning_cg.core.budgets``, ``packing`` and ``dispatcher`` are pure Python; the
callback, the manager and :func:`graphed` (the manager in a plain PyTorch loop,
:mod:`lightning_cg.serve.graphed`) are imported on first use so that importing
those stays free of torch.
"""

from typing import Any

__version__ = "0.2.0"
__all__ = ["CUDAGraphCallback", "EncoderGraphManager", "BudgetConfig", "GraphMode", "graphed"]

_LAZY = {
    "CUDAGraphCallback": "lightning_cg.callback.graph_callback",
    "EncoderGraphManager": "lightning_cg.engine.manager",
    "BudgetConfig": "lightning_cg.engine.config",
    "GraphMode": "lightning_cg.core.dispatcher",
    "graphed": "lightning_cg.serve.graphed",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_cg' has no attribute {name!r}")
