"""Regional compilation: a tower's repeated block compiled once, shared by every block.

Most vision towers are a stack of identical blocks (a transformer's layers)
that hold nearly all of their weights. Compiling one block's ``forward`` and
letting every block call it costs one block's compile instead of the whole
tower's: dynamo treats the block's parameters as inputs, so the code compiled
for the first block serves the others (torch's "regional compilation" recipe).
A cold compile then takes seconds where the whole graph forward takes minutes.

The compiled forward is installed on the blocks only while a graph forward runs
(the manager's warm-up and capture) and taken off afterwards, so the tower's
eager calls, training among them, never run compiled code.

One compile must serve every block and every budget, so the blocks' calls keep
from dynamo what it would specialize on (the Qwen towers' block compiled 3-4
times over two budgets without this; tests/adapters/test_qwen.py counts):

* a view among the arguments (the first block's input is a view of the patch
  embedding's output; Qwen2.5-VL's rotary tables are views of their window
  reordering) makes dynamo guard on its base: the next block, whose input is
  no view, recompiles, and the base's sizes specialize as well. Without grad
  (graph forwards run without it) the blocks get a detached alias of the same
  memory instead, which is no view: no copy, no kernel. With grad, views stay
  (autograd needs them) and may recompile.
* duck sizing gives sizes that are equal at the first compile one symbol: a
  budget whose rows equal the hidden width specializes the rows to the width
  (the weights fix it), and the next budget recompiles. The blocks' calls run
  with it off, so every size gets a symbol of its own.

Every compiled call (the blocks', and the whole forward's) also makes the
tower's Python floats constants (:func:`specialized_floats`): with dynamic
shapes, dynamo traces a float attribute (a LayerNorm's ``eps``) as a symbol,
aot_autograd cannot turn it into a tensor, and dynamo traces the whole block
again with the float fixed, a wasted first attempt.
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

#: ``compile_scope`` values: ``auto`` compiles the repeated blocks of a tower
#: compiled with dynamic shapes (the packed towers) when they hold most of its
#: weights, and the whole graph forward otherwise; ``blocks`` requires such
#: blocks; ``whole`` always compiles the whole graph forward.
COMPILE_SCOPES = ("auto", "blocks", "whole")

#: Share of the tower's weights its repeated blocks must hold for ``auto`` to
#: compile only them: below it, too much of the tower would stay unfused
#: (a ResNet's largest stage holds about a quarter of its weights).
MIN_BLOCK_WEIGHT_SHARE = 0.5


@contextmanager
def specialized_floats() -> Iterator[None]:
    """Inside the ``with`` statement, dynamo compiles Python floats as constants
    (they are the tower's settings: norms' ``eps``, attention scales), not as
    symbols it would trace twice (see the module's docstring)."""
    # Imported here: importing dynamo takes seconds, paid only once compiling.
    from torch._dynamo import config as dynamo_config

    with dynamo_config.patch(specialize_float=True):
        yield


def repeated_blocks(tower: nn.Module) -> list[nn.Module]:
    """The largest ``ModuleList`` / ``Sequential`` in ``tower`` of 2+ blocks of one class.

    A block listed twice (shared weights) counts once. Lists whose blocks have a
    ``forward`` set on the instance are skipped: that attribute is where the
    compiled forward goes. Ties go to the first found.
    """
    best: list[nn.Module] = []
    for module in tower.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        blocks = list(dict.fromkeys(module))  # modules hash by identity
        if len(blocks) < 2 or len({type(block) for block in blocks}) != 1:
            continue
        if len(blocks) <= len(best):
            continue
        if any("forward" in vars(block) for block in blocks):
            continue
        best = blocks
    return best


def weight_share(blocks: list[nn.Module], tower: nn.Module) -> float:
    """Share of ``tower``'s parameter elements that ``blocks`` hold (0 for a weightless tower)."""
    total = sum(parameter.numel() for parameter in tower.parameters())
    if not total:
        return 0.0
    held = sum(parameter.numel() for block in blocks for parameter in block.parameters())
    return held / total


def blocks_to_compile(tower: nn.Module | None, scope: str, dynamic_shapes: bool) -> list[nn.Module]:
    """The blocks regional compilation compiles for ``scope``; empty: compile the whole forward.

    ``auto`` leaves static-shape compiles (batch-first towers) whole: each of
    their budgets compiles in seconds; a dynamic compile of a whole packed tower
    takes far longer.

    Args:
        tower: the adapter's tower; None (an adapter without one) compiles the whole forward.
        scope: one of :data:`COMPILE_SCOPES`.
        dynamic_shapes: the compile has symbolic sizes (one compile for every budget).

    Raises:
        ValueError: ``scope`` is unknown, or ``blocks`` and the tower has no
            repeated blocks.
    """
    if scope not in COMPILE_SCOPES:
        allowed = ", ".join(COMPILE_SCOPES)
        raise ValueError(f"compile_scope must be one of {allowed} (got {scope!r})")
    if scope == "whole" or (scope == "auto" and not dynamic_shapes):
        return []
    blocks = repeated_blocks(tower) if isinstance(tower, nn.Module) else []
    if scope == "blocks":
        if not blocks:
            raise ValueError(
                f"compile_scope='blocks': {type(tower).__name__} has no ModuleList or "
                "Sequential of two or more blocks of one class; use compile_scope='whole' or 'auto'"
            )
        return blocks
    if blocks and weight_share(blocks, tower) >= MIN_BLOCK_WEIGHT_SHARE:
        return blocks
    return []


class CompiledBlocks:
    """One compiled ``forward`` for a list of blocks of one class.

    Args:
        blocks: the blocks (see :func:`repeated_blocks`).
        compile_function: ``torch.compile`` with its options bound; it is given
            the blocks' class ``forward`` (an unbound function taking the block first).
    """

    def __init__(self, blocks: list[nn.Module], compile_function: Callable) -> None:
        if not blocks:
            raise ValueError("CompiledBlocks needs at least one block")
        self.blocks = blocks
        self._compile_function = compile_function

    @functools.cached_property
    def compiled_forward(self) -> Callable:
        """The blocks' class ``forward``, compiled. Made at first use: the first
        ``torch.compile`` imports dynamo (seconds), which a tower whose calls all
        run eagerly should not pay."""
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
        """``block``'s call, run by the compiled forward without what would recompile it
        (see the module's docstring)."""
        if not torch.is_grad_enabled():
            args, kwargs = tree_map_only(torch.Tensor, _without_view, (args, kwargs))
        with symbolic_shapes_config.patch(use_duck_shape=False), specialized_floats():
            return self.compiled_forward(block, *args, **kwargs)


def _without_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or when it is a view, an alias of its memory that is none (no copy)."""
    return tensor.detach() if tensor._is_view() else tensor
