import functools
import random
import time
from collections.abc import Callable

import pytest
import torch
from test_compile_regions import AttemptCounter
from torch import nn
from toy_encoder import ToyEncoder, ToyTower

import lightning_cg.engine.compiled as compiled_module
from examples.models.lit import build_tower
from examples.models.packed_vit import PackedViT
from examples.models.packed_vit_config import packed_vit_small_config
from lightning_cg.adapters.batched import BatchedEncoderAdapter
from lightning_cg.adapters.packed import PackedEncoderAdapter
from lightning_cg.engine.compiled import CompiledEncoder
from lightning_cg.engine.encoder import GraphableEncoder
from lightning_cg.engine.manager import EncoderGraphManager
from lightning_cg.engine.replay import relative_error


def make_batch(rng: random.Random, lengths: list[int], device="cpu", dtype=torch.float32):
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    tokens = torch.randn(sum(lengths), 8, generator=generator).to(device=device, dtype=dtype)
    return tokens, torch.tensor(lengths)


def run(manager: EncoderGraphManager, tokens: torch.Tensor, lengths: torch.Tensor):
    return manager.execute(manager.encoder.inputs_from_call((tokens, lengths), {}))


def check_parity(manager: EncoderGraphManager, tower: ToyTower, tolerance: float, **batch) -> None:
    rng = random.Random(0)
    with torch.no_grad():
        for _ in range(20):
            lengths = [rng.randrange(1, 40) for _ in range(rng.randrange(1, 4))]
            tokens, lengths = make_batch(rng, lengths, **batch)
            actual = run(manager, tokens, lengths)
            assert relative_error(actual, tower(tokens, lengths)) < tolerance


def test_compiled_encoder_delegates_all_but_the_graph_forward():
    tower = ToyTower(global_tokens=4).eval()
    encoder = ToyEncoder(tower)
    compiled = CompiledEncoder(encoder, backend="eager")
    assert isinstance(compiled, GraphableEncoder)
    assert compiled.tower is tower  # the adapter's own attributes
    assert compiled.graph_config() == encoder.graph_config()
    assert compiled.token_budget_range("global") == encoder.token_budget_range("global")
    assert compiled.compile_seconds == 0.0


def test_manager_replays_the_compiled_forward():
    # backend="eager" traces with dynamo without generating code: fast on any CPU.
    torch.manual_seed(0)
    tower = ToyTower(global_tokens=4).eval()
    compiled = []
    encoder = CompiledEncoder(ToyEncoder(tower), backend="eager", on_compile=compiled.append)
    manager = EncoderGraphManager(encoder, capture="first_use")
    check_parity(manager, tower, 1e-5)
    assert manager.stats.hits > 0
    assert len(compiled) == 2  # one path each
    assert encoder.compile_seconds == pytest.approx(sum(compiled)) and sum(compiled) > 0


class ShapeRecordingBackend:
    """A ``torch.compile`` backend that runs the traced graph as it is and records,
    per compile, whether its sizes were symbolic (a SymInt among its inputs)."""

    def __init__(self) -> None:
        self.symbolic: list[bool] = []

    def __call__(self, graph_module: torch.fx.GraphModule, example_inputs: list) -> Callable:
        self.symbolic.append(any(isinstance(value, torch.SymInt) for value in example_inputs))
        return graph_module.forward


def test_static_shapes_compile_the_first_budget_as_is_then_once_with_a_symbolic_batch():
    torch.manual_seed(0)
    tower = nn.Sequential(nn.Flatten(), nn.Linear(12, 4)).eval()
    backend, compiles = ShapeRecordingBackend(), []
    adapter = BatchedEncoderAdapter(tower)
    assert adapter.graph_config().compile_shapes == "static"
    encoder = CompiledEncoder(adapter, backend=backend, on_compile=compiles.append)
    manager = EncoderGraphManager(encoder, capture="first_use")
    with torch.no_grad():
        for batch_size in (1, 2, 3, 8, 1, 2):  # budgets 1, 2, 4, 8 of the pow2 ladder
            images = torch.randn(batch_size, 3, 2, 2)
            actual = manager.execute(encoder.inputs_from_call((images,), {}))
            torch.testing.assert_close(actual, tower(images))
    assert manager.stats.hits == 6
    # Budget 1 compiled static; budget 2 recompiled with the batch symbolic, which
    # budgets 4 and 8 reuse.
    assert backend.symbolic == [False, True]
    # Each budget's first forward is counted: the policy leaves compiles out of capture cost.
    assert len(compiles) == 4


def test_dynamic_shapes_compile_once_per_path_with_symbolic_sizes():
    torch.manual_seed(0)
    tower = ToyTower(global_tokens=4).eval()
    backend, compiles = ShapeRecordingBackend(), []
    encoder = CompiledEncoder(ToyEncoder(tower), backend=backend, on_compile=compiles.append)
    assert encoder.graph_config().compile_shapes == "dynamic"
    manager = EncoderGraphManager(encoder, capture="first_use")
    check_parity(manager, tower, 1e-5)
    assert len(manager.cache) > 2  # several budgets per path
    # At most one compile per path, symbolic from the first: no budget recompiles.
    assert 1 <= len(backend.symbolic) <= 2 and all(backend.symbolic)
    assert len(compiles) == 2  # each path's first forward


@pytest.mark.cuda
def test_the_policy_leaves_the_one_time_compile_out_of_a_keys_capture_cost(monkeypatch):
    # The compile of a path's first capture (its warm-up, on CUDA) is paid once;
    # counted as that key's capture cost it would make every later key of the
    # path look unrepayable.
    # A compile of at least half a second: with dynamo already warm from other
    # tests, tracing the toy alone can be quicker than its capture.
    def slow_backend(graph_module, example_inputs):
        time.sleep(0.5)
        return graph_module.forward

    monkeypatch.setattr(
        compiled_module, "CompiledEncoder", functools.partial(CompiledEncoder, backend=slow_backend)
    )
    manager = EncoderGraphManager(ToyEncoder(ToyTower().cuda().eval()), compile=True)
    manager.begin_run(expected_calls=100)
    rng = random.Random(0)
    with torch.no_grad():
        for _ in range(20):
            run(manager, *make_batch(rng, [16, 16], device="cuda"))
    assert len(manager.cache) and manager.stats.compile_seconds > 0
    for key in manager.cache.keys():
        assert manager.policy.estimates(key)["capture_s"] < manager.stats.compile_seconds / 2


@pytest.mark.slow
def test_compile_true_matches_eager_on_cpu():
    # Inductor generates and builds C++ for the CPU: about 45 s cold on two cores.
    torch.manual_seed(0)
    tower = ToyTower().eval()
    manager = EncoderGraphManager(ToyEncoder(tower), compile=True, capture="first_use")
    assert isinstance(manager.encoder, CompiledEncoder)
    check_parity(manager, tower, 1e-5)
    assert manager.stats.hits > 0 and manager.stats.compile_seconds > 0


def test_compile_is_refused_where_the_mode_captures_no_graph():
    # It would compile nothing: refused, not dropped.
    with pytest.raises(ValueError, match=r"compile=True.*mode 'none' captures no graph"):
        EncoderGraphManager(ToyEncoder(ToyTower()), mode="none", compile=True)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["full", "full_uniform_only"])
def test_cuda_compiled_capture_matches_eager_in_bf16(mode):
    torch.manual_seed(0)
    tower = ToyTower(global_tokens=4).cuda().to(torch.bfloat16).eval()
    manager = EncoderGraphManager(ToyEncoder(tower), mode=mode, compile=True, capture="first_use")
    check_parity(manager, tower, 2e-2, device="cuda", dtype=torch.bfloat16)
    stats = manager.stats
    assert stats.hits > 0 and stats.graphs > 0 and stats.compile_seconds > 0
    assert all(graph.cuda_graph is not None for graph in manager.cache.graphs())


def tiny_packed_vit(depth: int = 3) -> PackedViT:
    config = packed_vit_small_config(hidden_size=32, depth=depth, num_heads=2, out_hidden_size=16)
    return PackedViT(config).eval()


def test_repeated_blocks_compile_once_for_every_block_and_budget():
    torch.manual_seed(0)
    # Six blocks hold most of the tower's weights, so they are compiled alone.
    tower, backend = tiny_packed_vit(depth=6), ShapeRecordingBackend()
    encoder = CompiledEncoder(PackedEncoderAdapter(tower), backend=backend)
    assert encoder.compiled_blocks.blocks == list(tower.blocks)
    manager = EncoderGraphManager(encoder, capture="first_use")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for grid in ([(1, 4, 4)], [(1, 4, 6), (1, 2, 2)], [(1, 2, 4)] * 3, [(1, 24, 24)]):
            patches = torch.randn(sum(h * w for _, h, w in grid), 3 * 16 * 16, generator=generator)
            call = encoder.inputs_from_call((patches, torch.tensor(grid)), {})
            torch.testing.assert_close(manager.execute(call), tower(patches, torch.tensor(grid)))
    # Graphs of the 64-token budget with 1, 2 and 4 item slots, and of the
    # 256-token budget (144 tokens): buffers of four shapes.
    assert len(manager.cache) == 4
    # One symbolic compile of one block's forward, shared by all blocks and shapes.
    assert backend.symbolic == [True]
    # The tower's own (eager) calls above ran the class forward: nothing left installed.
    assert not any("forward" in vars(block) for block in tower.blocks)


def test_a_tower_without_repeated_blocks_compiles_whole_in_one_attempt():
    torch.manual_seed(0)
    tower = tiny_packed_vit(depth=1)
    backend = AttemptCounter()
    encoder = CompiledEncoder(PackedEncoderAdapter(tower), backend=backend)
    assert encoder.compiled_blocks is None
    manager = EncoderGraphManager(encoder, capture="first_use")
    grid = torch.tensor([(1, 4, 6), (1, 2, 2)])
    patches = torch.randn(28, 3 * 16 * 16)
    with torch.no_grad():
        actual = manager.execute(encoder.inputs_from_call((patches, grid), {}))
        torch.testing.assert_close(actual, tower(patches, grid))
    # The tower's float settings (its norms' eps) are constants: dynamo traced the
    # forward once, not once with them as symbols and again without.
    assert backend.attempts == 1


def test_packed_towers_compile_their_blocks_and_batch_first_towers_whole():
    packed = CompiledEncoder(PackedEncoderAdapter(PackedViT(packed_vit_small_config())), "eager")
    assert packed.compiled_blocks is not None and len(packed.compiled_blocks.blocks) == 12
    vit = build_tower(
        "vit_b_16", image_size=32, num_layers=3, num_heads=2, hidden_dim=32, mlp_dim=64
    )
    # Static shapes: one compile per budget, of the whole forward.
    assert CompiledEncoder(BatchedEncoderAdapter(vit), "eager").compiled_blocks is None


@pytest.mark.cuda
def test_cuda_compiled_blocks_capture_matches_eager_in_bf16():
    torch.manual_seed(0)
    tower = tiny_packed_vit(depth=6).cuda().to(torch.bfloat16)
    manager = EncoderGraphManager(PackedEncoderAdapter(tower), compile=True, capture="first_use")
    assert manager.encoder.compiled_blocks is not None
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for grid in ([(1, 4, 4)], [(1, 4, 6), (1, 2, 2)], [(1, 8, 8)], [(1, 4, 6), (1, 2, 2)]):
            patches = torch.randn(sum(h * w for _, h, w in grid), 3 * 16 * 16, generator=generator)
            patches = patches.to("cuda", torch.bfloat16)
            call = manager.encoder.inputs_from_call((patches, torch.tensor(grid)), {})
            actual = manager.execute(call)
            assert relative_error(actual, tower(patches, torch.tensor(grid))) < 2e-2
    assert manager.stats.hits > 0 and manager.stats.compile_seconds > 0
