"""Budgets no device can hold, refused before anything is allocated.

``B`` times an adapter's ``min_bytes_per_token(path)`` (the input rows alone) is a lower
bound on what a graph of budget ``B`` allocates; only a budget whose bound exceeds every
memory in reach is refused, so a refusal is never wrong.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch

from lightning_cg.engine.config import BudgetConfig, GraphConfig

#: Bytes of the narrowest value a tower's input takes (bfloat16, float16): keeps the bound low.
MIN_ELEMENT_BYTES = 2
_GIB = 1 << 30


def host_memory_bytes() -> int | None:
    """Physical memory of this machine; None where the OS does not tell."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def memory_in_reach(device: torch.device | None) -> tuple[int, str] | None:
    """The most bytes a tower on ``device`` may run in, and where: a CUDA device's total,
    else (the tower may still move) the larger of host memory and the largest GPU's."""
    if device is not None and device.type == "meta":
        return None
    if device is not None and device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, str(device)
    candidates = []
    host = host_memory_bytes()
    if host:
        candidates.append((host, "host memory"))
    if torch.cuda.is_available():
        candidates += [
            (torch.cuda.get_device_properties(index).total_memory, f"cuda:{index}")
            for index in range(torch.cuda.device_count())
        ]
    return max(candidates) if candidates else None


def check_budgets_fit(
    encoder: object, budgets: Mapping[str, Sequence[int]], config: GraphConfig
) -> None:
    """Refuse a path whose largest budget's input buffers alone outgrow any memory in
    reach; the error names the ``config`` field that set that budget."""
    bytes_per_token = getattr(encoder, "min_bytes_per_token", None)
    if bytes_per_token is None:
        return
    tower = getattr(encoder, "tower", None)
    parameter = next(tower.parameters(), None) if isinstance(tower, torch.nn.Module) else None
    reach = memory_in_reach(None if parameter is None else parameter.device)
    if reach is None:
        return
    limit, where = reach
    for path, path_budgets in budgets.items():
        per_token = bytes_per_token(path)
        largest = max(path_budgets, default=0)
        if not per_token or largest * per_token <= limit:
            continue
        field, value = _budget_field(path, config, largest)
        raise ValueError(
            f"{field}={value} cannot fit: the largest graph of path {path!r} holds {largest} "
            f"tokens, and its static input buffers alone need at least "
            f"{largest * per_token / _GIB:.1f} GiB ({per_token} bytes a token), more than the "
            f"{limit / _GIB:.1f} GiB of {where}; keep {field} at most "
            f"{limit // per_token} tokens (far fewer in practice: activations come on top)"
        )


def _budget_field(path: str, config: GraphConfig, largest: int) -> tuple[str, str]:
    """The option that set the path's largest budget, and its value as given."""
    prefix = f"paths.{path}." if path in config.paths else ""
    choice: BudgetConfig = config.paths.get(path, config.budgets)
    if choice.budgets is not None:
        return f"{prefix}budgets", str(list(choice.budgets))
    if choice.max_budget is not None:
        return f"{prefix}max_budget", str(choice.max_budget)
    return f"{prefix}max_budget", f"{largest} (unset: the adapter's default)"
