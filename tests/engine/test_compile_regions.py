import functools

import pytest
import torch
from torch import nn
from torch._dynamo.backends.debugging import aot_eager

from lightning_cg.engine.compile_regions import (
    MIN_BLOCK_WEIGHT_SHARE,
    CompiledBlocks,
    blocks_to_compile,
    repeated_blocks,
    weight_share,
)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(x).relu()


class OtherBlock(Block):
    pass


class StackTower(nn.Module):
    """An embedding, ``depth`` blocks and a head of ``head_width`` outputs."""

    def __init__(self, depth: int = 4, width: int = 16, head_width: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(3, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, head_width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_the_largest_list_of_blocks_of_one_class_is_found():
    tower = StackTower(depth=4)
    tower.pair = nn.Sequential(Block(16), Block(16))  # smaller: not chosen
    tower.mixed = nn.ModuleList([Block(16), OtherBlock(16), Block(16), Block(16), Block(16)])
    assert repeated_blocks(tower) == list(tower.blocks)


def test_a_block_listed_twice_is_compiled_and_restored_once():
    tower = StackTower(depth=2)
    shared = tower.blocks[0]
    tower.blocks.append(shared)  # weight sharing: the first block runs again last
    blocks = repeated_blocks(tower)
    assert blocks == [shared, tower.blocks[1]]
    x = torch.randn(3, 3)
    expected = tower(x)
    with CompiledBlocks(blocks, CountingCompile()).installed():
        torch.testing.assert_close(tower(x), expected)
    assert not any("forward" in vars(block) for block in tower.blocks)


def test_blocks_with_a_forward_set_on_the_instance_are_left_alone():
    tower = StackTower(depth=4)
    tower.blocks[2].forward = lambda x: x
    assert repeated_blocks(tower) == []


def test_the_blocks_are_compiled_alone_only_when_they_hold_most_weights():
    heavy_blocks = StackTower(head_width=4)
    assert weight_share(list(heavy_blocks.blocks), heavy_blocks) > MIN_BLOCK_WEIGHT_SHARE
    assert blocks_to_compile(heavy_blocks, dynamic_shapes=True) == list(heavy_blocks.blocks)
    heavy_head = StackTower(head_width=400)
    assert weight_share(list(heavy_head.blocks), heavy_head) < MIN_BLOCK_WEIGHT_SHARE
    assert blocks_to_compile(heavy_head, dynamic_shapes=True) == []


def test_static_shapes_and_towers_without_blocks_compile_whole():
    assert blocks_to_compile(StackTower(head_width=4), dynamic_shapes=False) == []
    assert blocks_to_compile(nn.Linear(2, 2), dynamic_shapes=True) == []
    assert blocks_to_compile(None, dynamic_shapes=True) == []


class CountingCompile:
    """Stands for ``torch.compile``: wraps the function and counts its calls."""

    def __init__(self) -> None:
        self.compiled: list = []
        self.calls = 0

    def __call__(self, function):
        self.compiled.append(function)

        def compiled(*args, **kwargs):
            self.calls += 1
            return function(*args, **kwargs)

        return compiled


def test_installed_blocks_share_one_compiled_forward_and_are_restored():
    torch.manual_seed(0)
    tower = StackTower().eval()
    x = torch.randn(5, 3)
    expected = tower(x)
    compile_function = CountingCompile()
    compiled = CompiledBlocks(list(tower.blocks), compile_function)
    assert compile_function.compiled == []  # compiled at first use
    with compiled.installed():
        torch.testing.assert_close(tower(x), expected)
    assert compile_function.compiled == [Block.forward]
    assert compile_function.calls == len(tower.blocks)
    tower(x)  # after: eager, the class forward again
    assert compile_function.calls == len(tower.blocks)
    assert not any("forward" in vars(block) for block in tower.blocks)


def test_blocks_are_restored_when_the_forward_raises():
    tower = StackTower()
    compiled = CompiledBlocks(list(tower.blocks), CountingCompile())
    with pytest.raises(RuntimeError, match="mat1 and mat2"), compiled.installed():
        tower(torch.randn(2, 7))  # wrong width
    assert not any("forward" in vars(block) for block in tower.blocks)


class ViewInputTower(StackTower):
    """A :class:`StackTower` whose first block gets a view (of the embedding's output)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x).view(-1, self.head.in_features)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class GraphCounter:
    """A ``torch.compile`` backend that runs the traced graph as it is and counts the graphs."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph_module: torch.fx.GraphModule, example_inputs: list):
        self.graphs += 1
        return graph_module.forward


def test_one_dynamic_compile_serves_a_view_input_and_rows_equal_to_the_width():
    # The first block's input is a view, the others' are not; the first call's
    # 16 rows equal the blocks' width. Either would recompile the block.
    torch.manual_seed(0)
    tower = ViewInputTower(width=16).eval()
    backend = GraphCounter()
    compiled = CompiledBlocks(
        list(tower.blocks), functools.partial(torch.compile, dynamic=True, backend=backend)
    )
    with torch.no_grad():
        for rows in (16, 24, 40):
            x = torch.randn(rows, 3)
            with compiled.installed():
                actual = tower(x)
            torch.testing.assert_close(actual, tower(x))
    assert backend.graphs == 1


def test_with_grad_the_blocks_inputs_keep_their_autograd_history():
    torch.manual_seed(0)
    tower = ViewInputTower(width=16)
    x = torch.randn(4, 3)
    tower(x).sum().backward()
    expected = [parameter.grad.clone() for parameter in tower.parameters()]
    tower.zero_grad()
    compiled = CompiledBlocks(list(tower.blocks), functools.partial(torch.compile, backend="eager"))
    with compiled.installed():
        tower(x).sum().backward()
    for parameter, gradient in zip(tower.parameters(), expected, strict=True):
        torch.testing.assert_close(parameter.grad, gradient)


class NormBlock(nn.Module):
    """A block with a float setting: its LayerNorm's ``eps``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width, eps=1e-6)
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(self.norm(x))


class AttemptCounter:
    """A ``torch.compile`` backend that counts dynamo's attempts at handing it a
    graph and compiles through aot_autograd, as inductor does (no code generated)."""

    def __init__(self) -> None:
        self.attempts = 0

    def __call__(self, graph_module: torch.fx.GraphModule, example_inputs: list):
        self.attempts += 1
        return aot_eager(graph_module, example_inputs)


def test_a_blocks_float_settings_compile_in_one_attempt():
    # With dynamic shapes dynamo would trace eps as a symbol that aot_autograd
    # cannot use, then trace the block again: a second attempt, seconds on the GPU.
    torch.manual_seed(0)
    blocks = [NormBlock(16).eval() for _ in range(2)]
    backend = AttemptCounter()
    compiled = CompiledBlocks(
        blocks, functools.partial(torch.compile, dynamic=True, backend=backend)
    )
    with torch.no_grad():
        for rows in (5, 9):
            x = torch.randn(rows, 16)
            expected = blocks[1](blocks[0](x))
            with compiled.installed():
                actual = blocks[1](blocks[0](x))
            torch.testing.assert_close(actual, expected)
    assert backend.attempts == 1
