"""Regional compilation: a tower's repeated block compiled once, shared by every block.

The compiled forward is installed only while a graph forward runs, so eager calls
(training among them) never run compiled code. One compile must serve every block and
budget, so block calls hide from dynamo what it would specialize on (see
:meth:`CompiledBlocks._forward`); every compiled call makes floats constants.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.fx.experimental import _config as symbolic_shapes_config
from torch.utils._pytree import tree_map_only

#: Share of the tower's weights its repeated blocks must hold to be compiled alone:
#: below it, too much of the tower would stay unfused.
MIN_BLOCK_WEIGHT_SHARE = 0.5


@contextmanager
def specialized_floats() -> Iterator[None]:
    """Inside the ``with`` statement, dynamo compiles Python floats (``eps``, scales) as
    constants: as symbols, aot_autograd fails on them and dynamo traces the block twice."""
    # Imported here: importing dynamo takes seconds, paid only once compiling.
    from torch._dynamo import config as dynamo_config

    with dynamo_config.patch(specialize_float=True):
        yield


def repeated_blocks(tower: nn.Module) -> list[nn.Module]:
    """The largest ``ModuleList`` / ``Sequential`` in ``tower`` of 2+ blocks of one class.

    A block listed twice counts once; lists whose blocks have an instance ``forward``
    (where the compiled one goes) are skipped; ties go to the first found.
    """
    best: list[nn.Module] = []
    for module in tower.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        blocks = list(dict.fromkeys(module))  # modules hash by identity
        if (
            len(blocks) > max(len(best), 1)
            and len({type(block) for block in blocks}) == 1
            and not any("forward" in vars(block) for block in blocks)
        ):
            best = blocks
    return best


def weight_share(blocks: list[nn.Module], tower: nn.Module) -> float:
    """Share of ``tower``'s parameter elements that ``blocks`` hold (0 for a weightless tower)."""
    total = sum(parameter.numel() for parameter in tower.parameters())
    held = sum(parameter.numel() for block in blocks for parameter in block.parameters())
    return held / total if total else 0.0


def blocks_to_compile(tower: nn.Module | None, dynamic_shapes: bool) -> list[nn.Module]:
    """The blocks regional compilation compiles; empty: compile the whole forward.

    With dynamic shapes, the repeated blocks if they hold most weights; static-shape
    compiles (batch-first towers, seconds per budget) stay whole.
    """
    if not dynamic_shapes or not isinstance(tower, nn.Module):
        return []
    blocks = repeated_blocks(tower)
    return blocks if blocks and weight_share(blocks, tower) >= MIN_BLOCK_WEIGHT_SHARE else []


class CompiledBlocks:
    """One compiled ``forward`` for a list of blocks of one class; ``compile_function``
    (``torch.compile`` with options bound) gets the class's unbound ``forward``."""

    def __init__(self, blocks: list[nn.Module], compile_function: Callable) -> None:
        if not blocks:
            raise ValueError("CompiledBlocks needs at least one block")
        self.blocks = blocks
        self._compile_function = compile_function

    @functools.cached_property
    def compiled_forward(self) -> Callable:
        """The blocks' class ``forward``, compiled at first use (importing dynamo takes seconds)."""
        return self._compile_function(type(self.blocks[0]).forward)

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Inside the ``with`` statement, every block's calls run the compiled forward."""
        for block in self.blocks:
            block.forward = functools.partial(self._forward, block)
        try:
            yield
        finally:
            for block in self.blocks:
                del block.forward

    def _forward(self, block: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """``block``'s call, run by the compiled forward without what would recompile it.

        A view argument makes dynamo guard on its base, so the next block (no view)
        recompiles: without grad the blocks get a detached alias instead (no copy).
        Duck sizing would tie a budget equal to the hidden width to it: it is off.
        """
        if not torch.is_grad_enabled():
            args, kwargs = tree_map_only(
                torch.Tensor, lambda t: t.detach() if t._is_view() else t, (args, kwargs)
            )
        with symbolic_shapes_config.patch(use_duck_shape=False), specialized_floats():
            return self.compiled_forward(block, *args, **kwargs)
