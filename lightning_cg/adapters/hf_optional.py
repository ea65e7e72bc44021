"""transformers as an optional dependency: imported only when needed, never to recognise a tower."""

from __future__ import annotations

import inspect
import sys
from typing import Any

from torch import nn

#: Where to get the optional dependency.
INSTALL_HINT = "pip install 'lightning-cg[hf]'"


def require_transformers(what: str) -> Any:
    """The transformers module, or an ImportError that says how to install it."""
    try:
        import transformers
    except ImportError as error:
        raise ImportError(
            f"{what} needs the optional dependency transformers, which is not installed: "
            f"{INSTALL_HINT}"
        ) from error
    return transformers


def is_transformers_tower(tower: nn.Module) -> bool:
    """Whether ``tower`` is a transformers ``PreTrainedModel`` taking ``pixel_values``."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(tower, transformers.PreTrainedModel):
        return False
    return "pixel_values" in inspect.signature(type(tower).forward).parameters
